package etcdfence_test

// Late grants: a grant confirmed past its local deadline returns an error
// matching fence.ErrLost, and Acquire tries again within its context. Each
// test makes grants late through a fault proxy's latency against the
// embedded etcd and checks a promise through the public API.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestLateGrantsAcquireGivesUp: every grant through the proxy is
// confirmed past its 1s lease's local deadline (400ms on every chunk, each
// way: a lease grant and a transaction take 1.6s at least). TryAcquire
// answers ErrLost (not a lease, not ErrHeld). Acquire, every attempt late,
// gives up at its deadline with ErrHeld joined with DeadlineExceeded, never
// ErrLost, and not much later than the deadline. Afterwards the name is
// free (the late grants were given back) and no goroutine of the package is
// left running.
func TestLateGrantsAcquireGivesUp(t *testing.T) {
	a, cl, b, p, name := faultSetup(t, "rv-late-all")
	ctx := context.Background()
	if _, err := b.Inspect(ctx, name); err != nil { // connects b's client
		t.Fatal(err)
	}
	const ttl = time.Second
	p.Latency(400*time.Millisecond, 400*time.Millisecond)

	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	l, err := b.TryAcquire(tctx, name, ttl)
	cancel()
	if err == nil {
		t.Fatalf("TryAcquire through a 400ms-a-chunk proxy granted token %d (context %v): want ErrLost", l.Token(), context.Cause(l.Context()))
	}
	t.Logf("TryAcquire: %v", err)
	if !errors.Is(err, fence.ErrLost) || errors.Is(err, fence.ErrHeld) {
		t.Fatalf("TryAcquire of a free name, late: %v, want ErrLost (and not ErrHeld)", err)
	}

	deadline := time.Now().Add(5 * time.Second)
	actx, cancel := context.WithDeadline(ctx, deadline)
	l, err = b.Acquire(actx, name, ttl)
	returned := time.Now()
	cancel()
	if err == nil {
		t.Fatalf("Acquire granted token %d (context %v) with every grant late", l.Token(), context.Cause(l.Context()))
	}
	t.Logf("Acquire: %v (%v after its deadline)", err, returned.Sub(deadline))
	if errors.Is(err, fence.ErrLost) {
		t.Errorf("Acquire gave up with ErrLost: %v, want ErrHeld joined with DeadlineExceeded", err)
	}
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Acquire at its deadline: %v, want ErrHeld joined with DeadlineExceeded", err)
	}
	if late := returned.Sub(deadline); late > time.Second {
		t.Errorf("Acquire returned %v after its deadline", late)
	}

	p.Latency(0, 0)
	// The late grants were given back: the name is free within etcd's
	// expiry of a 1s lease (its minimum, 2s, plus its 500ms check) after the
	// latency ends, whether the revokes or the expiry freed it.
	freeWithin4s(t, a, cl, name, "the late grants", "a late grant was not given back")
	// The background revokes end within their ttl plus a second.
	var left []string
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		left = nil
		for _, g := range etcdfenceGoroutines() {
			if strings.Contains(g, "etcdfence.revokeLease") || strings.Contains(g, "adapters/etcd.revokeLease") || strings.Contains(g, "adapters/etcd.(*Acquirer)") {
				left = append(left, g)
			}
		}
		if len(left) == 0 || time.Now().After(end) {
			break
		}
	}
	if len(left) > 0 {
		t.Errorf("%d goroutines of the package still run 5s after the late grants:\n%s", len(left), strings.Join(left, "\n\n"))
	}
}

// TestLateGrantLoserIsHeld: a TryAcquire that loses to a holder, slowly
// (every chunk 600ms each way: its round trips take longer than its 1s
// ttl), answers ErrHeld, never ErrLost: the name is held by another, and
// ErrLost would tell the caller it may be free. The same with the pool off.
func TestLateGrantLoserIsHeld(t *testing.T) {
	t.Parallel() // its own etcd; no goroutine count
	for _, noPool := range []bool{false, true} {
		c := etcdtest.Start(t, 1)
		a, _ := etcdfence.NewAcquirer(c.Client(t), nil)
		b, p := behindProxy(t, c, &etcdfence.AcquirerOptions{NoPool: noPool})
		ctx := context.Background()
		name := fencetest.Name("rv-late-loser")
		h, err := a.TryAcquire(ctx, name, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		// A pooled lease for b's next grant, when the pool is on.
		if !noPool {
			pooledAfterRelease(t, b, name+"-other", time.Second)
		} else if _, err := b.Inspect(ctx, name); err != nil {
			t.Fatal(err)
		}
		p.Latency(600*time.Millisecond, 600*time.Millisecond)
		start := time.Now()
		tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		l, err := b.TryAcquire(tctx, name, time.Second)
		cancel()
		took := time.Since(start)
		p.Latency(0, 0)
		if err == nil {
			t.Fatalf("NoPool %v: TryAcquire granted token %d while token %d holds", noPool, l.Token(), h.Token())
		}
		t.Logf("NoPool %v: the slow loser (%v): %v", noPool, took.Round(time.Millisecond), err)
		if took < time.Second {
			t.Fatalf("NoPool %v: the loser took %v, not past its ttl: the case proves nothing", noPool, took)
		}
		if errors.Is(err, fence.ErrLost) || !errors.Is(err, fence.ErrHeld) {
			t.Errorf("NoPool %v: a TryAcquire that lost to token %d: %v, want ErrHeld and not ErrLost", noPool, h.Token(), err)
		}
		heldThenFree(t, a, h, name)
	}
}

// TestLateGrantPooledNotPooledAgain: a TryAcquire takes the pooled
// etcd lease, and its transaction is confirmed past the lease's local
// deadline (600ms a chunk each way, ttl 1s). It answers ErrLost, and that
// etcd lease, whose key it gives back, must not go back to the pool: the
// next grant takes another lease, and etcd no longer has the late one once
// its revoke reached it.
func TestLateGrantPooledNotPooledAgain(t *testing.T) {
	t.Parallel() // its own etcd; no goroutine count
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	b, p := behindProxy(t, c, nil)
	ctx := context.Background()
	name := fencetest.Name("rv-late-pool")
	const ttl = time.Second
	id, _ := pooledAfterRelease(t, b, name, ttl)
	p.Latency(600*time.Millisecond, 600*time.Millisecond)
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	l, err := b.TryAcquire(tctx, name, ttl)
	cancel()
	if err == nil {
		p.Latency(0, 0)
		t.Fatalf("the late pooled grant returned token %d (context %v), want ErrLost", l.Token(), context.Cause(l.Context()))
	}
	t.Logf("TryAcquire with the pooled lease %x, late: %v", id, err)
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("the late pooled grant: %v, want ErrLost", err)
	}
	if got, _, ok := etcdfence.PooledLease(b, ttl); ok && got == id {
		t.Fatalf("the late grant's etcd lease %x, which it revokes, is back in the pool", id)
	}
	p.Latency(0, 0)
	l, err = b.TryAcquire(ctx, name, ttl)
	for end := time.Now().Add(4 * time.Second); errors.Is(err, fence.ErrHeld) && time.Now().Before(end); l, err = b.TryAcquire(ctx, name, ttl) {
		time.Sleep(20 * time.Millisecond) // a poll, not a synchronisation
	}
	if err != nil {
		t.Fatalf("the next grant after the late one: %v", err)
	}
	if etcdfence.LeaseID(l) == id {
		t.Fatalf("the next grant holds the late grant's etcd lease %x", id)
	}
	_ = l.Release(ctx)
	if leaseAlive(t, cl, id) {
		t.Errorf("etcd still has the late grant's lease %x", id)
	}
}

// TestLateGrantWaiterGivesUp: a waiter (ttl 1s) whose turn comes while
// every chunk through its proxy takes 400ms each way: its move onto the
// lock's lease (after a fresh lease, its lock lease being unconfirmed for
// more than half its ttl) is confirmed past the local deadline, and every
// attempt after it too. Acquire never returns ErrLost nor a lease already
// lost: it gives up at its deadline with ErrHeld and DeadlineExceeded.
// Afterwards nothing of it holds the name: its keys leave the line and the
// name is free within etcd's expiry of its 1s leases.
func TestLateGrantWaiterGivesUp(t *testing.T) {
	t.Parallel() // its own etcd; no goroutine count
	a, cl, b, p, name := faultSetup(t, "rv-late-waiter")
	ctx := context.Background()
	h, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(12 * time.Second)
	type stamped struct {
		acquired
		at time.Time
	}
	res := make(chan stamped, 1)
	go func() {
		wctx, cancel := context.WithDeadline(ctx, deadline)
		defer cancel()
		l, err := b.Acquire(wctx, name, time.Second)
		res <- stamped{acquired{l, err}, time.Now()}
	}()
	waitLine(t, cl, name, 2)
	p.Latency(400*time.Millisecond, 400*time.Millisecond)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	p.Latency(0, 0)
	if r.err == nil {
		live := r.l.Context().Err() == nil
		_ = r.l.Release(ctx)
		if !live {
			t.Fatalf("Acquire returned token %d with its context done: %v", r.l.Token(), context.Cause(r.l.Context()))
		}
		t.Fatalf("Acquire granted token %d through a 400ms-a-chunk proxy on a 1s ttl: the case proves nothing", r.l.Token())
	}
	t.Logf("the late waiter: %v (%v after its deadline)", r.err, r.at.Sub(deadline).Round(time.Millisecond))
	if errors.Is(r.err, fence.ErrLost) || !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.DeadlineExceeded) {
		t.Errorf("the late waiter at its deadline: %v, want ErrHeld joined with DeadlineExceeded, not ErrLost", r.err)
	}
	if late := r.at.Sub(deadline); late > time.Second {
		t.Errorf("Acquire returned %v after its deadline", late)
	}
	freeWithin4s(t, a, cl, name, "the late waiter gave up", "")
}

// freeWithin4s polls (a poll, not a synchronisation) until a is granted
// name, and fails t when the name is still held 4s from now; after says
// after what, and why what the failure means (the line's keys when empty).
func freeWithin4s(t *testing.T, a *etcdfence.Acquirer, cl *clientv3.Client, name, after, why string) {
	t.Helper()
	ctx := context.Background()
	bound := time.Now().Add(4 * time.Second)
	for {
		l, err := a.TryAcquire(ctx, name, 30*time.Second)
		if err == nil {
			_ = l.Release(ctx)
			return
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("TryAcquire after %s: %v", after, err)
		}
		if time.Now().After(bound) {
			if why == "" {
				resp, _ := cl.Get(ctx, linePrefix(name), clientv3.WithPrefix())
				why = fmt.Sprint(resp.Kvs)
			}
			t.Fatalf("the name is still held 4s after %s: %s", after, why)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestLateGrantRevokedNotLeftToExpire: a TryAcquire (ttl 3.01s, which
// etcd rounds up to 4s) whose create landed with its answer lost finds its
// key only after a 3.2s partition, past the local deadline: it answers
// ErrLost, and gives the grant back at once: its etcd lease is revoked (the
// key leaves the line) well before etcd's own expiry of the 4s lease, which
// would keep the name from everyone for most of a second more.
func TestLateGrantRevokedNotLeftToExpire(t *testing.T) {
	a, cl, b, p, name := faultSetup(t, "rv-late-revoke")
	ctx := context.Background()
	const ttl, partition = 3010 * time.Millisecond, 3200 * time.Millisecond
	res := tryWithCreateAnswerLost(t, b, p, name, ttl)
	p.Partition()
	waitLine(t, cl, name, 1) // the create landed
	id := leaseID(t, cl, name)
	time.Sleep(partition) // the fault's length, not a synchronisation
	p.Heal()
	r := <-res
	returned := time.Now()
	if r.err == nil {
		_ = r.l.Release(ctx)
		t.Fatalf("TryAcquire returned token %d (context %v) after a %v partition on a %v ttl: the case proves nothing", r.l.Token(), context.Cause(r.l.Context()), partition, ttl)
	}
	t.Logf("TryAcquire: %v", r.err)
	if !errors.Is(r.err, fence.ErrLost) {
		t.Fatalf("the late grant: %v, want ErrLost", r.err)
	}
	// etcd reports a lease's time left in whole seconds (0 in its last
	// second): look at the key, which the revoke deletes.
	for {
		resp, err := cl.Get(ctx, linePrefix(name), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		if resp.Count == 0 {
			break
		}
		if time.Since(returned) > 500*time.Millisecond {
			left, _ := cl.TimeToLive(ctx, clientv3.LeaseID(id))
			t.Fatalf("%v after the late grant's ErrLost its key is still in the line, on etcd lease %x (%ds left): not given back, the name is held until etcd expires it", time.Since(returned).Round(time.Millisecond), id, left.TTL)
		}
		time.Sleep(10 * time.Millisecond) // a poll, not a synchronisation
	}
	l, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatalf("after the late grant was given back: %v, want a grant", err)
	}
	_ = l.Release(ctx)
}
