package testenv

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
)

// Ports handed out by Port lie below Linux's default ephemeral range
// (32768-60999), so the kernel never gives one of them to an outgoing
// connection's local end or to a listener on port 0, and low enough that a
// Redis Cluster node's bus port (port+10000) is valid too.
const (
	portLow  = 12000
	portHigh = 22000
)

var (
	portMu    sync.Mutex
	portLocks []*os.File // held until the test binary exits
)

// Port returns a loopback TCP port for a server the test is about to start.
//
// Asking the kernel for port 0 and closing the listener is racy: the kernel may
// give the same port to another test binary (go test runs packages in
// parallel) or to an outgoing connection before the server binds it, and a
// test then fails with "address already in use". Port avoids both: it picks
// from outside the ephemeral range, and it takes a lock file per port
// (lockPort; flock on Unix) that other test binaries honour, held until this
// process exits, so two tests never race for one port. It also checks that
// nothing else listens there now.
func Port(t testing.TB) int {
	t.Helper()
	portMu.Lock()
	defer portMu.Unlock()
	dir := filepath.Join(os.TempDir(), "fencekit-ports")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		t.Fatalf("port reservations: %v", err)
	}
	span := portHigh - portLow
	start := rand.IntN(span)
	for i := 0; i < span; i++ {
		p := portLow + (start+i)%span
		f, ok := lockPort(filepath.Join(dir, strconv.Itoa(p)))
		if !ok {
			continue
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			f.Close() // taken by something that does not use the lock files
			continue
		}
		l.Close()
		portLocks = append(portLocks, f)
		return p
	}
	t.Fatalf("no free loopback port in %d-%d", portLow, portHigh)
	return 0
}

// Addr returns "127.0.0.1:<Port(t)>".
func Addr(t testing.TB) string {
	t.Helper()
	return "127.0.0.1:" + strconv.Itoa(Port(t))
}
