// Package etcdtest starts etcd servers on loopback ports for tests: one
// member, or a cluster of several.
//
// Each member runs in a child process (command etcdnode, built without the
// race detector), not inside the test binary: an embedded server shared the
// CPU and the pauses of a race-instrumented test process, and under a loaded
// test run it stalled for seconds, long enough for the suites' leases to run
// out. scripts/test.sh builds etcdnode once and names it in
// FENCEKIT_ETCD_NODE; without that variable the first Start of a test process
// builds it with the go command (cached in the user's cache directory).
package etcdtest

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fencekit/fencekit/internal/testenv"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// NodeEnv names an etcdnode binary to run instead of building one.
const NodeEnv = "FENCEKIT_ETCD_NODE"

const nodePkg = "github.com/fencekit/fencekit/internal/etcdtest/etcdnode"

// Node is one member of a test cluster.
type Node struct {
	Name      string
	ClientURL string
	bin       string
	args      []string // every flag, -initial-cluster included, to start it again
	cmd       *exec.Cmd
	stdin     io.Closer
	exited    chan struct{} // closed when cmd has been waited for
}

// Cluster is a running test etcd cluster.
type Cluster struct {
	Nodes []*Node
}

var (
	buildOnce sync.Once
	builtBin  string
	buildErr  error
)

// nodeBinary returns the etcdnode binary: $FENCEKIT_ETCD_NODE, or one built
// once per test process into the user's cache directory (the go command's
// build cache makes a rebuild a link step).
func nodeBinary(t testing.TB) string {
	t.Helper()
	if p := os.Getenv(NodeEnv); p != "" {
		return p
	}
	buildOnce.Do(func() {
		dir, err := os.UserCacheDir()
		if err != nil {
			dir = os.TempDir()
		}
		dir = filepath.Join(dir, "fencekit")
		if err = os.MkdirAll(dir, 0o755); err != nil {
			buildErr = err
			return
		}
		goCmd, err := exec.LookPath("go")
		if err != nil {
			buildErr = fmt.Errorf("no go command on PATH to build it: %w", err)
			return
		}
		// Built under a name of its own, then renamed: test processes of
		// other packages may build and run it at the same time.
		tmp, err := os.CreateTemp(dir, "etcdnode-*.tmp")
		if err != nil {
			buildErr = err
			return
		}
		tmp.Close()
		out, err := exec.Command(goCmd, "build", "-o", tmp.Name(), nodePkg).CombinedOutput()
		if err != nil {
			os.Remove(tmp.Name())
			buildErr = fmt.Errorf("go build %s: %v\n%s", nodePkg, err, out)
			return
		}
		builtBin = filepath.Join(dir, "etcdnode")
		if runtime.GOOS == "windows" {
			builtBin += ".exe"
		}
		buildErr = os.Rename(tmp.Name(), builtBin)
	})
	if buildErr != nil {
		t.Fatalf("etcdtest: building the etcd member binary (or set %s): %v", NodeEnv, buildErr)
	}
	return builtBin
}

// freeURL reserves a loopback port (testenv.Port: never one another test
// binary or an outgoing connection can take meanwhile).
func freeURL(t testing.TB) *url.URL {
	t.Helper()
	u, _ := url.Parse("http://" + testenv.Addr(t))
	return u
}

// Start starts an n-member cluster with data in temporary directories, each
// member a child process, and stops it at the end of the test.
func Start(t testing.TB, n int) *Cluster {
	t.Helper()
	bin := nodeBinary(t)
	c := &Cluster{}
	var initial []string
	for i := 0; i < n; i++ {
		cu, pu := freeURL(t), freeURL(t)
		nd := &Node{Name: fmt.Sprintf("node%d", i), ClientURL: cu.String(), bin: bin}
		nd.args = []string{"-name", nd.Name, "-dir", t.TempDir(), "-client-url", cu.String(), "-peer-url", pu.String()}
		c.Nodes = append(c.Nodes, nd)
		initial = append(initial, fmt.Sprintf("%s=%s", nd.Name, pu.String()))
	}
	t.Cleanup(c.Stop)
	ready := make(chan error, n)
	for _, nd := range c.Nodes {
		nd.args = append(nd.args, "-initial-cluster", strings.Join(initial, ","))
		if err := nd.start(ready); err != nil {
			t.Fatalf("starting etcd member %s: %v", nd.Name, err)
		}
	}
	// The members of a cluster become ready together (each waits for a
	// quorum), so they are awaited together.
	deadline := time.After(2 * time.Minute)
	for range c.Nodes {
		select {
		case err := <-ready:
			if err != nil {
				t.Fatalf("etcd member: %v", err)
			}
		case <-deadline:
			t.Fatal("etcd members not ready after 2m")
		}
	}
	return c
}

// start runs the member's process with its flags; ready gets nil once it
// serves clients, or an error if it exits before.
func (nd *Node) start(ready chan<- error) error {
	cmd := exec.Command(nd.bin, nd.args...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan struct{})
	nd.cmd, nd.stdin, nd.exited = cmd, in, exited
	go func() {
		sc := bufio.NewScanner(out)
		said := false
		for sc.Scan() {
			if !said && sc.Text() == "ready" {
				said = true
				ready <- nil
			}
		}
		if !said {
			ready <- fmt.Errorf("%s exited before it was ready", nd.Name)
		}
		_ = cmd.Wait()
		close(exited)
	}()
	return nil
}

// Endpoints returns the client URLs of the running members.
func (c *Cluster) Endpoints() []string {
	var eps []string
	for _, nd := range c.Nodes {
		if nd.running() {
			eps = append(eps, nd.ClientURL)
		}
	}
	return eps
}

func (nd *Node) running() bool {
	if nd.cmd == nil {
		return false
	}
	select {
	case <-nd.exited:
		return false
	default:
		return true
	}
}

// Client returns a client of every member, closed at the end of the test.
func (c *Cluster) Client(t testing.TB) *clientv3.Client {
	t.Helper()
	return NewClient(t, c.Endpoints()...)
}

// ClientAddr returns member i's client address, host:port (for a proxy).
func (c *Cluster) ClientAddr(i int) string {
	u, _ := url.Parse(c.Nodes[i].ClientURL)
	return u.Host
}

// NewClient returns a client of endpoints (host:port or URLs; a fault proxy's
// address), closed at the end of the test.
func NewClient(t testing.TB, endpoints ...string) *clientv3.Client {
	t.Helper()
	cl, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

// Leader returns the index of the member that says it leads, or -1 when none
// of the running members answers so within 10s.
func (c *Cluster) Leader() int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		for i, nd := range c.Nodes {
			if !nd.running() {
				continue
			}
			cl, err := clientv3.New(clientv3.Config{Endpoints: []string{nd.ClientURL}, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
			if err != nil {
				continue
			}
			st, err := cl.Status(ctx, nd.ClientURL)
			cl.Close()
			if err == nil && st.Leader != 0 && st.Leader == st.Header.MemberId {
				return i
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
	return -1
}

// StopNode stops member i gracefully, as embed.Etcd.Close does (a leader
// hands its leadership over first), and waits for its process to exit; after
// 30s it is killed.
func (c *Cluster) StopNode(i int) {
	nd := c.Nodes[i]
	if !nd.running() {
		return
	}
	if err := nd.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		_ = nd.cmd.Process.Kill()
	}
	select {
	case <-nd.exited:
	case <-time.After(30 * time.Second):
		_ = nd.cmd.Process.Kill()
		<-nd.exited
	}
	nd.stdin.Close()
}

// Crash kills member i with SIGKILL, as a crash would (no leadership
// handover; what its WAL holds survives, since etcd syncs it before it
// acknowledges), and waits for its process to exit.
func (c *Cluster) Crash(i int) {
	nd := c.Nodes[i]
	if !nd.running() {
		return
	}
	_ = nd.cmd.Process.Kill()
	<-nd.exited
	nd.stdin.Close()
}

// Restart starts the stopped member i again, on its data directory, ports
// and flags, and waits until it serves clients, which needs a quorum (a
// member that has a WAL ignores -initial-cluster and rejoins with the
// membership its WAL holds). It returns an error when the member exits
// first or is not ready within timeout.
func (c *Cluster) Restart(i int, timeout time.Duration) error {
	nd := c.Nodes[i]
	if nd.running() {
		return fmt.Errorf("etcd member %s is running", nd.Name)
	}
	ready := make(chan error, 1)
	if err := nd.start(ready); err != nil {
		return fmt.Errorf("starting etcd member %s again: %w", nd.Name, err)
	}
	select {
	case err := <-ready:
		return err
	case <-time.After(timeout):
		return fmt.Errorf("etcd member %s not ready %v after its restart", nd.Name, timeout)
	}
}

// Stop kills every member still running (the end of a test: its data is
// thrown away, so no graceful shutdown is waited for).
func (c *Cluster) Stop() {
	for _, nd := range c.Nodes {
		if nd.running() {
			_ = nd.cmd.Process.Kill()
		}
	}
	for _, nd := range c.Nodes {
		if nd.cmd != nil {
			<-nd.exited
			nd.stdin.Close()
		}
	}
}
