package natsfence_test

// Late grants: a grant confirmed past its local deadline is given back; a
// waiting Acquire tries on until its context ends, and ErrUnknown at the
// context's end joins ErrHeld.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/nats-io/nats.go"
)

// TestLateGrantsAcquireGivesUpAsAWait: through a proxy that delays every
// chunk 700ms each way, every grant of a 1s lease is confirmed past its local
// deadline. TryAcquire gives the grant back and answers ErrLost (it holds
// nothing). A waiting Acquire keeps trying, and at its context's deadline
// gives up as any wait does: ErrHeld joined with DeadlineExceeded, never
// ErrLost (fence.Acquirer's contract). With the latency gone the name is
// free: the late grants were given back.
func TestLateGrantsAcquireGivesUpAsAWait(t *testing.T) {
	t.Parallel() // its own names and proxies
	a, p := proxiedAcquirer(t, nil)
	ctx := context.Background()
	name := fencetest.Name("lategrants")
	const ttl = natsfence.MinTTL
	p.Latency(550*time.Millisecond, 550*time.Millisecond)

	// TryAcquire and Acquire run at once, on two names: each waits for
	// late replies most of its time. Acquire's deadline outlasts three
	// late grants (about 13s), after which a TryAcquire gives up.
	tryName := name + "-try"
	type result struct {
		took time.Duration
		err  error
	}
	tried := make(chan result, 1)
	go func() {
		tctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		start := time.Now()
		l, err := a.TryAcquire(tctx, tryName, ttl)
		if err == nil {
			err = fmt.Errorf("granted token %d (its context: %v)", l.Token(), context.Cause(l.Context()))
			_ = l.Release(ctx)
		}
		tried <- result{time.Since(start), err}
	}()

	deadline := time.Now().Add(16 * time.Second)
	actx, cancel := context.WithDeadline(ctx, deadline)
	l, err := a.Acquire(actx, name, ttl)
	cancel()
	if err == nil {
		t.Fatalf("Acquire with every grant late granted token %d (its context: %v)", l.Token(), context.Cause(l.Context()))
	}
	t.Logf("Acquire: %v (%v after its deadline)", err, time.Since(deadline))
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, fence.ErrLost) {
		t.Errorf("Acquire with every grant late: %v, want ErrHeld joined with DeadlineExceeded (and not ErrLost)", err)
	}
	r := <-tried
	t.Logf("TryAcquire (%v): %v", r.took, r.err)
	if !errors.Is(r.err, fence.ErrLost) || errors.Is(r.err, fence.ErrHeld) {
		t.Errorf("TryAcquire of a free name, every grant late: %v, want ErrLost (and not ErrHeld)", r.err)
	}

	p.Latency(0, 0)
	b := newAcquirer(t, js(t), lockBucket, nil)
	for end, n := time.Now().Add(3*ttl), 0; n < 2; {
		l, err := b.TryAcquire(ctx, []string{name, tryName}[n], 30*time.Second)
		if err == nil {
			_ = l.Release(ctx)
			n++
			continue
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatal(err)
		}
		if time.Now().After(end) {
			t.Fatalf("%v after the late grants the name is still held: a late grant was not given back", 3*ttl)
		}
		time.Sleep(20 * time.Millisecond) // a poll, not a synchronisation
	}
}

// TestGrantConfirmedAfterLocalDeadline: the ack of a grant is lost and the
// client cannot reconnect until the lease's local deadline has passed; the
// key is still there (the server's ttl is rounded up), so the retry
// recognises it. A lease already past its local deadline must not be
// returned with a nil error: either a live lease or an error.
func TestGrantConfirmedAfterLocalDeadline(t *testing.T) {
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 300 * time.Millisecond, RetryFor: 10 * time.Second})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	warm, err := a.TryAcquire(ctx, fencetest.Name("warm"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Release(ctx)
	name := fencetest.Name("lateconfirm")
	before := p.Stats().LostReplies
	p.LoseReply(createTo(lockBucket.Bucket))
	p.Refuse(true)
	type res struct {
		l   fence.Lease
		err error
	}
	got := make(chan res, 1)
	start := time.Now()
	go func() {
		l, err := a.TryAcquire(ctx, name, 1500*time.Millisecond)
		got <- res{l, err}
	}()
	waitLost(t, p, before)
	// A lease granted after a's was sent, with the same ttl: once its
	// context is done, a's local deadline has passed too.
	clock, err := other.TryAcquire(ctx, fencetest.Name("clock"), 1500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	<-clock.Context().Done()
	p.Refuse(false)
	r := <-got
	t.Logf("TryAcquire after %v: %v", time.Since(start), r.err)
	if r.err == nil {
		defer func() { _ = r.l.Release(ctx) }()
		// Its local deadline was due before the return: the lease's timer
		// ends its context at once. A live 1.5s lease is not done within
		// 100ms.
		select {
		case <-r.l.Context().Done():
			t.Fatalf("TryAcquire returned token %d with a nil error, past its local deadline: %v", r.l.Token(), context.Cause(r.l.Context()))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// observe subscribes, on a client of its own (not proxied), to subj and
// calls f for each message the server routes there (a copy of the request or
// the publish, as the server sees it).
func observe(t *testing.T, subj string, f func(m *nats.Msg)) {
	t.Helper()
	nc := natstest.Connect(t, srv.ClientURL())
	sub, err := nc.Subscribe(subj, f)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// lockSubject is the subject of name's lock key in lockBucket.
func lockSubject(name string) string {
	return "$KV." + lockBucket.Bucket + "." + natsfence.EncodeKey(name)
}

// tokenReadSubject is the subject of a read of lockBucket's creation time
// (a grant's token).
var tokenReadSubject = "$JS.API.STREAM.INFO.KV_" + lockBucket.Bucket

// onFirstCreate calls f once, when the server sees the first create of a
// grant on name (a publish to its key that is not a marker before it).
func onFirstCreate(t *testing.T, name string, f func()) {
	t.Helper()
	var once sync.Once
	observe(t, lockSubject(name), func(m *nats.Msg) {
		if m.Header.Get("KV-Operation") == "" {
			once.Do(f)
		}
	})
}

// notGrantedOnSlowLink runs try with p delaying every chunk by d each way,
// makes the link fast again when try returns, and returns try's error; a
// lease try was granted fails t (what was granted), after its release.
func notGrantedOnSlowLink(t *testing.T, p *faultnet.Proxy, d time.Duration, what string, try func() (fence.Lease, error)) error {
	t.Helper()
	p.Latency(d, d)
	l, err := try()
	p.Latency(0, 0)
	if err == nil {
		_ = l.Release(context.Background())
		t.Fatalf("%s was granted (token %d)", what, l.Token())
	}
	return err
}

// waitFree polls (a poll, not a synchronisation) until b can take name, or
// fails after within.
func waitFree(t *testing.T, b *natsfence.Acquirer, name string, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		l, err := b.TryAcquire(context.Background(), name, 30*time.Second)
		if err == nil {
			_ = l.Release(context.Background())
			return time.Since(start)
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatal(err)
		}
		if time.Since(start) > within {
			t.Fatalf("the name is still held %v after the Acquire gave up: an orphan entry nobody releases", within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestLateGrantAcquireCancelledDuringTokenRead: a waiting Acquire whose
// context ends after its create landed, while the read of the bucket's
// creation time (the token) is unanswered, must give up as any wait does:
// ErrHeld joined with the context's error (fence.Acquirer's contract). A
// waiting Acquire loops through late grants until its context ends, so its
// end falls in this read about a quarter of the time.
func TestLateGrantAcquireCancelledDuringTokenRead(t *testing.T) {
	// Not parallel: it watches every STREAM.INFO read of the bucket,
	// which the other tests' acquirers make too.
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 10 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("natslate-inforead")
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	var cancelledAt atomic.Int64
	// The token's read: the first STREAM.INFO after New. Its reply is held
	// 300ms by the proxy; the Acquire is cancelled as the server sees it.
	observe(t, tokenReadSubject, func(*nats.Msg) {
		if cancelledAt.CompareAndSwap(0, time.Now().UnixNano()) {
			cancel()
		}
	})
	err := notGrantedOnSlowLink(t, p, 300*time.Millisecond, "Acquire cancelled during its token read", func() (fence.Lease, error) {
		return a.Acquire(actx, name, 20*time.Second)
	})
	if cancelledAt.Load() == 0 {
		t.Fatalf("Acquire returned before its token read: %v", err)
	}
	after := time.Since(time.Unix(0, cancelledAt.Load()))
	t.Logf("Acquire: %v (%v after the cancel)", err, after)
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) {
		t.Errorf("Acquire cancelled during its token read: %v, want an error matching ErrHeld and context.Canceled", err)
	}
	waitFree(t, newAcquirer(t, js(t), lockBucket, nil), name, 5*time.Second)
}

// TestLateGrantAcquireCancelledDuringCreate: the ErrUnknown+ctx path.
// The Acquire is cancelled as its create reaches the server, its ack held by
// the proxy: it gives up with ErrHeld, the context error and ErrUnknown, and
// the entry that landed must be removed in the background (a 20s ttl: its
// expiry must not be what frees the name).
func TestLateGrantAcquireCancelledDuringCreate(t *testing.T) {
	t.Parallel() // its own names and proxies
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 10 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("natslate-create")
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	onFirstCreate(t, name, cancel)
	err := notGrantedOnSlowLink(t, p, 300*time.Millisecond, "Acquire cancelled during its create", func() (fence.Lease, error) {
		return a.Acquire(actx, name, 20*time.Second)
	})
	t.Logf("Acquire: %v", err)
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) {
		t.Errorf("Acquire cancelled during its create: %v, want ErrHeld and context.Canceled", err)
	}
	took := waitFree(t, newAcquirer(t, js(t), lockBucket, nil), name, 8*time.Second)
	t.Logf("free %v after the Acquire gave up", took)
}

// TestLateGrantAcquireDoesNotSpin: with a Drift the constructor and the
// acquire accept (below the ttl) but leaving a margin shorter than a round
// trip, every grant is confirmed past its local deadline. A waiting Acquire
// now tries on until its context ends with no pause between tries: a loop of
// create and purge writes against the server for the whole wait (MaxWait,
// 30s by default), where it once stopped after 3 late grants.
func TestLateGrantAcquireDoesNotSpin(t *testing.T) {
	t.Parallel() // its own names and proxies
	ctx := context.Background()
	const ttl = natsfence.MinTTL
	a := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Drift: ttl - 20*time.Microsecond})
	name := fencetest.Name("natslate-spin")
	var writes atomic.Int64
	observe(t, lockSubject(name), func(*nats.Msg) { writes.Add(1) })
	actx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	l, err := a.Acquire(actx, name, ttl)
	if err == nil {
		_ = l.Release(ctx)
		t.Skipf("a grant within %v: the margin was enough on this machine", 20*time.Microsecond)
	}
	t.Logf("Acquire: %v; %d writes to the lock key in its 2s wait", err, writes.Load())
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Acquire: %v, want ErrHeld and DeadlineExceeded", err)
	}
	if n := writes.Load(); n > 20 {
		t.Errorf("a waiting Acquire with every grant late wrote the lock key %d times in 2s: it spins (no pause between late grants)", n)
	}
}

// TestLateGrantPurgeSparesNewerHolder: a TryAcquire through a slow
// link sees its grants confirmed late; each expires on the server (1s) before
// its confirmation, and a waiting Acquire on a direct client takes the name.
// The late grants' purges (the last in the background) must not remove the
// newer holder's entry, and the TryAcquire must answer ErrHeld or ErrLost.
func TestLateGrantPurgeSparesNewerHolder(t *testing.T) {
	t.Parallel() // its own names and proxies
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 5 * time.Second})
	ctx := context.Background()
	b := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("natslate-newer")
	p.Latency(400*time.Millisecond, 400*time.Millisecond)
	type res struct {
		l   fence.Lease
		err error
	}
	got := make(chan res, 1)
	bctx, bcancel := context.WithTimeout(ctx, 20*time.Second)
	defer bcancel()
	purges := make(chan struct{}, 64)
	var start sync.Once
	observe(t, lockSubject(name), func(m *nats.Msg) {
		if m.Header.Get("KV-Operation") == "PURGE" {
			purges <- struct{}{}
			return
		}
		// The slow TryAcquire's first create reached the server: the
		// direct waiter begins to wait.
		start.Do(func() {
			go func() {
				l, err := b.Acquire(bctx, name, 20*time.Second)
				got <- res{l, err}
			}()
		})
	})
	_, terr := a.TryAcquire(ctx, name, natsfence.MinTTL)
	t.Logf("TryAcquire: %v", terr)
	if !errors.Is(terr, fence.ErrHeld) && !errors.Is(terr, fence.ErrLost) {
		t.Errorf("TryAcquire: %v, want ErrHeld or ErrLost", terr)
	}
	r := <-got
	if r.err != nil {
		t.Fatalf("the direct waiter: %v", r.err)
	}
	defer r.l.Release(ctx)
	// Each late grant sends one purge; wait until the last has reached the
	// server and its answer came back through the slow link (a reply takes
	// 400ms; 2s covers it several times over).
	for {
		select {
		case <-purges:
			continue
		case <-time.After(2 * time.Second):
		}
		break
	}
	if err := r.l.Renew(ctx); err != nil {
		t.Fatalf("the newer holder's renewal after the late grants' purges: %v (a purge removed its entry)", err)
	}
	info, err := b.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if !info.Held || info.Token != r.l.Token() {
		t.Fatalf("after the late grants' purges the lock is %+v, want held by token %d", info, r.l.Token())
	}
}

// TestLateGrantGivenBackAfterCut: TryAcquire's three grants of a
// 2.001s lease (3s on the server) are confirmed late through a slow link;
// the purge giving back the last one is lost with a cut connection (the
// client reconnects at once, the link is then fast). The grant "given back"
// with ErrLost must not hold the name for most of a ttl: the purge is sent
// once, in the background, and not tried again on the new connection.
func TestLateGrantGivenBackAfterCut(t *testing.T) {
	t.Parallel() // its own names and proxies
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 5 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("natslate-cutpurge")
	// Each attempt has a nonce of its own (a create refused for a changed
	// revision is sent again with the same one).
	var mu sync.Mutex
	nonces := map[string]bool{}
	creates := func() int { mu.Lock(); defer mu.Unlock(); return len(nonces) }
	observe(t, lockSubject(name), func(m *nats.Msg) {
		if m.Header.Get("KV-Operation") != "" || len(m.Data) == 0 {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if !nonces[string(m.Data)] {
			nonces[string(m.Data)] = true
			if len(nonces) == 3 {
				// The last grant reached the server: its give-back is lost.
				p.DropRequest(func(b []byte) bool { return bytes.Contains(b, []byte("PURGE")) })
			}
		}
	})
	err := notGrantedOnSlowLink(t, p, 400*time.Millisecond, "TryAcquire with every grant late", func() (fence.Lease, error) {
		return a.TryAcquire(ctx, name, 2*time.Second+time.Millisecond)
	})
	t.Logf("TryAcquire: %v (%d creates)", err, creates())
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("TryAcquire: %v, want ErrLost", err)
	}
	if creates() != 3 {
		t.Fatalf("%d creates, want 3", creates())
	}
	took := waitFree(t, newAcquirer(t, js(t), lockBucket, nil), name, 5*time.Second)
	t.Logf("free %v after ErrLost", took)
	if took > time.Second {
		t.Errorf("the late grant given back with ErrLost held the name %v after TryAcquire returned (its give-back was lost with the connection and not sent again)", took)
	}
}

// TestLateGrantOwnOrphanNotErrHeld: TryAcquire's first grant of a
// 2.001s lease (3s on the server) is confirmed late through a slow link; the
// purge giving it back is lost with a cut connection, and the link is fast
// again. The next attempt finds the name held by that same grant (its nonce
// was changed) and TryAcquire answers ErrHeld: nobody else holds the name,
// and the entry that blocks it, and everyone, stays until the server's
// expiry. A losing TryAcquire's failed cleanup must not keep a free lock
// from the others for a ttl.
func TestLateGrantOwnOrphanNotErrHeld(t *testing.T) {
	t.Parallel() // its own names and proxies
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 5 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("natslate-ownorphan")
	var armed sync.Once
	observe(t, lockSubject(name), func(m *nats.Msg) {
		if m.Header.Get("KV-Operation") != "" || len(m.Data) == 0 {
			return
		}
		armed.Do(func() {
			// The first grant reached the server: its give-back is lost,
			// and the link is fast from then on.
			p.DropRequest(func(b []byte) bool {
				if bytes.Contains(b, []byte("PURGE")) {
					go p.Latency(0, 0)
					return true
				}
				return false
			})
		})
	})
	p.Latency(400*time.Millisecond, 400*time.Millisecond)
	l, err := a.TryAcquire(ctx, name, 2*time.Second+time.Millisecond)
	p.Latency(0, 0)
	if err == nil {
		t.Logf("granted token %d (the attempt after the cut was in time, its late grant given back)", l.Token())
		_ = l.Release(ctx)
		return
	}
	t.Logf("TryAcquire: %v", err)
	if p.Pending() != 0 {
		t.Fatalf("the give-back purge was never sent")
	}
	took := waitFree(t, newAcquirer(t, js(t), lockBucket, nil), name, 5*time.Second)
	t.Logf("free %v after TryAcquire returned", took)
	if took > time.Second {
		t.Errorf("after TryAcquire (%v) its own late grant held the name %v more (its give-back was lost with the connection and not sent again)", err, took)
	}
}

// TestTryAcquireCancelledDuringCreateNotHeld: a TryAcquire of a
// free name cancelled as its create reaches the server (the ack held by a
// slow link) does not know whether it holds the name: ErrUnknown.
// Acquirer.fail, shared with TryAcquire, joins ErrHeld to an
// ErrUnknown whenever the context has ended, so TryAcquire now says "held by
// another holder" (fence.ErrHeld) for a name nobody else holds and that its
// own create may hold.
func TestTryAcquireCancelledDuringCreateNotHeld(t *testing.T) {
	t.Parallel() // its own names and proxies
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 10 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("natslate-trycreate")
	tctx, cancel := context.WithCancel(ctx)
	defer cancel()
	onFirstCreate(t, name, cancel)
	err := notGrantedOnSlowLink(t, p, 300*time.Millisecond, "TryAcquire cancelled during its create", func() (fence.Lease, error) {
		return a.TryAcquire(tctx, name, 20*time.Second)
	})
	t.Logf("TryAcquire: %v", err)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("TryAcquire cancelled during its create: %v, want ErrUnknown", err)
	}
	if errors.Is(err, fence.ErrHeld) {
		t.Errorf("TryAcquire of a free name cancelled during its own create: %v matches ErrHeld (\"another holder has the lease\"), and nobody else holds it", err)
	}
	waitFree(t, newAcquirer(t, js(t), lockBucket, nil), name, 8*time.Second)
}

// TestLateGrantLoopEndsDuringTokenRead: the case the late-grant loop is
// for. Every grant of a 1s lease is late through a 300ms link; the waiting Acquire tries
// on, and its context ends (a cancel) during the second late grant's token
// read, one of the phases its end falls in when it comes at a random time.
// It must give up with ErrHeld and context.Canceled.
func TestLateGrantLoopEndsDuringTokenRead(t *testing.T) {
	// Not parallel: it watches every STREAM.INFO read of the bucket,
	// which the other tests' acquirers make too.
	a, p := proxiedAcquirer(t, nil)
	ctx := context.Background()
	name := fencetest.Name("natslate-loopinfo")
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	var reads atomic.Int64
	observe(t, tokenReadSubject, func(*nats.Msg) {
		if reads.Add(1) == 2 {
			cancel()
		}
	})
	err := notGrantedOnSlowLink(t, p, 300*time.Millisecond, "Acquire with every grant late", func() (fence.Lease, error) {
		return a.Acquire(actx, name, natsfence.MinTTL)
	})
	t.Logf("Acquire: %v (%d token reads)", err, reads.Load())
	if reads.Load() < 2 {
		t.Fatalf("Acquire gave up before its second late grant's token read: %v", err)
	}
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) || errors.Is(err, fence.ErrLost) {
		t.Errorf("Acquire ended during a late grant's token read: %v, want ErrHeld and context.Canceled (not ErrLost)", err)
	}
	waitFree(t, newAcquirer(t, js(t), lockBucket, nil), name, 3*time.Second)
}

// TestAcquireGivesUpAtItsEndUnderPartition: a waiting Acquire is
// cancelled during its grant's token read, and the link then holds every
// byte (a partition). It must give up at its context's end (the suite allows
// 400ms plus twice a TryAcquire, a few ms on this link before the fault);
// its purge of the grant, sent without the context's cancel, waits the
// whole request Timeout (2s by default) first. The late loop's purge is
// sent the same way.
func TestAcquireGivesUpAtItsEndUnderPartition(t *testing.T) {
	// Not parallel: it watches every STREAM.INFO read of the bucket,
	// which the other tests' acquirers make too.
	a, p := proxiedAcquirer(t, nil)
	ctx := context.Background()
	name := fencetest.Name("natslate-partition")
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	var cancelledAt atomic.Int64
	observe(t, tokenReadSubject, func(*nats.Msg) {
		if cancelledAt.CompareAndSwap(0, time.Now().UnixNano()) {
			cancel()
			p.Partition()
		}
	})
	defer p.Heal()
	var returned time.Time
	err := notGrantedOnSlowLink(t, p, 300*time.Millisecond, "Acquire cancelled during its token read", func() (fence.Lease, error) {
		l, err := a.Acquire(actx, name, 20*time.Second)
		returned = time.Now()
		p.Heal()
		return l, err
	})
	if cancelledAt.Load() == 0 {
		t.Fatalf("Acquire returned before its token read: %v", err)
	}
	after := returned.Sub(time.Unix(0, cancelledAt.Load()))
	t.Logf("Acquire: %v (%v after the cancel)", err, after)
	if after > time.Second {
		t.Errorf("Acquire gave up %v after its context was cancelled (a purge sent without its cancel waited out the request Timeout)", after)
	}
	waitFree(t, newAcquirer(t, js(t), lockBucket, nil), name, 5*time.Second)
}

// TestCreateHeldPastCleanupDoesNotHoldName: a TryAcquire's create is held in a
// partition from just before it is sent until well after the TryAcquire
// returned ErrUnknown and its background cleanup gave up (it looks for at
// most the ttl), and is then delivered. It must not land and hold the name
// for a fresh ttl with an owner that is gone: a create lands
// within a bound counted from its send, or never.
func TestCreateHeldPastCleanupDoesNotHoldName(t *testing.T) {
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 500 * time.Millisecond, RetryFor: time.Second})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	name := fencetest.Name("heldcreate")
	key := natsfence.EncodeKey(name)
	var once sync.Once
	natsfence.SetCreateHook(func(k string) {
		if k == key {
			once.Do(p.Partition)
		}
	})
	defer natsfence.SetCreateHook(nil)
	defer p.Heal()
	const ttl = 4 * time.Second
	_, err := a.TryAcquire(ctx, name, ttl)
	returned := time.Now()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a grant whose create is held in a partition: %v, want ErrUnknown", err)
	}
	// The partition's length is the case, not a wait for an event: it
	// outlasts the cleanup, which gives up a ttl after it began (at the
	// return), by a generous margin.
	time.Sleep(time.Until(returned.Add(ttl + 3*time.Second)))
	p.Heal()
	// A grant of another name on the same connection: its create's ack
	// comes after the stream has handled the held create (one connection,
	// one stream, handled in order).
	probe, err := a.TryAcquire(ctx, fencetest.Name("heldcreate-probe"), ttl)
	if err != nil {
		t.Fatalf("a grant after the heal: %v", err)
	}
	_ = probe.Release(ctx)
	li, err := other.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if li.Held {
		t.Fatalf("the create delivered %v after its TryAcquire returned ErrUnknown holds the name: token %d, owner %q, %v left", time.Since(returned).Round(time.Millisecond), li.Token, li.Owner, li.TimeLeft.Round(time.Millisecond))
	}
	l, err := other.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("the name after the held create was delivered: %v, want it free", err)
	}
	_ = l.Release(ctx)
}

// proxiedAcquirer returns an acquirer of lockBucket with opts whose client
// reaches the server through a new faultnet proxy, and the proxy.
func proxiedAcquirer(t *testing.T, opts *natsfence.AcquirerOptions) (*natsfence.Acquirer, *faultnet.Proxy) {
	t.Helper()
	j, p := proxied(t)
	return newAcquirer(t, j, lockBucket, opts), p
}
