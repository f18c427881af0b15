// Package natstest runs in-process NATS servers with JetStream for tests: one
// server, or a cluster of several with replicated streams.
package natstest

import (
	"fmt"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// MaxPayload is the servers' max_payload: fencetest writes 1 MiB values, and
// the server's default is exactly 1 MiB.
const MaxPayload = 8 << 20

// Start starts one server with JetStream on a random loopback port (the
// server binds port -1 itself), its store in dir.
func Start(dir string) (*server.Server, error) {
	opts := &server.Options{
		ServerName: "single",
		Host:       "127.0.0.1",
		Port:       server.RANDOM_PORT,
		JetStream:  true,
		StoreDir:   dir,
		MaxPayload: MaxPayload,
		NoLog:      true,
		NoSigs:     true,
	}
	return run(opts)
}

func run(opts *server.Options) (*server.Server, error) {
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, err
	}
	go s.Start()
	if !s.ReadyForConnections(20 * time.Second) {
		s.Shutdown()
		return nil, fmt.Errorf("natstest: server %s not ready", opts.ServerName)
	}
	return s, nil
}

// StartMain is Start for TestMain: it starts a server with its store in a
// fresh temporary directory and returns it and a function that stops it and
// removes the directory. It exits the test binary when the server fails.
func StartMain() (*server.Server, func()) {
	dir, err := os.MkdirTemp("", "natsfence-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "natstest:", err)
		os.Exit(1)
	}
	s, err := Start(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "natstest:", err)
		os.Exit(1)
	}
	return s, func() {
		s.Shutdown()
		s.WaitForShutdown()
		_ = os.RemoveAll(dir)
	}
}

// Connect returns a client of url that reconnects fast and forever and never
// follows servers the cluster advertises, so a client dialled through a proxy
// stays behind it. It is closed when t ends.
func Connect(t testing.TB, url string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	all := append([]nats.Option{
		nats.ReconnectWait(20 * time.Millisecond),
		nats.MaxReconnects(-1),
		nats.IgnoreDiscoveredServers(),
		nats.DontRandomize(),
		nats.Timeout(2 * time.Second),
	}, opts...)
	nc, err := nats.Connect(url, all...)
	if err != nil {
		t.Fatalf("natstest: connect %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Cluster is a running in-process JetStream cluster.
type Cluster struct {
	t     testing.TB
	opts  []*server.Options
	Nodes []*server.Server // nil for a stopped node
}

// StartCluster starts an n-node cluster on loopback ports from testenv.Port,
// each node's store in a t.TempDir, and stops it when t ends.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	c := &Cluster{t: t}
	routes := make([]*url.URL, n)
	ports := make([]int, n)
	for i := range n {
		ports[i] = testenv.Port(t)
		routes[i], _ = url.Parse(fmt.Sprintf("nats://127.0.0.1:%d", ports[i]))
	}
	for i := range n {
		o := &server.Options{
			ServerName: fmt.Sprintf("n%d", i),
			Host:       "127.0.0.1",
			Port:       testenv.Port(t),
			JetStream:  true,
			StoreDir:   t.TempDir(),
			MaxPayload: MaxPayload,
			NoLog:      true,
			NoSigs:     true,
			Cluster: server.ClusterOpts{
				Name: "fencekit",
				Host: "127.0.0.1",
				Port: ports[i],
			},
			Routes: routes,
		}
		c.opts = append(c.opts, o)
	}
	for i := range n {
		s, err := run(c.opts[i])
		if err != nil {
			t.Fatal(err)
		}
		c.Nodes = append(c.Nodes, s)
	}
	t.Cleanup(func() {
		for _, s := range c.Nodes {
			if s != nil {
				s.Shutdown()
			}
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for !c.ready() {
		if time.Now().After(deadline) {
			t.Fatal("natstest: no JetStream meta leader after 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return c
}

// ready reports a meta leader that knows every running node as a peer.
func (c *Cluster) ready() bool {
	running := 0
	for _, s := range c.Nodes {
		if s != nil {
			running++
		}
	}
	for _, s := range c.Nodes {
		if s != nil && s.JetStreamIsLeader() && len(s.JetStreamClusterPeers()) >= running {
			return true
		}
	}
	return false
}

// URLs returns the client URLs of the running nodes, comma-separated.
func (c *Cluster) URLs() string {
	var u []string
	for _, s := range c.Nodes {
		if s != nil {
			u = append(u, s.ClientURL())
		}
	}
	return strings.Join(u, ",")
}

// StreamLeader returns the index of the node leading stream in account $G,
// or -1.
func (c *Cluster) StreamLeader(stream string) int {
	for i, s := range c.Nodes {
		if s != nil && s.JetStreamIsStreamLeader(server.DEFAULT_GLOBAL_ACCOUNT, stream) {
			return i
		}
	}
	return -1
}

// Stop shuts node i down and waits until it is gone.
func (c *Cluster) Stop(i int) {
	s := c.Nodes[i]
	c.Nodes[i] = nil
	s.Shutdown()
	s.WaitForShutdown()
}

// Restart starts the stopped node i again with its store and ports, and
// waits until it has rejoined; it fails the test when it cannot.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	if err := c.TryRestart(i); err != nil {
		c.t.Fatal(err)
	}
}

// TryRestart is Restart returning its failure instead (for a goroutine other
// than the test's).
func (c *Cluster) TryRestart(i int) error {
	s, err := run(c.opts[i])
	if err != nil {
		return err
	}
	c.Nodes[i] = s
	deadline := time.Now().Add(30 * time.Second)
	for !c.ready() {
		if time.Now().After(deadline) {
			return fmt.Errorf("natstest: node %d did not rejoin within 30s", i)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// ClientAddr is the host:port of node i's client listener.
func (c *Cluster) ClientAddr(i int) string {
	return fmt.Sprintf("127.0.0.1:%d", c.opts[i].Port)
}
