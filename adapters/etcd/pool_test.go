package etcdfence_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// pooledAfterRelease grants name for ttl and releases it, and returns the
// etcd lease the pool then holds for ttl and its send time; it fails the
// test when the release pooled nothing (a release late in its lease's
// window pools it after a keep-alive: this waits up to 10s for it, on a
// loaded machine).
func pooledAfterRelease(t *testing.T, a *etcdfence.Acquirer, name string, ttl time.Duration) (int64, time.Time) {
	t.Helper()
	ctx := context.Background()
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	id, sent, ok := etcdfence.PooledLease(a, ttl)
	for deadline := time.Now().Add(10 * time.Second); !ok; id, sent, ok = etcdfence.PooledLease(a, ttl) {
		if time.Now().After(deadline) {
			t.Fatal("the release pooled no lease")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if id != etcdfence.LeaseID(l) {
		t.Fatalf("the pool holds lease %x, the released grant had %x", id, etcdfence.LeaseID(l))
	}
	return id, sent
}

// leaseAlive reports whether etcd still has lease id.
func leaseAlive(t *testing.T, cl *clientv3.Client, id int64) bool {
	t.Helper()
	resp, err := cl.TimeToLive(context.Background(), clientv3.LeaseID(id))
	if err != nil {
		t.Fatal(err)
	}
	return resp.TTL > 0
}

// waitLeases waits until etcd has at most n leases, as the cluster tells
// it, and fails the test after within.
func waitLeases(t *testing.T, cl *clientv3.Client, n int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		resp, err := cl.Leases(context.Background())
		if err == nil && len(resp.Leases) <= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("etcd has %d leases after %v (%v), want at most %d", len(resp.Leases), within, err, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPooledLeaseRevokedBehindThePool: the etcd lease in the
// pool is revoked by someone else (an operator); the next grant must not
// fail for it, nor hand out a lease etcd no longer has: it is granted on a
// live etcd lease of its own, holds the name, and renews.
func TestPooledLeaseRevokedBehindThePool(t *testing.T) {
	_, cl, a := oneMember(t)
	ctx := context.Background()
	name := fencetest.Name("pool-revoked")
	const ttl = 30 * time.Second
	id, _ := pooledAfterRelease(t, a, name, ttl)
	if _, err := cl.Revoke(ctx, clientv3.LeaseID(id)); err != nil {
		t.Fatal(err)
	}
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after the pooled lease was revoked: %v, want a grant on a lease of its own", err)
	}
	defer l.Release(ctx)
	if got := etcdfence.LeaseID(l); got == id || !leaseAlive(t, cl, got) {
		t.Fatalf("granted on etcd lease %x (the revoked one: %x), alive %v", got, id, got != id && leaseAlive(t, cl, got))
	}
	if err := l.Renew(ctx); err != nil {
		t.Fatalf("Renew: %v", err)
	}
	if _, err := a.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("while it holds: %v, want ErrHeld", err)
	}
}

// TestPooledLeaseDeadlineCountsFromItsSend: a grant on a pooled
// lease gets the local deadline of that lease's etcd clock, which started
// when its grant was sent, not when the pool handed it out: its context has
// ended by that send time plus the ttl less the drift margin, before etcd
// can expire the lease and grant the name to anyone else.
func TestPooledLeaseDeadlineCountsFromItsSend(t *testing.T) {
	c := etcdtest.Start(t, 1)
	a, _ := etcdfence.NewAcquirer(c.Client(t), nil)
	// A pooled lease is handed out within a tenth of its ttl; here within
	// three quarters, so that a loaded machine's pause between the release
	// and the grant below (up to 2.5s) does not make the grant take a
	// lease of its own.
	etcdfence.SetPoolWindow(a, func(ttl time.Duration) time.Duration { return ttl * 3 / 4 })
	ctx := context.Background()
	name := fencetest.Name("pool-deadline")
	const ttl = 4 * time.Second
	id, sent := pooledAfterRelease(t, a, name, ttl)
	// Age the pooled lease by 500ms: the point of the test (its hand-out
	// comes that much after its send), not a synchronisation.
	time.Sleep(time.Until(sent.Add(500 * time.Millisecond)))
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	if etcdfence.LeaseID(l) != id {
		t.Fatalf("the pooled lease was not used (%v after its send, within its 3s window): lease %x, pooled %x", time.Since(sent), etcdfence.LeaseID(l), id)
	}
	deadline := sent.Add(ttl - leasekitDrift(ttl))
	time.Sleep(time.Until(deadline) + time.Millisecond)
	if err := l.Context().Err(); err == nil {
		t.Fatalf("the lease's context is live %v after its etcd lease's grant was sent plus the ttl less the drift: its local deadline counts from the hand-out", time.Since(sent))
	}
}

// leasekitDrift is the default drift margin (leasekit.DefaultDrift).
func leasekitDrift(ttl time.Duration) time.Duration { return ttl/100 + 2*time.Millisecond }

// TestPooledLeaseUnusedIsRevoked: a pooled lease that no grant takes within
// a tenth of its ttl is revoked, long before its ttl, and the next grant
// takes a lease of its own.
func TestPooledLeaseUnusedIsRevoked(t *testing.T) {
	_, cl, a := oneMember(t)
	ctx := context.Background()
	name := fencetest.Name("pool-stale")
	const ttl = 10 * time.Second
	id, _ := pooledAfterRelease(t, a, name, ttl)
	deadline := time.Now().Add(ttl / 2)
	for leaseAlive(t, cl, id) {
		if time.Now().After(deadline) {
			t.Fatalf("the pooled lease, unused, still lives %v after its release (window %v)", ttl/2, ttl/10)
		}
		time.Sleep(20 * time.Millisecond)
	}
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if etcdfence.LeaseID(l) == id || !leaseAlive(t, cl, etcdfence.LeaseID(l)) {
		t.Fatalf("granted on lease %x (stale: %x)", etcdfence.LeaseID(l), id)
	}
	_ = l.Release(ctx)
}

// TestPooledLeaseNotTouchedByTheOldGrant: a grant whose release pooled its
// etcd lease may be released and renewed again (ErrLost), and that must not
// touch the lease the next grant now holds: the next grant's key and lease
// stay, and the name stays held.
func TestPooledLeaseNotTouchedByTheOldGrant(t *testing.T) {
	c, cl, a := oneMember(t)
	other, _ := etcdfence.NewAcquirer(c.Client(t), nil)
	ctx := context.Background()
	name := fencetest.Name("pool-old")
	const ttl = 30 * time.Second
	l1, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := l1.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l2, err := a.TryAcquire(ctx, name+"-2", ttl)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release(ctx)
	if etcdfence.LeaseID(l2) != etcdfence.LeaseID(l1) {
		t.Fatalf("the second grant did not take the pooled lease (%x, first %x)", etcdfence.LeaseID(l2), etcdfence.LeaseID(l1))
	}
	if err := l1.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("second Release: %v, want ErrLost", err)
	}
	if err := l1.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew after Release: %v, want ErrLost", err)
	}
	if !leaseAlive(t, cl, etcdfence.LeaseID(l2)) {
		t.Fatal("the old grant's second Release revoked the etcd lease the next grant holds")
	}
	if _, err := other.TryAcquire(ctx, name+"-2", ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("while the second grant holds: %v, want ErrHeld", err)
	}
	if err := l2.Renew(ctx); err != nil {
		t.Errorf("the second grant's Renew: %v", err)
	}
}

// TestUnconfirmedRenewalNotPooled: a lease whose renewal was
// not confirmed (its keep-alive held by a partition: it may land later) is
// revoked at its release, never pooled, so a late keep-alive cannot extend
// the next holder's etcd lease.
func TestUnconfirmedRenewalNotPooled(t *testing.T) {
	_, cl, b, p, name := faultSetup(t, "pool-unconfirmed")
	ctx := context.Background()
	const ttl = 30 * time.Second
	l, err := b.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	p.Partition()
	rctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	err = l.Renew(rctx)
	cancel()
	p.Heal()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("renew under a partition: %v, want ErrUnknown", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("release: %v", err)
	}
	if id, _, ok := etcdfence.PooledLease(b, ttl); ok {
		t.Fatalf("the pool holds lease %x after a renewal that was not confirmed", id)
	}
	if leaseAlive(t, cl, etcdfence.LeaseID(l)) {
		t.Fatal("the release left the etcd lease alive")
	}
}

// TestPoolLeaksNoLease: grants and releases of one ttl, in sequence and two
// at a time, and TryAcquires that lose leave at most the one pooled etcd
// lease behind, and none once the acquirer is closed (a grant after Close
// pools nothing).
func TestPoolLeaksNoLease(t *testing.T) {
	_, cl, a := oneMember(t)
	ctx := context.Background()
	name := fencetest.Name("pool-leak")
	const ttl = 30 * time.Second // longer than the test: a leaked lease stays
	for i := 0; i < 5; i++ {
		l, err := a.TryAcquire(ctx, name, ttl)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("a second TryAcquire: %v, want ErrHeld", err)
		}
		l2, err := a.TryAcquire(ctx, name+"-b", ttl)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := l2.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	waitLeases(t, cl, 1, 5*time.Second)
	if err := a.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after Close: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waitLeases(t, cl, 0, 5*time.Second)
	if err := a.Close(ctx); err != nil {
		t.Fatalf("a second Close: %v", err)
	}
}

// TestPooledWaiterLeaseRevokedBehindThePool: a waiter's lease,
// pooled once the waiter's key moved onto the lock's lease, is revoked by
// someone else; the next waiter must not fail for it: it waits in line on a
// lease of its own and is granted after the holder's release.
func TestPooledWaiterLeaseRevokedBehindThePool(t *testing.T) {
	c, cl, a := oneMember(t)
	ctx := context.Background()
	name := fencetest.Name("pool-waiter")
	const ttl = 30 * time.Second
	// One waiter's turn: its waiter lease goes to the pool.
	h, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	res := acquireAsync(a, name, 20*time.Second)
	waitLine(t, cl, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	var w int64
	for deadline, ok := time.Now().Add(time.Second), false; !ok; {
		if w, _, ok = etcdfence.PooledLease(a, etcdfence.WaiterTTL); !ok && time.Now().After(deadline) {
			t.Fatal("the waiter's lease was not pooled after its key moved")
		} else if !ok {
			time.Sleep(5 * time.Millisecond)
		}
	}
	if _, err := cl.Revoke(ctx, clientv3.LeaseID(w)); err != nil {
		t.Fatal(err)
	}
	// The next waiter would take that lease.
	res = acquireAsync(a, name, 20*time.Second)
	for deadline := time.Now().Add(20 * time.Second); ; {
		select {
		case r2 := <-res:
			t.Fatalf("a waiter after the pooled waiter lease was revoked, while the name is held: %v, %v; want it in line", r2.l, r2.err)
		default:
		}
		resp, err := cl.Get(ctx, linePrefix(name), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err == nil && resp.Count == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the waiter did not join the line: %v, %v", resp, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := r.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r2 := <-res
	if r2.err != nil {
		t.Fatalf("a waiter after the pooled waiter lease was revoked: %v, want a grant", r2.err)
	}
	if r2.l.Token() <= r.l.Token() || r2.l.Context().Err() != nil {
		t.Fatalf("token %d after %d, context %v", r2.l.Token(), r.l.Token(), r2.l.Context().Err())
	}
	other, _ := etcdfence.NewAcquirer(c.Client(t), nil)
	heldThenFree(t, other, r2.l, name)
}

// TestPooledLeaseAcrossLeaderLoss: a lease pooled before the leader of a
// 3-member cluster stops is used (or, past its window, replaced) after the
// new leader takes over: the grant holds the name on a live etcd lease with
// a larger token, and the pooled lease's end stays under the pool's control.
func TestPooledLeaseAcrossLeaderLoss(t *testing.T) {
	c := etcdtest.Start(t, 3)
	cl := c.Client(t)
	a, _ := etcdfence.NewAcquirer(cl, nil)
	ctx := context.Background()
	name := fencetest.Name("pool-leader")
	const ttl = 30 * time.Second // window 3s: longer than an election here
	l0, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := l0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	leader := c.Leader()
	if leader < 0 {
		t.Fatal("no leader")
	}
	c.StopNode(leader)
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	l, err := a.Acquire(tctx, name, ttl)
	if err != nil {
		t.Fatalf("after the leader stopped: %v", err)
	}
	defer l.Release(ctx)
	t.Logf("granted on lease %x (pooled: %v)", etcdfence.LeaseID(l), etcdfence.LeaseID(l) == etcdfence.LeaseID(l0))
	if l.Token() <= l0.Token() || l.Context().Err() != nil {
		t.Fatalf("token %d after %d, context %v", l.Token(), l0.Token(), l.Context().Err())
	}
	if !leaseAlive(t, cl, etcdfence.LeaseID(l)) {
		t.Fatal("granted on an etcd lease the cluster does not have")
	}
	other, _ := etcdfence.NewAcquirer(c.Client(t), nil)
	if _, err := other.TryAcquire(tctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("while it holds: %v, want ErrHeld", err)
	}
}

// strandRelay is a TCP relay that can hold what the client sends and then
// break the client's side of the connection while keeping the server's side
// open, and deliver the held bytes later: a request the client gave up on
// (its connection broke) that still reaches the server afterwards, as a
// request queued in an L7 proxy (etcd's grpc-proxy) or in a follower's
// forward to the leader does. faultnet closes both sides of a connection
// together, so a held request that reaches the server after the client left
// is cancelled with its connection there; this relay keeps that connection.
type strandRelay struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	hold  bool
	match func([]byte) bool // when set, only a chunk it accepts starts the hold
	conns []*strandConn
	held  chan struct{} // receives when a chunk that opens a gRPC call (or that match accepted) is held
}

type strandConn struct {
	client, server net.Conn
	pending        []byte // held client bytes, not yet sent to the server
}

func startStrandRelay(t *testing.T, target string) *strandRelay {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &strandRelay{ln: ln, target: target, held: make(chan struct{}, 16)}
	go r.accept()
	t.Cleanup(func() {
		ln.Close()
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, c := range r.conns {
			c.client.Close()
			c.server.Close()
		}
	})
	return r
}

func (r *strandRelay) Addr() string { return r.ln.Addr().String() }

func (r *strandRelay) accept() {
	for {
		c, err := r.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", r.target)
		if err != nil {
			c.Close()
			continue
		}
		sc := &strandConn{client: c, server: s}
		r.mu.Lock()
		r.conns = append(r.conns, sc)
		r.mu.Unlock()
		go func() { // server to client; keeps draining the server once the client is gone
			buf := make([]byte, 64<<10)
			for {
				n, err := s.Read(buf)
				if n > 0 {
					c.Write(buf[:n])
				}
				if err != nil {
					return
				}
			}
		}()
		go func() { // client to server
			buf := make([]byte, 64<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					r.mu.Lock()
					if (r.hold && (r.match == nil || r.match(buf[:n]))) || len(sc.pending) > 0 {
						sc.pending = append(sc.pending, buf[:n]...)
						if opensStream(buf[:n]) || (r.match != nil && r.match(buf[:n])) {
							select {
							case r.held <- struct{}{}:
							default:
							}
						}
						r.mu.Unlock()
						continue
					}
					r.mu.Unlock()
					s.Write(buf[:n])
				}
				if err != nil {
					if err != io.EOF {
						return
					}
					return
				}
			}
		}()
	}
}

// Hold holds everything clients send from now on (on every connection).
func (r *strandRelay) Hold() {
	r.mu.Lock()
	r.hold = true
	r.mu.Unlock()
}

// HoldMatching is Hold from the first chunk that match accepts on.
func (r *strandRelay) HoldMatching(match func([]byte) bool) {
	r.mu.Lock()
	r.hold, r.match = true, match
	r.mu.Unlock()
}

// Strand breaks the client's side of every connection (the client sees its
// connection reset) and keeps the server's side, with what was held, and
// stops accepting connections: the client's calls go elsewhere.
func (r *strandRelay) Strand() {
	r.ln.Close()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.hold = false
	for _, c := range r.conns {
		c.client.Close()
	}
}

// Deliver sends what was held to the server, on the connections it was
// sent on (which the server still has open).
func (r *strandRelay) Deliver() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range r.conns {
		if len(c.pending) > 0 {
			c.server.Write(c.pending)
			c.pending = nil
		}
	}
}

// behindStrandRelay returns an acquirer on a client whose first endpoint
// reaches c through a strand relay and whose second through a faultnet
// proxy, with the relay, the proxy and the client.
func behindStrandRelay(t *testing.T, c *etcdtest.Cluster) (*strandRelay, *faultnet.Proxy, *clientv3.Client, *etcdfence.Acquirer) {
	t.Helper()
	r := startStrandRelay(t, c.ClientAddr(0))
	direct := faultnet.Start(t, c.ClientAddr(0))
	bc := etcdtest.NewClient(t, r.Addr(), direct.Addr())
	b, err := etcdfence.NewAcquirer(bc, nil)
	if err != nil {
		t.Fatal(err)
	}
	return r, direct, bc, b
}

// TestLateKeepAliveOfAPooledLease: the old grant's Renew
// sends a keep-alive that is held on its way while the client's connection
// breaks; the etcd client sends the keep-alive again on its own
// (KeepAliveOnce retries on Unavailable) through another endpoint, that one
// is answered, and Renew returns nil. The release then pools the lease, and
// the next grant takes it. The first keep-alive, still on its way, lands: it
// must not extend the next grant's etcd lease past that grant's local
// deadline (a holder that then dies would keep the lock from everyone for up
// to one more ttl).
func TestLateKeepAliveOfAPooledLease(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	r, _, bc, b := behindStrandRelay(t, c)
	ctx := context.Background()
	name := fencetest.Name("late-ka")
	const ttl = 4 * time.Second
	l1, err := b.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	// A Renew whose keep-alive goes through the relay, held there. The
	// client balances calls over both endpoints: try until one is held.
	// The hold starts at the chunk that carries the keep-alive request
	// (field 1, the lease ID as a varint), not at the stream's headers: a
	// connection broken between the headers and the request fails the
	// request's Send with EOF, which the client does not send again (it
	// did so in 1 of 15 runs once etcd ran in a process of its own).
	ka := binary.AppendUvarint([]byte{0x08}, uint64(etcdfence.LeaseID(l1)))
	for held := false; !held; {
		r.HoldMatching(func(b []byte) bool { return bytes.Contains(b, ka) })
		done := make(chan error, 1)
		go func() {
			rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			done <- l1.Renew(rctx)
		}()
		select {
		case <-r.held:
			held = true
			r.Strand() // the client's connection breaks; the keep-alive stays on its way
			if err := <-done; err != nil {
				t.Fatalf("renew: %v (the client did not send it again elsewhere)", err)
			}
		case err := <-done:
			r.mu.Lock()
			r.hold = false
			r.mu.Unlock()
			r.Deliver()
			if err != nil {
				t.Fatalf("renew: %v", err)
			}
			// The client takes the endpoints in turn, call by call, and a
			// Renew makes two calls (the keep-alive, then the read of its
			// key): one more call moves the next keep-alive to the other
			// endpoint, or every keep-alive would go the direct way.
			if _, err := bc.Get(ctx, "fencekit-turn"); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := l1.Release(ctx); err != nil {
		t.Fatal(err)
	}
	_, sent, pooled := etcdfence.PooledLease(b, ttl)
	l2, err := b.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if !pooled {
		// Not pooled (a copy of a keep-alive may land later): the late
		// copy can only touch the old grant's lease, never the next one.
		if etcdfence.LeaseID(l2) == etcdfence.LeaseID(l1) {
			t.Fatalf("the next grant holds the old grant's etcd lease %x, which the pool did not hold", etcdfence.LeaseID(l1))
		}
		return
	}
	if etcdfence.LeaseID(l2) != etcdfence.LeaseID(l1) {
		t.Fatalf("the next grant did not take the pooled lease (%x, first %x)", etcdfence.LeaseID(l2), etcdfence.LeaseID(l1))
	}
	deadline := sent.Add(ttl - leasekitDrift(ttl)) // l2's local deadline
	// The old grant's keep-alive lands late in the new grant's lease.
	time.Sleep(time.Until(deadline) - time.Second)
	r.Deliver()
	// Read the lease's remaining time once etcd had time to act on it:
	// another call on the relay's old server connection would be ordered
	// after it, but that connection is not the client's any more; read
	// until etcd's remaining time is plausible either way.
	var etcdLeft time.Duration
	for i := 0; i < 5; i++ {
		resp, err := cl.TimeToLive(ctx, clientv3.LeaseID(etcdfence.LeaseID(l2)))
		if err != nil {
			t.Fatal(err)
		}
		etcdLeft = time.Duration(resp.TTL) * time.Second
		if etcdLeft > 2*time.Second {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	localLeft := time.Until(deadline)
	// etcd counts whole seconds: allow one second over the local time left.
	if etcdLeft > localLeft+time.Second {
		t.Fatalf("after the old grant's late keep-alive, etcd keeps the next grant's lease %v more, its local deadline is %v away: a holder that dies now keeps the lock %v past its ttl", etcdLeft, localLeft.Round(time.Millisecond), (etcdLeft - localLeft).Round(time.Millisecond))
	}
}

// TestReleaseLostReplyNotPooled: a Release whose delete landed
// but whose answer was lost must not pool the etcd lease (it cannot tell
// whether its delete, or a copy of it, is still on its way): it revokes
// it, and the release still frees the name.
func TestReleaseLostReplyNotPooled(t *testing.T) {
	a, cl, b, p, name := faultSetup(t, "pool-lost-release")
	ctx := context.Background()
	const ttl = 30 * time.Second
	l, err := b.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	p.LoseReply(opensStream) // the delete's answer
	if err := l.Release(ctx); err != nil {
		t.Fatalf("release with its delete's answer lost: %v", err)
	}
	if p.Pending() != 0 {
		t.Fatal("the release sent nothing through the proxy")
	}
	if id, _, ok := etcdfence.PooledLease(b, ttl); ok {
		t.Fatalf("the pool holds lease %x after a release whose answer was lost", id)
	}
	if leaseAlive(t, cl, etcdfence.LeaseID(l)) {
		t.Fatal("the release left the etcd lease alive")
	}
	l2, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("after the release: %v", err)
	}
	_ = l2.Release(ctx)
}

// TestPooledLockLeaseRevokedWhileWaiting: a waiter's lock lease
// comes from the pool, and etcd no longer has it (revoked by an operator,
// or expired sooner than the pool counted). The line is not empty, so the
// grant's transaction does not try the put and cannot tell; the waiter
// joins the line on its own waiter lease. When its turn comes, it must be
// granted on a live etcd lease, not try to move its key onto the dead one
// until its context ends while heading the line (blocking everyone).
func TestPooledLockLeaseRevokedWhileWaiting(t *testing.T) {
	_, cl, a, b := twoAcquirers(t)
	ctx := context.Background()
	name := fencetest.Name("pool-revoked-wait")
	const ttl = 30 * time.Second
	h, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	id, _ := pooledAfterRelease(t, b, name+"-other", ttl)
	if _, err := cl.Revoke(ctx, clientv3.LeaseID(id)); err != nil {
		t.Fatal(err)
	}
	res := make(chan acquired, 1)
	go func() {
		actx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		l, err := b.Acquire(actx, name, ttl)
		res <- acquired{l, err}
	}()
	waitLine(t, cl, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	r := <-res
	if r.err != nil {
		t.Fatalf("the waiter, %v after the holder's release: %v", time.Since(released).Round(time.Millisecond), r.err)
	}
	defer r.l.Release(ctx)
	if d := time.Since(released); d > 3*time.Second {
		t.Errorf("the waiter was granted %v after the release", d)
	}
	if !leaseAlive(t, cl, etcdfence.LeaseID(r.l)) {
		t.Fatalf("the waiter holds etcd lease %x, which etcd no longer has", etcdfence.LeaseID(r.l))
	}
	if err := r.l.Renew(ctx); err != nil {
		t.Fatalf("the waiter's Renew: %v", err)
	}
}

// TestPooledHolderStopsRenewing: a grant whose etcd lease
// came from the pool, pooled by a grant of another ttl in the same whole
// second (3s, taken by 2.5s), stops renewing. Its context must end before
// the waiter is granted, and the waiter must be granted about when the etcd
// lease's ttl has run from its last confirmed send, not a ttl later.
func TestPooledHolderStopsRenewing(t *testing.T) {
	_, cl, a, b := twoAcquirers(t)
	ctx := context.Background()
	name := fencetest.Name("pool-stops")
	id, sent := pooledAfterRelease(t, b, name, 3*time.Second)
	l, err := b.TryAcquire(ctx, name, 2500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if etcdfence.LeaseID(l) != id {
		t.Fatalf("the grant did not take the pooled lease (%x, pooled %x)", etcdfence.LeaseID(l), id)
	}
	ended := make(chan time.Time, 1)
	go func() { <-l.Context().Done(); ended <- time.Now() }()
	res := acquireAsync(a, name, 20*time.Second)
	waitLine(t, cl, name, 2)
	r := <-res
	granted := time.Now()
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.l.Release(ctx)
	select {
	case end := <-ended:
		if !end.Before(granted) {
			t.Fatalf("the holder's context ended %v after the waiter was granted", end.Sub(granted))
		}
	default:
		t.Fatal("the waiter was granted while the holder's context is live")
	}
	if r.l.Token() <= l.Token() {
		t.Fatalf("token %d after %d", r.l.Token(), l.Token())
	}
	// etcd's lease is 3s from its last confirmed send; it checks expiry
	// every 500ms.
	if d := granted.Sub(sent); d > 3*time.Second+1500*time.Millisecond {
		t.Fatalf("the waiter was granted %v after the pooled lease's last send", d)
	}
}

// TestCloseWithLeasesHeldAndPooled: Close revokes the pooled lease, leaves a
// held one alone (still held, renewable, released without being pooled),
// may be called again, and the acquirer still grants afterwards (tokens
// still growing) without pooling.
func TestCloseWithLeasesHeldAndPooled(t *testing.T) {
	_, cl, a, b := twoAcquirers(t)
	ctx := context.Background()
	name := fencetest.Name("pool-close")
	const ttl = 30 * time.Second
	pooled, _ := pooledAfterRelease(t, b, name+"-p", ttl)
	held, err := b.TryAcquire(ctx, name, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if leaseAlive(t, cl, pooled) {
		t.Fatal("Close left the pooled lease alive")
	}
	if _, err := a.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("after Close, while held: %v, want ErrHeld", err)
	}
	if err := held.Renew(ctx); err != nil {
		t.Fatalf("renew after Close: %v", err)
	}
	if err := held.Release(ctx); err != nil {
		t.Fatalf("release after Close: %v", err)
	}
	if _, _, ok := etcdfence.PooledLease(b, 20*time.Second); ok {
		t.Fatal("a release after Close pooled its lease")
	}
	// The pool, closed, revokes it in the background.
	for deadline := time.Now().Add(5 * time.Second); leaseAlive(t, cl, etcdfence.LeaseID(held)); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a release after Close left its lease alive")
		}
	}
	if err := b.Close(ctx); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	last := held.Token()
	for i := 0; i < 3; i++ {
		l, err := b.TryAcquire(ctx, name, ttl)
		if err != nil {
			t.Fatal(err)
		}
		if l.Token() <= last {
			t.Fatalf("token %d after %d", l.Token(), last)
		}
		last = l.Token()
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if _, _, ok := etcdfence.PooledLease(b, ttl); ok {
			t.Fatal("a grant after Close was pooled")
		}
	}
}

// TestLateWaiterKeepAliveNotPooled: a waiter's keep-alive is
// held on its way while the client's connection breaks, and the etcd client
// sends it again elsewhere, answered. At its turn the waiter's key moves
// onto the lock's lease; its waiter lease, which the held copy may still
// extend, must not go to the pool for the next waiter.
func TestLateWaiterKeepAliveNotPooled(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, _ := etcdfence.NewAcquirer(c.Client(t), nil)
	r, direct, _, b := behindStrandRelay(t, c)
	ctx := context.Background()
	name := fencetest.Name("late-waiter-ka")
	h, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	res := acquireAsync(b, name, 20*time.Second)
	waitLine(t, cl, name, 2)
	// The waiter's next keep-alive through the relay (one every second, the
	// calls alternating between the endpoints) is held there: the chunk
	// that carries its request (field 1, the lease ID as a varint).
	line, err := cl.Get(ctx, linePrefix(name), append(clientv3.WithLastCreate(), clientv3.WithLimit(1))...)
	if err != nil || len(line.Kvs) != 1 {
		t.Fatalf("the waiter's key: %v, %v", line, err)
	}
	ka := binary.AppendUvarint([]byte{0x08}, uint64(line.Kvs[0].Lease))
	r.HoldMatching(func(b []byte) bool { return bytes.Contains(b, ka) })
	select {
	case <-r.held:
	case <-time.After(10 * time.Second):
		t.Fatal("no call of the waiter went through the relay")
	}
	r.Strand()
	defer r.Deliver()
	// Let the waiter send its keep-alive again, now through the other
	// endpoint, and have it answered: wait for calls after it (a read and a
	// watch again after the break, the next keep-alives, a second apart).
	waitCalls(t, direct, 4)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	got := <-res
	if got.err != nil {
		t.Fatal(got.err)
	}
	defer got.l.Release(ctx)
	if id, _, ok := etcdfence.PooledLease(b, etcdfence.WaiterTTL); ok {
		t.Fatalf("the pool holds waiter lease %x, which a keep-alive held on its way may still extend", id)
	}
}

// waitCalls waits until the proxy has relayed n more calls.
func waitCalls(t *testing.T, p *faultnet.Proxy, n int) {
	t.Helper()
	seen := make(chan struct{}, 64)
	p.LoseReply(func(b []byte) bool {
		if opensStream(b) {
			select {
			case seen <- struct{}{}:
			default:
			}
		}
		return false
	})
	for i := 0; i < n; i++ {
		select {
		case <-seen:
		case <-time.After(10 * time.Second):
			t.Fatal("no call went through the proxy")
		}
	}
}
