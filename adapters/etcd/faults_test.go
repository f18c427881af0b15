package etcdfence_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// replyWindow is how long a lost reply's connection lives after its request
// (faultnet.ReplyWindow): gRPC multiplexes calls on one HTTP/2 connection, so
// the first bytes back need not be the reply; long enough for etcd to apply
// a write on a loaded machine, shorter than WaiterTTL.
const replyWindow = 300 * time.Millisecond

// behindProxy returns an acquirer whose client reaches the cluster's first
// member through a fault proxy, and the proxy.
func behindProxy(t *testing.T, c *etcdtest.Cluster, o *etcdfence.AcquirerOptions) (*etcdfence.Acquirer, *faultnet.Proxy) {
	t.Helper()
	p := faultnet.Start(t, c.ClientAddr(0))
	p.ReplyWindow(replyWindow)
	a, err := etcdfence.NewAcquirer(etcdtest.NewClient(t, p.Addr()), o)
	if err != nil {
		t.Fatal(err)
	}
	return a, p
}

// faultSetup starts a 1-member cluster and returns an acquirer on a direct
// client (and that client), one behind a fault proxy, the proxy, and a fresh
// name.
func faultSetup(t *testing.T, prefix string) (a *etcdfence.Acquirer, cl *clientv3.Client, b *etcdfence.Acquirer, p *faultnet.Proxy, name string) {
	t.Helper()
	c := etcdtest.Start(t, 1)
	cl = c.Client(t)
	a, _ = etcdfence.NewAcquirer(cl, nil)
	b, p = behindProxy(t, c, nil)
	return a, cl, b, p, fencetest.Name(prefix)
}

func linePrefix(name string) string { return "/fencekit/locks/" + url.PathEscape(name) + "/" }

// waitLine waits until name's line has n keys (a waiter has joined), as the
// cluster tells it.
func waitLine(t *testing.T, cl *clientv3.Client, name string, n int64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := cl.Get(context.Background(), linePrefix(name), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err == nil && resp.Count == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the line of %q did not reach %d keys: %v, %v", name, n, resp, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// leaseID is the etcd lease of name's only key.
func leaseID(t *testing.T, cl *clientv3.Client, name string) int64 {
	t.Helper()
	resp, err := cl.Get(context.Background(), linePrefix(name), clientv3.WithPrefix())
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("the line of %q: %v, %v", name, resp, err)
	}
	return resp.Kvs[0].Lease
}

// acquired is the outcome of an Acquire run by acquireAsync.
type acquired struct {
	l   fence.Lease
	err error
}

// acquireAsync runs b.Acquire(name, ttl 30s) with a context of wait, and
// sends its outcome on the channel it returns.
func acquireAsync(b *etcdfence.Acquirer, name string, wait time.Duration) <-chan acquired {
	res := make(chan acquired, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		l, err := b.Acquire(ctx, name, 30*time.Second)
		res <- acquired{l, err}
	}()
	return res
}

// tryWithCreateAnswerLost connects b's client, then runs b.TryAcquire of
// name (ttl, within 20s) with the answer of its create transaction lost,
// and returns the outcome's channel once that transaction was sent.
func tryWithCreateAnswerLost(t *testing.T, b *etcdfence.Acquirer, p *faultnet.Proxy, name string, ttl time.Duration) <-chan acquired {
	t.Helper()
	ctx := context.Background()
	if _, err := b.Inspect(ctx, name); err != nil {
		t.Fatal(err)
	}
	pfx := []byte(linePrefix(name))
	sent := make(chan struct{}, 1)
	p.LoseReply(func(req []byte) bool {
		if !bytes.Contains(req, pfx) {
			return false
		}
		sent <- struct{}{}
		return true
	})
	res := make(chan acquired, 1)
	go func() {
		tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		l, err := b.TryAcquire(tctx, name, ttl)
		res <- acquired{l, err}
	}()
	select {
	case <-sent:
	case <-time.After(10 * time.Second):
		t.Fatal("TryAcquire sent no create transaction")
	}
	return res
}

// heldThenFree checks that while l holds its name, a's TryAcquire gets
// ErrHeld, and that after l's release it is granted.
func heldThenFree(t *testing.T, a *etcdfence.Acquirer, l fence.Lease, name string) {
	t.Helper()
	ctx := context.Background()
	if _, err := a.TryAcquire(ctx, name, 30*time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("while token %d holds: %v, want ErrHeld", l.Token(), err)
	}
	if err := l.Release(ctx); err != nil {
		t.Errorf("release: %v", err)
	}
	l2, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatalf("after the release: %v", err)
	}
	_ = l2.Release(ctx)
}

// opensStream reports whether a chunk the client sent holds an HTTP/2 HEADERS
// frame (type 1): a new gRPC call, not flow control or a ping.
func opensStream(b []byte) bool {
	for off := 0; off+9 <= len(b); off += 9 + (int(b[off])<<16 | int(b[off+1])<<8 | int(b[off+2])) {
		if b[off+3] == 0x1 {
			return true
		}
	}
	return false
}

// TestTryAcquireLoserBlocksNobody: a TryAcquire that loses and
// whose cleanup cannot reach etcd (its connection dropped, new ones refused)
// must not keep the lock from others once the holder releases.
func TestTryAcquireLoserBlocksNobody(t *testing.T) {
	a, _, loser, p, name := faultSetup(t, "loser")
	ctx := context.Background()
	h, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	// The loser's client is connected; then the first request it sends after
	// its transaction (its cleanup) is lost: that connection is cut and no new
	// one accepted.
	if _, err := loser.Inspect(ctx, name); err != nil {
		t.Fatal(err)
	}
	p.Refuse(true)
	pfx := []byte(linePrefix(name))
	sawTxn := false
	p.DropRequest(func(b []byte) bool {
		if sawTxn && opensStream(b) {
			return true
		}
		sawTxn = sawTxn || bytes.Contains(b, pfx)
		return false
	})
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if _, err := loser.TryAcquire(tctx, name, 30*time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("the loser: %v, want ErrHeld", err)
	}
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatalf("after the holder released, with the loser's cleanup lost: %v, want a grant", err)
	}
	if l.Token() <= h.Token() {
		t.Errorf("token %d not above %d", l.Token(), h.Token())
	}
	_ = l.Release(ctx)
}

// TestDeadWaiterSkipped: a waiter cut off from etcd leaves the
// line within about WaiterTTL after the holder releases, not the lock's ttl;
// the waiter behind it is granted, and the cut-off waiter, once it reaches
// etcd again, joins the line at its end and is granted after it (a live
// lease, a larger token), never with its old place.
func TestDeadWaiterSkipped(t *testing.T) {
	a, cl, dead, p, name := faultSetup(t, "deadwaiter")
	ctx := context.Background()
	const ttl = 60 * time.Second
	h, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	type deadResult struct {
		tok  fence.Token
		live bool
		err  error
	}
	deadRes := make(chan deadResult, 1)
	go func() {
		dctx, cancel := context.WithTimeout(ctx, 40*time.Second)
		defer cancel()
		l, err := dead.Acquire(dctx, name, ttl)
		if err != nil {
			deadRes <- deadResult{err: err}
			return
		}
		r := deadResult{tok: l.Token(), live: l.Context().Err() == nil}
		_ = l.Release(ctx)
		deadRes <- r
	}()
	waitLine(t, cl, name, 2)
	p.Partition() // the waiter is cut off (dead, as far as etcd can tell)
	type result struct {
		l   fence.Lease
		err error
	}
	next := make(chan result, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 40*time.Second)
		defer cancel()
		l, err := a.Acquire(wctx, name, ttl)
		next <- result{l, err}
	}()
	waitLine(t, cl, name, 3)
	released := time.Now()
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-next
	if r.err != nil {
		t.Fatalf("the live waiter behind a dead one: %v", r.err)
	}
	waited := time.Since(released)
	t.Logf("granted %v after the release, behind a cut-off waiter", waited)
	// The dead waiter's key lives until its waiter lease runs out on etcd's
	// clock (WaiterTTL, checked by etcd every 500ms), not for the lock's ttl.
	if limit := etcdfence.WaiterTTL + 5*time.Second; waited > limit {
		t.Errorf("the live waiter was granted %v after the release, behind a dead waiter (limit %v; the lock's ttl is %v)", waited, limit, ttl)
	}
	if r.l.Token() <= h.Token() {
		t.Errorf("token %d not above %d", r.l.Token(), h.Token())
	}
	p.Heal()
	// The cut-off waiter learns its place is gone and joins again, behind
	// the live waiter that now holds the name.
	waitLine(t, cl, name, 2)
	if err := r.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	switch d := <-deadRes; {
	case d.err != nil:
		t.Errorf("the waiter cut off past its waiter lease, after healing: %v; want a grant after it joined the line again", d.err)
	case !d.live || d.tok <= r.l.Token():
		t.Errorf("the rejoined waiter's lease: live %v, token %d after the live waiter's %d", d.live, d.tok, r.l.Token())
	}
}

// TestAcquireCutOffWhileWaiting: a waiter partitioned from etcd
// while the holder releases ends its Acquire at its deadline with ErrHeld
// joined with the context's error (or, if granted, with a live lease), soon
// after the deadline, and leaves no key that blocks the name once healed.
func TestAcquireCutOffWhileWaiting(t *testing.T) {
	a, cl, waiter, p, name := faultSetup(t, "cutoff")
	ctx := context.Background()
	const ttl = 2 * time.Second
	h, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		l   fence.Lease
		err error
		at  time.Time
	}
	res := make(chan result, 1)
	deadline := time.Now().Add(6 * time.Second)
	go func() {
		wctx, cancel := context.WithDeadline(ctx, deadline)
		defer cancel()
		l, err := waiter.Acquire(wctx, name, ttl)
		res <- result{l, err, time.Now()}
	}()
	waitLine(t, cl, name, 2)
	p.Partition()
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err == nil {
		if r.l.Context().Err() != nil {
			t.Errorf("Acquire returned a nil error and a lease already lost (%v)", context.Cause(r.l.Context()))
		}
	} else if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.DeadlineExceeded) {
		t.Errorf("cut-off waiter: %v, want ErrHeld joined with DeadlineExceeded", r.err)
	}
	if late := r.at.Sub(deadline); late > 2*time.Second {
		t.Errorf("Acquire returned %v after its deadline", late)
	}
	p.Heal()
	if r.l != nil {
		_ = r.l.Release(ctx)
	}
	// Whatever the cut-off waiter left reaches etcd now, or expires: the
	// name is granted within WaiterTTL, not the ttl of a stray lock.
	wctx, cancel := context.WithTimeout(ctx, etcdfence.WaiterTTL+5*time.Second)
	defer cancel()
	l, err := a.Acquire(wctx, name, ttl)
	if err != nil {
		t.Fatalf("after healing: %v", err)
	}
	_ = l.Release(ctx)
}

// TestRenewInDriftMarginDoesNotExtendLease: the suite's
// LateRenewHoldsNothing, with a Drift of 1s, so that the Renew after the
// local deadline leaves while etcd's lease still has about a second to run
// (with the default Drift it may land on an expired lease, which etcd
// refuses whatever the acquirer does). It returns ErrLost and does not
// extend the etcd lease: the name is granted when the original lease runs
// out on etcd.
func TestRenewInDriftMarginDoesNotExtendLease(t *testing.T) {
	c := etcdtest.Start(t, 1)
	// A wide drift margin ends the local deadline a second before etcd's.
	a, _ := etcdfence.NewAcquirer(c.Client(t), &etcdfence.AcquirerOptions{Drift: time.Second})
	ctx := context.Background()
	name := fencetest.Name("late-renew")
	const ttl = 3 * time.Second
	start := time.Now()
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	<-l.Context().Done()
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("renew after the local deadline: %v, want ErrLost", err)
	}
	// etcd expires the original lease at start+ttl (checking every 500ms); a
	// keep-alive that landed at start+2s would hold it to start+5s.
	wctx, cancel := context.WithDeadline(ctx, start.Add(ttl+1500*time.Millisecond))
	defer cancel()
	l2, err := a.Acquire(wctx, name, ttl)
	if err != nil {
		t.Fatalf("another acquirer within the original ttl: %v", err)
	}
	_ = l2.Release(ctx)
}

// TestLostReplies: a grant, a renewal and a release whose answers are lost
// (the request reached etcd, the connection died) are recognised: TryAcquire
// returns the lease its lost answer granted, and Release returns nil, not
// ErrLost for the client's own repeated revoke; nothing blocks the name after.
func TestLostReplies(t *testing.T) {
	a, cl, b, p, name := faultSetup(t, "lost")
	ctx := context.Background()
	var l fence.Lease
	// The proxy closes the connection once it has read the server's first
	// answer bytes; etcd may cancel the transaction before it applies (the
	// grant then fails, and must say it was not granted and leave the name
	// free). Repeat until a lost answer follows an applied grant.
	for attempt := 0; l == nil; attempt++ {
		if attempt == 10 {
			t.Fatal("in 10 tries no grant was applied with its answer lost")
		}
		if attempt > 0 {
			name = fencetest.Name("lost")
		}
		pfx := []byte(linePrefix(name))
		p.LoseReply(func(req []byte) bool { return bytes.Contains(req, pfx) })
		var err error
		l, err = b.TryAcquire(ctx, name, 30*time.Second)
		if p.Pending() != 0 {
			t.Fatal("the grant's transaction never went through the proxy")
		}
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "not granted") {
			t.Fatalf("grant whose answer was lost: %v; want the lease it granted, or an error saying it was not granted", err)
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		other, err := a.Acquire(wctx, name, 30*time.Second)
		cancel()
		if err != nil {
			t.Fatalf("after a grant reported not granted, the name is not free: %v", err)
		}
		_ = other.Release(ctx)
	}
	if _, err := a.TryAcquire(ctx, name, 30*time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("while the recognised grant holds: %v, want ErrHeld", err)
	}
	// The keep-alive and revoke requests carry the lease id (protobuf field
	// 1, varint).
	id := binary.AppendUvarint([]byte{0x08}, uint64(leaseID(t, cl, name)))
	p.LoseReply(func(req []byte) bool { return bytes.Contains(req, id) })
	if err := l.Renew(ctx); err != nil {
		t.Errorf("renew whose answer was lost: %v, want nil (a keep-alive is sent again)", err)
	}
	if p.Pending() != 0 {
		t.Fatal("the keep-alive never went through the proxy")
	}
	p.LoseReply(func(req []byte) bool { return bytes.Contains(req, id) })
	if err := l.Release(ctx); err != nil {
		t.Errorf("release whose answer was lost: %v, want nil", err)
	}
	if p.Pending() != 0 {
		t.Fatal("the revoke never went through the proxy")
	}
	l2, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatalf("after the release: %v", err)
	}
	if l2.Token() <= l.Token() {
		t.Errorf("token %d not above %d", l2.Token(), l.Token())
	}
	_ = l2.Release(ctx)
}

// TestReleaseLandsAfterExpiry: Release is sent within the
// lease's local deadline, but its revoke reaches etcd only after the lease
// expired there and another holder was granted the name. etcd then answers
// that it has no such lease: that is the expiry, not our revoke, and Release
// must not report a lease held to the end (nil); it had expired (ErrLost).
func TestReleaseLandsAfterExpiry(t *testing.T) {
	a, _, b, p, name := faultSetup(t, "late-release")
	ctx := context.Background()
	const ttl = 2 * time.Second
	l, err := b.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	p.Partition() // the revoke is held on its way
	defer p.Heal()
	released := make(chan error, 1)
	go func() {
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		released <- l.Release(rctx)
	}()
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	other, err := a.Acquire(wctx, name, 10*time.Second) // granted once the lease expired on etcd
	if err != nil {
		t.Fatal(err)
	}
	defer other.Release(ctx)
	p.Heal()
	if err := <-released; !errors.Is(err, fence.ErrLost) {
		t.Errorf("a release that reached etcd after the lease expired (and token %d was granted): %v, want ErrLost", other.Token(), err)
	}
}

// TestRenewUnconfirmed: a Renew whose keep-alive cannot be
// confirmed before its context ends (here held by a partition: it may land
// later) returns ErrUnknown, not a bare transport or context error; the lease
// still ends at its local deadline.
func TestRenewUnconfirmed(t *testing.T) {
	_, _, b, p, name := faultSetup(t, "renew-unconfirmed")
	ctx := context.Background()
	l, err := b.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	p.Partition()
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	err = l.Renew(rctx)
	cancel()
	p.Heal()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("renew not confirmed before its context ended: %v, want ErrUnknown", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Errorf("release: %v", err)
	}
}

// TestLostMoveReply: the answer to the transaction that moves a
// waiter's key onto the lock's lease at its turn is lost; the move is
// recognised (the key is on that lease with its create revision), the waiter
// gets a live lease that excludes others, and after its release the name is
// free.
func TestLostMoveReply(t *testing.T) {
	a, cl, b, p, name := faultSetup(t, "lostmove")
	ctx := context.Background()
	h, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	res := acquireAsync(b, name, 30*time.Second)
	waitLine(t, cl, name, 2)
	line, err := cl.Get(ctx, linePrefix(name), append(clientv3.WithLastCreate(), clientv3.WithLimit(1))...)
	if err != nil || len(line.Kvs) != 1 {
		t.Fatalf("the waiter's key: %v, %v", line, err)
	}
	key := line.Kvs[0].Key
	p.LoseReply(func(req []byte) bool { return bytes.Contains(req, key) })
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if p.Pending() != 0 {
		t.Fatal("the move never went through the proxy")
	}
	if r.err != nil {
		t.Fatalf("the waiter whose move's answer was lost: %v", r.err)
	}
	if r.l.Context().Err() != nil || r.l.Token() != fence.Token(line.Kvs[0].CreateRevision) {
		t.Fatalf("lease token %d (key created at %d), context %v", r.l.Token(), line.Kvs[0].CreateRevision, r.l.Context().Err())
	}
	heldThenFree(t, a, r.l, name)
}

// TestAcquireRetriesLostSteps: a waiting Acquire
// whose request (the lock's lease grant, the create transaction, the waiter's
// key) was dropped by a cut connection, or applied with its answer lost,
// tries again within its context instead of returning the transport error.
// An applied step is recognised by its own key, so the name's line never
// holds two keys of one Acquire (nothing granted twice, nothing orphaned),
// and after the release the name is free.
func TestAcquireRetriesLostSteps(t *testing.T) {
	for _, tc := range []struct {
		name string
		held bool // the name is held, so Acquire waits in line
		// nth: the fault takes the nth chunk (from 1) that carries the
		// name's line prefix (0: the first that opens a stream).
		nth  int
		lose bool // forward the request, lose its answer (else drop it)
	}{
		{"create dropped", false, 1, false},
		{"create answer lost", false, 1, true},
		{"waiter key dropped", true, 2, false},
		{"waiter key answer lost", true, 2, true},
		{"grant dropped", false, 0, false},
		{"grant answer lost", false, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, cl, b, p, name := faultSetup(t, "retry")
			ctx := context.Background()
			var h fence.Lease
			if tc.held {
				var err error
				if h, err = a.TryAcquire(ctx, name, 30*time.Second); err != nil {
					t.Fatal(err)
				}
			}
			// Connect b's client first, so the fault takes one of
			// Acquire's own requests.
			if _, err := b.Inspect(ctx, name); err != nil {
				t.Fatal(err)
			}
			pfx := []byte(linePrefix(name))
			seen := 0
			match := func(req []byte) bool {
				if tc.nth == 0 {
					// The first stream Acquire opens is its lease grant.
					return opensStream(req)
				}
				if bytes.Contains(req, pfx) {
					seen++
				}
				return seen == tc.nth
			}
			if tc.lose {
				p.LoseReply(match)
			} else {
				p.DropRequest(match)
			}
			res := acquireAsync(b, name, 30*time.Second)
			if tc.held {
				waitLine(t, cl, name, 2)
				// Waiting: one key of the holder's, one of b's, however
				// many times b sent its key.
				time.Sleep(200 * time.Millisecond)
				if resp, err := cl.Get(ctx, linePrefix(name), clientv3.WithPrefix(), clientv3.WithCountOnly()); err != nil || resp.Count != 2 {
					t.Errorf("the line while b waits: %v keys (%v), want 2", resp.Count, err)
				}
				if err := h.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			r := <-res
			if p.Pending() != 0 {
				t.Fatal("the fault never took a request")
			}
			if r.err != nil {
				t.Fatalf("Acquire after a lost step, with its context live: %v, want a lease", r.err)
			}
			if r.l.Context().Err() != nil {
				t.Fatalf("Acquire returned a lease already ended: %v", context.Cause(r.l.Context()))
			}
			if h != nil && r.l.Token() <= h.Token() {
				t.Errorf("token %d not above the holder's %d", r.l.Token(), h.Token())
			}
			resp, err := cl.Get(ctx, linePrefix(name), clientv3.WithPrefix())
			if err != nil {
				t.Fatal(err)
			}
			if len(resp.Kvs) != 1 || fence.Token(resp.Kvs[0].CreateRevision) != r.l.Token() {
				t.Fatalf("the line after the grant: %d keys (first created at %v), want only the lease's key (token %d)", len(resp.Kvs), resp.Kvs, r.l.Token())
			}
			heldThenFree(t, a, r.l, name)
		})
	}
}

// Requests through the proxy that holderRequests reports.
const (
	namesHolder = 'k' // names the holder's key: a watch on it, or a read of it
	readsLine   = 'p' // names the line's prefix alone: a read of the line
)

// holderRequests reports, from now on, every request through p that names
// the key at the head of name's line (the holder's), and every read of the
// line by its prefix. The proxy hands over what the client wrote in one
// chunk, and gRPC may write several requests at once (a read and a new
// watch), so each occurrence counts, and the proxy is never blocked.
func holderRequests(t *testing.T, cl *clientv3.Client, p *faultnet.Proxy, name string) <-chan byte {
	t.Helper()
	line, err := cl.Get(context.Background(), linePrefix(name), append(clientv3.WithFirstCreate(), clientv3.WithLimit(1))...)
	if err != nil || len(line.Kvs) != 1 {
		t.Fatalf("the holder's key: %v, %v", line, err)
	}
	holderKey := line.Kvs[0].Key
	prefix := []byte(linePrefix(name))
	seen := make(chan byte, 256)
	send := func(kind byte, n int) {
		for range n {
			select {
			case seen <- kind:
			default:
			}
		}
	}
	p.DropRequest(func(req []byte) bool {
		k := bytes.Count(req, holderKey)
		send(readsLine, bytes.Count(req, prefix)-k)
		send(namesHolder, k)
		return false
	})
	return seen
}

// awaitRequest waits for the next request of kind reported by
// holderRequests (skipping others) and reports whether it came.
func awaitRequest(seen <-chan byte, kind byte, timeout <-chan time.Time) bool {
	for {
		select {
		case k := <-seen:
			if k == kind {
				return true
			}
		case <-timeout:
			return false
		}
	}
}

// cutUntilBack: seen reports requests since before the waiter behind p
// started (holderRequests). It waits for the waiter's watch on the holder's
// key, so that the cut comes while it waits (a cut while it was still
// reading the line would leave it nothing to resume), cuts every
// connection through p, and waits until the waiter is back: with
// readAgain, until it has read the holder's key or the line again and then
// watched the key (two requests naming the key, or a read of the line
// followed by one: the watch stream may end at the cut, and the waiter
// then reads the line again); without, until one request names the key.
func cutUntilBack(t *testing.T, p *faultnet.Proxy, seen <-chan byte, readAgain bool) {
	t.Helper()
	if !awaitRequest(seen, namesHolder, time.After(10*time.Second)) {
		t.Fatal("the waiter's watch on the holder's key never came through the proxy")
	}
	p.CutAll()
	timeout := time.After(10 * time.Second)
	if !readAgain {
		if !awaitRequest(seen, namesHolder, timeout) {
			t.Fatal("after the cut, no request naming the holder's key came through the proxy")
		}
		return
	}
	for read := false; ; {
		select {
		case k := <-seen:
			switch {
			case k == readsLine:
				read = true
			case read:
				return // the line read again, then the key watched
			default:
				read = true // a read (or the resumed watch) of the key
			}
		case <-timeout:
			t.Fatalf("after the cut, the waiter did not read the holder's key or the line and then watch the key (read: %v)", read)
		}
	}
}

// TestWaiterWatchesAgainAfterACut: a waiter whose connection is cut while it
// waits reads its predecessor's key when the connection is back and watches
// again from there; the holder's release after that wakes it (the deletion
// is the very next revision, so a watch started past it would wait until
// its context ends). It is granted with a larger token, and only its key is
// in line.
func TestWaiterWatchesAgainAfterACut(t *testing.T) {
	a, cl, b, p, name := faultSetup(t, "rewatch")
	ctx := context.Background()
	h, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	seen := holderRequests(t, cl, p, name)
	res := acquireAsync(b, name, 20*time.Second)
	waitLine(t, cl, name, 2)
	// After the cut, the waiter's requests that name the holder's key: its
	// read, then its new watch (and the client's resumed one). Release once
	// the read and a watch have gone through.
	cutUntilBack(t, p, seen, true)
	waitLine(t, cl, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatalf("the waiter after a cut and the holder's release: %v", r.err)
	}
	if r.l.Token() <= h.Token() || r.l.Context().Err() != nil {
		t.Fatalf("token %d (holder %d), context %v", r.l.Token(), h.Token(), r.l.Context().Err())
	}
	if resp, err := cl.Get(ctx, linePrefix(name), clientv3.WithPrefix(), clientv3.WithCountOnly()); err != nil || resp.Count != 1 {
		t.Errorf("the line after the grant: %v keys (%v), want 1", resp.Count, err)
	}
	_ = r.l.Release(ctx)
}

// TestAcquireRejoinsAfterPlaceExpired: a waiter cut off from etcd until its
// waiter lease expires (its key leaves the line) joins the line again once
// it reaches etcd, and is granted at the holder's release: Acquire gives up
// only with its context (the fence.Acquirer contract), not with ErrHeld at
// the expiry (which a loaded 3-member cluster's lost keep-alives also cause).
func TestAcquireRejoinsAfterPlaceExpired(t *testing.T) {
	a, cl, waiter, p, name := faultSetup(t, "rejoin")
	ctx := context.Background()
	h, err := a.TryAcquire(ctx, name, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	res := acquireAsync(waiter, name, 45*time.Second)
	waitLine(t, cl, name, 2)
	p.Partition()
	// etcd expires the waiter's lease (WaiterTTL) and its key leaves the line.
	waitLine(t, cl, name, 1)
	p.Heal()
	// The waiter learns its place is gone and joins again.
	waitLine(t, cl, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatalf("a waiter whose place expired while cut off: %v, want a grant after it joined again", r.err)
	}
	defer r.l.Release(ctx)
	if r.l.Token() <= h.Token() {
		t.Errorf("token %d after the holder's %d", r.l.Token(), h.Token())
	}
}

// TestTryAcquireLookupPastLocalDeadline: a TryAcquire whose
// create transaction landed with its answer lost looks for its key, and that
// lookup is tried again while etcd cannot be reached (a partition of 1.5s
// from the moment the create was sent). When it finds the key, the lease's
// local deadline (ttl 1.2s) has passed, though etcd (which rounds the ttl up
// to 2s) still holds the key: TryAcquire must not return that lease with a
// nil error, and the name must not stay held by it.
func TestTryAcquireLookupPastLocalDeadline(t *testing.T) {
	a, _, b, p, name := faultSetup(t, "lookup")
	ctx := context.Background()
	const ttl, partition = 1200 * time.Millisecond, 1500 * time.Millisecond
	res := tryWithCreateAnswerLost(t, b, p, name, ttl)
	p.Partition()
	time.Sleep(partition) // the fault's length, not a synchronisation
	p.Heal()
	r := <-res
	if p.Pending() != 0 {
		t.Fatal("the lost reply never fired")
	}
	if r.err == nil {
		t.Logf("TryAcquire returned token %d, lease context %v", r.l.Token(), context.Cause(r.l.Context()))
		if r.l.Context().Err() != nil {
			t.Errorf("TryAcquire returned a lease already past its local deadline with a nil error: %v", context.Cause(r.l.Context()))
		}
		_ = r.l.Release(ctx)
		return
	}
	t.Logf("TryAcquire: %v", r.err)
	// Not granted: nothing holds the name afterwards. (Here etcd's own
	// expiry of the 2s lease is only about 0.5s away, so this cannot tell
	// the revoke from it; it shows no other key was left behind.)
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	l, err := a.Acquire(actx, name, 30*time.Second)
	if err != nil {
		t.Fatalf("the name after a TryAcquire that was not granted: %v, want it free", err)
	}
	_ = l.Release(ctx)
}

// TestWaiterKeepsItsPlaceAfterACut: the first waiter, whose
// connection is cut while it waits, keeps its place ahead of a second waiter
// that joined after it: after the holder's release the first is granted,
// and the second still waits until the first releases.
func TestWaiterKeepsItsPlaceAfterACut(t *testing.T) {
	a, cl, b, p, name := faultSetup(t, "fifo")
	ctx := context.Background()
	h, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	seen := holderRequests(t, cl, p, name)
	first := acquireAsync(b, name, 20*time.Second)
	waitLine(t, cl, name, 2)
	second := acquireAsync(a, name, 20*time.Second)
	waitLine(t, cl, name, 3)
	cutUntilBack(t, p, seen, false) // the first waiter is back
	waitLine(t, cl, name, 3)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-first
	if r.err != nil {
		t.Fatalf("the first waiter after a cut and the holder's release: %v", r.err)
	}
	waitLine(t, cl, name, 2) // the first's key (now the lock's) and the second's
	select {
	case r2 := <-second:
		t.Fatalf("the second waiter was answered while the first holds: %v, %v", r2.l, r2.err)
	default:
	}
	if err := r.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r2 := <-second
	if r2.err != nil {
		t.Fatalf("the second waiter after the first's release: %v", r2.err)
	}
	if !(h.Token() < r.l.Token() && r.l.Token() < r2.l.Token()) {
		t.Errorf("tokens %d, %d, %d: want them in line order", h.Token(), r.l.Token(), r2.l.Token())
	}
	_ = r2.l.Release(ctx)
}

// oneMember starts a one-member cluster and returns it, a client of it, and
// an acquirer with default options on that client.
func oneMember(t *testing.T) (*etcdtest.Cluster, *clientv3.Client, *etcdfence.Acquirer) {
	t.Helper()
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, _ := etcdfence.NewAcquirer(cl, nil)
	return c, cl, a
}

// twoAcquirers starts a one-member cluster and returns it, a client of it,
// and two acquirers with default options, each on a client of its own.
func twoAcquirers(t *testing.T) (c *etcdtest.Cluster, cl *clientv3.Client, a, b *etcdfence.Acquirer) {
	t.Helper()
	c = etcdtest.Start(t, 1)
	cl = c.Client(t)
	a, _ = etcdfence.NewAcquirer(c.Client(t), nil)
	b, _ = etcdfence.NewAcquirer(c.Client(t), nil)
	return c, cl, a, b
}
