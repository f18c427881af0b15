package natsfence_test

// Connection breaks: each test drives a request or a waiting Acquire through
// a break against the real in-process server, through a faultnet proxy, and
// checks what natsfence and fence.Acquirer promise.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// longTimeout is a request Timeout far above anything a lost reply should
// cost once the connection that lost it has broken.
const longTimeout = time.Minute

// TestLostReplyEndsAtTheBreak: a request whose reply is lost with its
// connection (faultnet forwards it, then cuts) is answered at the break, not
// after its Timeout: the nats client would wait the whole minute for a reply
// that can no longer come, although it reconnects within milliseconds. The
// write, the grant and the release each land once and are recognised.
func TestLostReplyEndsAtTheBreak(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	bound := longTimeout / 2

	bucket(t, j, writerBucket)
	w, err := natsfence.NewWriter(ctx, j, writerBucket.Bucket, &natsfence.WriterOptions{Timeout: longTimeout})
	if err != nil {
		t.Fatal(err)
	}
	check := newWriter(t, js(t), writerBucket)
	key := fencetest.Name("break")
	if err := w.Write(ctx, key, []byte("v1"), 5); err != nil {
		t.Fatal(err)
	}
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(writerBucket.Bucket))
	start := time.Now()
	err = w.Write(ctx, key, []byte("v2"), 6)
	took := time.Since(start)
	waitLost(t, p, before)
	if err != nil {
		t.Fatalf("a write whose ack was lost with its connection: %v", err)
	}
	if took > bound {
		t.Fatalf("the write whose ack was lost took %v: it waited for its Timeout (%v), not for the break", took, longTimeout)
	}
	if v, tok, err := check.Read(ctx, key); err != nil || string(v) != "v2" || tok != 6 {
		t.Fatalf("Read = %q %d %v, want v2 6", v, tok, err)
	}

	bucket(t, j, lockBucket)
	a, err := natsfence.NewAcquirer(ctx, j, lockBucket.Bucket, &natsfence.AcquirerOptions{Timeout: longTimeout})
	if err != nil {
		t.Fatal(err)
	}
	other := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("break")
	before = p.Stats().LostReplies
	p.LoseReply(createTo(lockBucket.Bucket))
	start = time.Now()
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	took = time.Since(start)
	waitLost(t, p, before)
	if err != nil {
		t.Fatalf("a grant whose answer was lost with its connection: %v", err)
	}
	if took > bound {
		t.Fatalf("the grant whose answer was lost took %v: it waited for its Timeout", took)
	}
	if _, err := other.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("another acquirer while the recognised grant holds: %v, want ErrHeld", err)
	}
	before = p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	start = time.Now()
	err = l.Release(ctx)
	took = time.Since(start)
	waitLost(t, p, before)
	if err != nil {
		t.Fatalf("a release whose answer was lost with its connection: %v", err)
	}
	if took > bound {
		t.Fatalf("the release whose answer was lost took %v: it waited for its Timeout", took)
	}
	l2, err := other.TryAcquire(ctx, name, time.Second)
	if err != nil || l2.Token() <= l.Token() {
		t.Fatalf("after the release: %v, %v (token %d before)", l2, err, l.Token())
	}
	_ = l2.Release(ctx)
}

// TestWaiterAfterABreak: a waiter whose connection breaks while it waits is
// granted promptly when the holder releases while it is away. Its watch
// cannot see that release: the server either delivers the release's marker
// to the connection that just broke (the client's ordered consumer notices
// the gap only at its next idle heartbeat, 5s later, and starts again after
// the last message it saw) or keeps it for the client's return, and the
// marker lives only LimitMarkerTTL (1s). The test makes this certain, not
// likely: the cut lands once the waiter's try has found the name held and it
// waits (a hook), and the waiter's client is kept away until the holder's
// release has been sent and its marker has aged out of the stream. With
// Recheck at a minute, only trying again and watching anew at the break gets
// it the lock in time.
func TestWaiterAfterABreak(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	direct := js(t)
	holderSide := newAcquirer(t, direct, lockBucket, nil)
	bucket(t, j, lockBucket)
	stream, err := direct.Stream(ctx, "KV_"+lockBucket.Bucket)
	if err != nil {
		t.Fatal(err)
	}
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: longTimeout, MaxWait: 2 * longTimeout})
	waiting := waitingHook(t)
	for round := 0; round < 3; round++ {
		name := fencetest.Name("breakwait")
		key := natsfence.EncodeKey(name)
		h, err := holderSide.TryAcquire(ctx, name, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		res := make(chan error, 1)
		var got fence.Lease
		go func() {
			l, err := waiter.Acquire(ctx, name, 30*time.Second)
			got = l
			res <- err
		}()
		waitKey(t, waiting, key, res, "the waiter never waited for the held name")
		// Cut, and keep the waiter's client away (its reconnections cut
		// at their CONNECT) until the release has been sent and its
		// marker has aged out of the stream.
		var away atomic.Bool
		away.Store(true)
		for range 1000 {
			p.DropRequest(func(b []byte) bool { return away.Load() && bytes.HasPrefix(b, []byte("CONNECT ")) })
		}
		back := j.Conn().StatusChanged(nats.CONNECTED)
		cuts := p.Stats().Cuts
		p.CutAll()
		if p.Stats().Cuts == cuts {
			t.Fatalf("round %d: the cut cut no connection", round)
		}
		if err := h.Release(ctx); err != nil {
			t.Fatal(err)
		}
		markerGone(t, stream, "$KV."+lockBucket.Bucket+"."+key)
		j.Conn().RemoveStatusListener(back)
		if _, ok := <-back; ok || j.Conn().IsConnected() {
			t.Fatalf("round %d: the waiter's client was connected again before the release's marker was gone", round)
		}
		away.Store(false)
		start := time.Now()
		select {
		case err := <-res:
			if err != nil {
				t.Fatalf("round %d: the waiter after a break and the holder's release: %v", round, err)
			}
		case <-time.After(longTimeout / 2):
			t.Fatalf("round %d: the waiter was not granted within %v of its return after a break and the release (Recheck %v): its watch missed the release", round, longTimeout/2, longTimeout)
		}
		t.Logf("round %d: granted %v after the client was let back", round, time.Since(start))
		if got.Token() <= h.Token() {
			t.Fatalf("token %d after the holder's %d", got.Token(), h.Token())
		}
		_ = got.Release(ctx)
	}
}

// TestWaiterWhoseWatchWasCut: a waiter whose connection breaks while its
// watch is being made (the consumer's create request dropped with the
// connection) has no watch; its try, after the reconnect, finds the name
// held. The holder's release, once it waits, must still reach it well within
// Recheck: the break before it waited makes it watch anew.
func TestWaiterWhoseWatchWasCut(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	holderSide := newAcquirer(t, js(t), lockBucket, nil)
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: longTimeout, MaxWait: 2 * longTimeout})
	name, key, h, waiting := holdForWaiter(t, holderSide, "breakwatch", 30*time.Second)
	var dropped atomic.Bool
	p.DropRequest(func(b []byte) bool {
		if bytes.Contains(b, []byte("CONSUMER.CREATE")) && bytes.Contains(b, []byte(key)) {
			dropped.Store(true)
			return true
		}
		return false
	})
	res := make(chan error, 1)
	var got fence.Lease
	go func() {
		l, err := waiter.Acquire(ctx, name, 30*time.Second)
		got = l
		res <- err
	}()
	waitKey(t, waiting, key, res, "the waiter never waited for the held name")
	if !dropped.Load() {
		t.Fatal("the waiter waited, but its watch's create request was not dropped with its connection")
	}
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	select {
	case err := <-res:
		if err != nil {
			t.Fatalf("the waiter whose watch was cut, after the holder's release: %v", err)
		}
	case <-time.After(longTimeout / 2):
		t.Fatalf("the waiter whose watch was cut was not granted within %v of the release (Recheck %v)", longTimeout/2, longTimeout)
	}
	t.Logf("granted %v after the release", time.Since(start))
	if got.Token() <= h.Token() {
		t.Fatalf("token %d after the holder's %d", got.Token(), h.Token())
	}
	_ = got.Release(ctx)
}

// waitingHook reports, on the channel it returns, the lock key of each
// waiting Acquire that begins to wait, until t ends.
func waitingHook(t *testing.T) <-chan string {
	ch := make(chan string, 64)
	natsfence.SetWaitingHook(func(key string) {
		select {
		case ch <- key:
		default:
		}
	})
	t.Cleanup(func() { natsfence.SetWaitingHook(nil) })
	return ch
}

// holdForWaiter installs a waitingHook and has holder take
// fencetest.Name(label) for ttl, for a waiter to wait on; it returns the
// name, its lock key, the holder's lease and the hook's channel.
func holdForWaiter(t *testing.T, holder *natsfence.Acquirer, label string, ttl time.Duration) (name, key string, h fence.Lease, waiting <-chan string) {
	t.Helper()
	waiting = waitingHook(t)
	name = fencetest.Name(label)
	h, err := holder.TryAcquire(context.Background(), name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	return name, natsfence.EncodeKey(name), h, waiting
}

// waitKey waits until waiting reports key; it fails with msg after 30s, or
// when the Acquire ends first (res).
func waitKey(t *testing.T, waiting <-chan string, key string, res <-chan error, msg string) {
	t.Helper()
	limit := time.After(30 * time.Second)
	for {
		select {
		case k := <-waiting:
			if k == key {
				return
			}
		case err := <-res:
			t.Fatalf("%s: Acquire ended first: %v", msg, err)
		case <-limit:
			t.Fatal(msg)
		}
	}
}

// markerGone waits until the last message on subj (a release's marker) has
// aged out of stream.
func markerGone(t *testing.T, stream jetstream.Stream, subj string) {
	t.Helper()
	for giveUp := time.Now().Add(30 * time.Second); ; {
		_, err := stream.GetLastMsgForSubject(context.Background(), subj)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return
		}
		if err != nil {
			t.Fatalf("the last message on %s: %v", subj, err)
		}
		if time.Now().After(giveUp) {
			t.Fatalf("the release's marker on %s did not age out within 30s", subj)
		}
		time.Sleep(10 * time.Millisecond) // polling the server, not synchronisation
	}
}

// keepAway makes the proxy cut every reconnection of its clients at their
// CONNECT while the returned flag is set.
func keepAway(p *faultnet.Proxy) *atomic.Bool {
	var away atomic.Bool
	away.Store(true)
	for range 1000 {
		p.DropRequest(func(b []byte) bool { return away.Load() && bytes.HasPrefix(b, []byte("CONNECT ")) })
	}
	return &away
}

// cutAndWaitBack cuts every connection of p and waits until nc is connected
// again.
func cutAndWaitBack(t *testing.T, p *faultnet.Proxy, nc *nats.Conn) {
	t.Helper()
	cuts := p.Stats().Cuts
	reconnects := nc.Stats().Reconnects
	p.CutAll()
	if p.Stats().Cuts == cuts {
		t.Fatal("the cut cut no connection")
	}
	for giveUp := time.Now().Add(10 * time.Second); !nc.IsConnected() || nc.Stats().Reconnects == reconnects; {
		if time.Now().After(giveUp) {
			t.Fatal("not connected again within 10s of the cut")
		}
		time.Sleep(time.Millisecond) // polling the client's state
	}
}

type acquired struct {
	l   fence.Lease
	err error
	at  time.Time
}

func goAcquire(ctx context.Context, a *natsfence.Acquirer, name string, ttl time.Duration) <-chan acquired {
	res := make(chan acquired, 1)
	go func() {
		l, err := a.Acquire(ctx, name, ttl)
		res <- acquired{l, err, time.Now()}
	}()
	return res
}

// grantedAfterRelease waits up to within for the waiter's result after the
// holder h released, just before the call: a grant, with a token above h's, which it
// releases. after says what happened to the waiter before the release (it
// ends both failure messages); a waiter not granted in time had no watch and
// waited for its Recheck.
func grantedAfterRelease(t *testing.T, res <-chan acquired, h fence.Lease, within time.Duration, after string) {
	t.Helper()
	released := time.Now()
	select {
	case r := <-res:
		if r.err != nil {
			t.Fatalf("the waiter %s and the release: %v", after, r.err)
		}
		t.Logf("granted %v after the release", r.at.Sub(released))
		if r.l.Token() <= h.Token() {
			t.Fatalf("token %d after the holder's %d", r.l.Token(), h.Token())
		}
		_ = r.l.Release(context.Background())
	case <-time.After(within):
		t.Fatalf("the waiter was not granted within %v of the release %s (Recheck 1m): it had no watch", within, after)
	}
}

// waitKeyA is waitKey for an Acquire reporting on an acquired channel.
func waitKeyA(t *testing.T, waiting <-chan string, key string, res <-chan acquired, msg string) {
	t.Helper()
	errs := make(chan error, 1)
	stop := make(chan struct{})
	defer close(stop)
	var got *acquired
	var mu sync.Mutex
	go func() {
		select {
		case r := <-res:
			mu.Lock()
			got = &r
			mu.Unlock()
			errs <- fmt.Errorf("ended with %v, %v", r.l, r.err)
		case <-stop:
		}
	}()
	waitKey(t, waiting, key, errs, msg)
	_ = got
}

// TestCtxEndsWhileAway: a waiter whose connection breaks and stays
// away gives up at its ctx's deadline (it waits to be connected again within
// ctx) with an error matching fence.ErrHeld and context.DeadlineExceeded.
func TestCtxEndsWhileAway(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	holderSide := newAcquirer(t, js(t), lockBucket, nil)
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	name, key, h, waiting := holdForWaiter(t, holderSide, "awayctx", 30*time.Second)
	defer h.Release(ctx)
	wctx, cancel := context.WithTimeout(ctx, 4*time.Second)
	defer cancel()
	res := goAcquire(wctx, waiter, name, 10*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	away := keepAway(p)
	defer away.Store(false)
	p.CutAll()
	deadline, _ := wctx.Deadline()
	select {
	case r := <-res:
		if r.l != nil {
			t.Fatalf("granted while the holder holds: token %d", r.l.Token())
		}
		if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.DeadlineExceeded) {
			t.Fatalf("Acquire whose ctx ended while its client was away: %v, want ErrHeld and DeadlineExceeded", r.err)
		}
		if late := r.at.Sub(deadline); late > time.Second {
			t.Fatalf("Acquire returned %v after its deadline", late)
		}
		t.Logf("returned %v after the deadline: %v", r.at.Sub(deadline), r.err)
	case <-time.After(20 * time.Second):
		t.Fatal("Acquire did not return within 16s of its deadline while its client was away")
	}
}

// TestWaiterConnClosed: the waiter's connection closed for good
// while it waits ends its Acquire promptly, with an error and no lease.
func TestWaiterConnClosed(t *testing.T) {
	nc := natstest.Connect(t, srv.ClientURL())
	j := jsOn(t, nc)
	ctx := context.Background()
	holderSide := newAcquirer(t, js(t), lockBucket, nil)
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	name, key, h, waiting := holdForWaiter(t, holderSide, "closed", 30*time.Second)
	defer h.Release(ctx)
	res := goAcquire(ctx, waiter, name, 10*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	start := time.Now()
	nc.Close()
	select {
	case r := <-res:
		if r.l != nil || r.err == nil {
			t.Fatalf("Acquire after its connection was closed: %v, %v", r.l, r.err)
		}
		t.Logf("returned %v after the close: %v", r.at.Sub(start), r.err)
		if r.at.Sub(start) > 2*time.Second {
			t.Fatalf("Acquire returned %v after its connection was closed", r.at.Sub(start))
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Acquire did not return within 20s of its connection's close (MaxWait 30s)")
	}
}

// TestHerdAfterABreak: many waiters on one acquirer, whose connection
// breaks while they wait and stays away until the holder's release and its
// marker are gone. Every waiter is granted in turn, one at a time, each
// promptly after the previous one's release (Recheck a minute), with
// tokens that only grow.
func TestHerdAfterABreak(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	direct := js(t)
	holderSide := newAcquirer(t, direct, lockBucket, nil)
	stream, err := direct.Stream(ctx, "KV_"+lockBucket.Bucket)
	if err != nil {
		t.Fatal(err)
	}
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute, MaxWait: 2 * time.Minute})
	name, key, h, waiting := holdForWaiter(t, holderSide, "herd", 30*time.Second)
	const n = 8
	var held atomic.Int32
	var mu sync.Mutex
	var order []fence.Token
	var grants []time.Time
	errs := make(chan error, n)
	seen := 0
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l, err := waiter.Acquire(ctx, name, 10*time.Second)
			if err != nil {
				errs <- err
				return
			}
			if c := held.Add(1); c != 1 {
				errs <- fmt.Errorf("%d holders at once", c)
			}
			mu.Lock()
			order = append(order, l.Token())
			grants = append(grants, time.Now())
			mu.Unlock()
			time.Sleep(20 * time.Millisecond) // holding the lease a moment: pacing, not synchronisation
			held.Add(-1)
			if err := l.Release(ctx); err != nil {
				errs <- err
			}
		}()
	}
	for seen < n {
		select {
		case k := <-waiting:
			if k == key {
				seen++
			}
		case err := <-errs:
			t.Fatal(err)
		case <-time.After(30 * time.Second):
			t.Fatalf("only %d of %d waiters waited", seen, n)
		}
	}
	away := keepAway(p)
	back := j.Conn().StatusChanged(nats.CONNECTED)
	p.CutAll()
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	markerGone(t, stream, "$KV."+lockBucket.Bucket+"."+key)
	j.Conn().RemoveStatusListener(back)
	if _, ok := <-back; ok || j.Conn().IsConnected() {
		t.Fatal("the waiters' client was connected again before the release's marker was gone")
	}
	start := time.Now()
	away.Store(false)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(45 * time.Second):
		mu.Lock()
		t.Fatalf("%d of %d waiters granted within 45s of their client's return (Recheck 1m)", len(order), n)
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d waiters granted in %v: %v", len(order), time.Since(start), order)
	for i := 1; i < len(order); i++ {
		if order[i] <= order[i-1] {
			t.Errorf("grant %d: token %d after %d", i, order[i], order[i-1])
		}
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("%d waiters took %v after their client's return: some waited for a recheck", n, d)
	}
}

// TestRepeatedBreaksNoLeak: a waiter whose connection breaks many
// times while it waits is granted promptly after the release, and once it
// released, its goroutines, the client's subscriptions and the server's
// consumers on the bucket are back to where they were.
func TestRepeatedBreaksNoLeak(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	direct := js(t)
	holderSide := newAcquirer(t, direct, lockBucket, nil)
	stream, err := direct.Stream(ctx, "KV_"+lockBucket.Bucket)
	if err != nil {
		t.Fatal(err)
	}
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute, MaxWait: 2 * time.Minute})
	nc := j.Conn()
	name, key, h, waiting := holdForWaiter(t, holderSide, "breaks", 60*time.Second)
	consumers := func() int {
		info, err := stream.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Consumers
	}
	runtime.GC()
	g0, s0, c0 := runtime.NumGoroutine(), nc.NumSubscriptions(), consumers()
	res := goAcquire(ctx, waiter, name, 10*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	const breaks = 15
	for i := 0; i < breaks; i++ {
		cutAndWaitBack(t, p, nc)
		waitKeyA(t, waiting, key, res, fmt.Sprintf("break %d: the waiter did not try and wait again", i))
	}
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var r acquired
	select {
	case r = <-res:
	case <-time.After(30 * time.Second):
		t.Fatal("the waiter was not granted within 30s of the release after many breaks (Recheck 1m)")
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	t.Logf("granted %v after the release", r.at.Sub(start))
	if err := r.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var g, s, c int
	for giveUp := time.Now().Add(20 * time.Second); ; {
		runtime.GC()
		g, s, c = runtime.NumGoroutine(), nc.NumSubscriptions(), consumers()
		if g <= g0+2 && s <= s0 && c <= c0 {
			break
		}
		if time.Now().After(giveUp) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Logf("goroutines:\n%s", buf)
			t.Fatalf("20s after the grant's release, %d breaks: goroutines %d (before %d), subscriptions %d (before %d), server consumers %d (before %d)", breaks, g, g0, s, s0, c, c0)
		}
		time.Sleep(100 * time.Millisecond) // polling counts
	}
	t.Logf("goroutines %d (before %d), subscriptions %d (before %d), consumers %d (before %d)", g, g0, s, s0, c, c0)
}

// TestGrantInFlightAtABreak: the waiter's grant, woken by
// the release, lands while its reply is lost with the connection, and the
// client stays away longer than RetryFor. Whatever Acquire returns (a lease,
// or an error matching fence.ErrUnknown, never a definite failure), the
// landed grant is not leaked: once the client is back, the name is free
// long before the ttl, or held by the lease Acquire returned.
func TestGrantInFlightAtABreak(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	holderSide := newAcquirer(t, js(t), lockBucket, nil)
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute, Timeout: 500 * time.Millisecond, RetryFor: time.Second})
	name, key, h, waiting := holdForWaiter(t, holderSide, "inflight", 30*time.Second)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	res := goAcquire(wctx, waiter, name, 30*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	var away atomic.Bool
	for range 1000 {
		p.DropRequest(func(b []byte) bool { return away.Load() && bytes.HasPrefix(b, []byte("CONNECT ")) })
	}
	// The grant's publish is forwarded and its reply lost with the
	// connection; the client is then kept away.
	before := p.Stats().LostReplies
	p.LoseReply(func(b []byte) bool {
		if bytes.Contains(b, []byte("PUB $KV."+lockBucket.Bucket+"."+key)) || bytes.Contains(b, []byte("HPUB $KV."+lockBucket.Bucket+"."+key)) {
			away.Store(true)
			return true
		}
		return false
	})
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for giveUp := time.Now().Add(10 * time.Second); p.Stats().LostReplies == before; {
		if time.Now().After(giveUp) {
			t.Fatal("the grant's reply was not lost within 10s of the release")
		}
		time.Sleep(time.Millisecond) // polling the proxy's count
	}
	var r acquired
	var lettingBack time.Time
	select {
	case r = <-res:
		t.Logf("Acquire while away: %v, %v", r.l, r.err)
		lettingBack = time.Now()
		away.Store(false)
	case <-time.After(5 * time.Second):
		// Still waiting to be connected: let it back and take its answer.
		lettingBack = time.Now()
		away.Store(false)
		select {
		case r = <-res:
		case <-time.After(20 * time.Second):
			t.Fatal("Acquire did not return within 20s of its client's return")
		}
		t.Logf("Acquire after its client's return: %v, %v", r.l, r.err)
	}
	other := newAcquirer(t, js(t), lockBucket, nil)
	switch {
	case r.err == nil:
		if _, err := other.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("the waiter holds a lease, another acquirer got %v, want ErrHeld", err)
		}
		_ = r.l.Release(ctx)
	case errors.Is(r.err, fence.ErrUnknown):
		// The landed grant must be removed once the client is back.
		for {
			l, err := other.TryAcquire(ctx, name, time.Second)
			if err == nil {
				t.Logf("the name was free %v after the client's return", time.Since(lettingBack))
				_ = l.Release(ctx)
				break
			}
			if time.Since(lettingBack) > 10*time.Second {
				t.Fatalf("the waiter's landed grant (Acquire: %v) still blocks the name 10s after its client's return (ttl 30s): %v", r.err, err)
			}
			time.Sleep(50 * time.Millisecond) // polling the server
		}
	default:
		t.Fatalf("Acquire whose grant landed and whose reply was lost: %v, want a lease or ErrUnknown", r.err)
	}
}

// TestWaiterAcrossServerRestart: the server restarts (its store kept)
// while a waiter waits; after the restart the holder releases. The waiter
// must be granted promptly, not after its Recheck (a minute): its break made
// it watch anew once connected.
func TestWaiterAcrossServerRestart(t *testing.T) {
	opts := &server.Options{
		ServerName: "restart",
		Host:       "127.0.0.1",
		Port:       testenv.Port(t),
		JetStream:  true,
		StoreDir:   t.TempDir(),
		MaxPayload: natstest.MaxPayload,
		NoLog:      true,
		NoSigs:     true,
	}
	start := func() *server.Server {
		s, err := server.NewServer(opts)
		if err != nil {
			t.Fatal(err)
		}
		go s.Start()
		if !s.ReadyForConnections(20 * time.Second) {
			t.Fatal("server not ready")
		}
		return s
	}
	s := start()
	t.Cleanup(func() { s.Shutdown() })
	url := s.ClientURL()
	ctx := context.Background()
	hj := jsOn(t, natstest.Connect(t, url))
	wj := jsOn(t, natstest.Connect(t, url))
	holderSide := newAcquirer(t, hj, lockBucket, nil)
	waiter := newAcquirer(t, wj, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute, MaxWait: 2 * time.Minute})
	name, key, h, waiting := holdForWaiter(t, holderSide, "restart", 60*time.Second)
	res := goAcquire(ctx, waiter, name, 10*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	s.Shutdown()
	s.WaitForShutdown()
	s = start()
	for giveUp := time.Now().Add(20 * time.Second); !hj.Conn().IsConnected() || !wj.Conn().IsConnected(); {
		if time.Now().After(giveUp) {
			t.Fatal("clients not connected again within 20s of the restart")
		}
		time.Sleep(5 * time.Millisecond) // polling the clients' state
	}
	// The waiter watches anew and tries again after the restart; then the
	// holder releases.
	waitKeyA(t, waiting, key, res, "the waiter did not try again after the restart")
	var rerr error
	for giveUp := time.Now().Add(20 * time.Second); ; {
		if rerr = h.Release(ctx); rerr == nil || time.Now().After(giveUp) {
			break
		}
		time.Sleep(100 * time.Millisecond) // JetStream recovering: polling
	}
	if rerr != nil {
		t.Fatalf("the holder's release after the restart: %v", rerr)
	}
	grantedAfterRelease(t, res, h, 20*time.Second, "after a server restart")
}

var _ = jetstream.KeyValuePut

// grantReadAway makes the waiter's next read of key (its grant's look at the
// lock key, STREAM.MSG.GET) be dropped with its connection, and keeps its
// client away from then on; it returns a function reporting whether the drop
// happened.
func grantReadAway(p *faultnet.Proxy, key string) (dropped func() bool, away *atomic.Bool) {
	away = new(atomic.Bool)
	var hit atomic.Bool
	p.DropRequest(func(b []byte) bool {
		if bytes.Contains(b, []byte("STREAM.MSG.GET")) && bytes.Contains(b, []byte(key)) {
			hit.Store(true)
			away.Store(true)
			return true
		}
		return false
	})
	for range 1000 {
		p.DropRequest(func(b []byte) bool { return away.Load() && bytes.HasPrefix(b, []byte("CONNECT ")) })
	}
	return hit.Load, away
}

// TestCtxEndsDuringGrantRead: a waiter woken by the release whose
// grant's read of the key (nothing written yet) is lost with its connection,
// and whose client stays away, gives up at ctx's deadline with an error
// matching fence.ErrHeld and context.DeadlineExceeded, as fence.Acquirer
// promises: it sent no write, so there is no ambiguous outcome to report.
func TestCtxEndsDuringGrantRead(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	holderSide := newAcquirer(t, js(t), lockBucket, nil)
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	name, key, h, waiting := holdForWaiter(t, holderSide, "readctx", 30*time.Second)
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	res := goAcquire(wctx, waiter, name, 10*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	dropped, away := grantReadAway(p, key)
	defer away.Store(false)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var r acquired
	select {
	case r = <-res:
	case <-time.After(20 * time.Second):
		t.Fatal("Acquire did not return within 15s of its deadline")
	}
	if !dropped() {
		t.Fatalf("the waiter's grant read was not dropped (Acquire: %v, %v)", r.l, r.err)
	}
	deadline, _ := wctx.Deadline()
	t.Logf("returned %v after its deadline: %v", r.at.Sub(deadline), r.err)
	if r.l != nil {
		t.Fatalf("granted while its client was away: token %d", r.l.Token())
	}
	if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.DeadlineExceeded) {
		t.Fatalf("Acquire whose ctx ended while its grant's read was cut off: %v, want an error matching ErrHeld and DeadlineExceeded", r.err)
	}
}

// TestClosedDuringGrantRead: a waiter woken by the release, whose
// grant's read is lost with its connection, and whose connection is then
// closed for good, returns promptly with an error, and leaves no goroutine
// behind it.
func TestClosedDuringGrantRead(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	holderSide := newAcquirer(t, js(t), lockBucket, nil)
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	name, key, h, waiting := holdForWaiter(t, holderSide, "readclosed", 30*time.Second)
	runtime.GC()
	g0 := runtime.NumGoroutine()
	res := goAcquire(ctx, waiter, name, 5*time.Minute)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	dropped, away := grantReadAway(p, key)
	defer away.Store(false)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for giveUp := time.Now().Add(10 * time.Second); !dropped(); {
		if time.Now().After(giveUp) {
			t.Fatal("the waiter's grant read was not dropped within 10s of the release")
		}
		time.Sleep(time.Millisecond) // polling the proxy's fault
	}
	closed := time.Now()
	j.Conn().Close()
	var r acquired
	select {
	case r = <-res:
	case <-time.After(30 * time.Second):
		t.Fatal("Acquire did not return within 30s of its connection's close")
	}
	t.Logf("returned %v after the close: %v", r.at.Sub(closed), r.err)
	if r.l != nil || r.err == nil {
		t.Fatalf("Acquire on a closed connection: %v, %v", r.l, r.err)
	}
	if took := r.at.Sub(closed); took > 2*time.Second {
		t.Errorf("Acquire returned %v after its connection was closed for good (RetryFor %v): it retried a closed connection", took, 10*time.Second)
	}
	_ = g0
	for giveUp := time.Now().Add(10 * time.Second); ; {
		n, where := acquirerGoroutines()
		if n == 0 {
			break
		}
		if time.Now().After(giveUp) {
			t.Fatalf("10s after Acquire returned on its closed connection, %d goroutines of the acquirer still run (ttl 5m):\n%s", n, where)
		}
		time.Sleep(100 * time.Millisecond) // polling the goroutines
	}
}

// acquirerGoroutines counts the goroutines running natsfence's Acquirer
// code, and returns the first line naming it in each.
func acquirerGoroutines() (int, string) {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	var where []string
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		for _, line := range bytes.Split(g, []byte("\n")) {
			if bytes.Contains(line, []byte("adapters/nats.(*Acquirer)")) || bytes.Contains(line, []byte("adapters/nats.(*keyWatch)")) {
				n++
				where = append(where, string(line))
				break
			}
		}
	}
	return n, fmt.Sprint(where)
}

// TestFlappingWhileWaiting: the waiter's connection is cut at random
// (every 100ms) while it waits, the holder releases in the
// middle of it, and the cuts go on for 2s more. Once they stop, the waiter
// is granted promptly (Recheck a minute), and nothing of the acquirer is
// left running once it released.
func TestFlappingWhileWaiting(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	holderSide := newAcquirer(t, js(t), lockBucket, nil)
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute, MaxWait: 2 * time.Minute})
	waiting := waitingHook(t)
	n0, _ := acquirerGoroutines() // other tests' leftovers
	for round := 0; round < 3; round++ {
		name := fencetest.Name("flap")
		key := natsfence.EncodeKey(name)
		h, err := holderSide.TryAcquire(ctx, name, 60*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		res := goAcquire(ctx, waiter, name, 10*time.Second)
		waitKeyA(t, waiting, key, res, "the waiter never waited")
		start := p.Stats().Cuts
		stopCuts := make(chan struct{})
		cutting := make(chan struct{})
		go func() { // the fault schedule: a cut every 100ms
			defer close(cutting)
			tk := time.NewTicker(100 * time.Millisecond)
			defer tk.Stop()
			for {
				select {
				case <-stopCuts:
					return
				case <-tk.C:
					p.CutAll()
				}
			}
		}()
		time.Sleep(time.Second) // letting the cuts happen: the fault's duration
		if err := h.Release(ctx); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Second) // more cuts after the release
		close(stopCuts)
		<-cutting
		stopped := time.Now()
		cuts := p.Stats().Cuts - start
		var r acquired
		select {
		case r = <-res:
		case <-time.After(20 * time.Second):
			t.Fatalf("round %d: the waiter was not granted within 20s of the end of %d cuts (the release in the middle; Recheck 1m)", round, cuts)
		}
		if r.err != nil {
			// ErrUnknown is a possible outcome of a cut grant; the name must be free soon.
			if !errors.Is(r.err, fence.ErrUnknown) {
				t.Fatalf("round %d: %v", round, r.err)
			}
			t.Logf("round %d: %d cuts, Acquire: %v", round, cuts, r.err)
			continue
		}
		t.Logf("round %d: %d cuts, granted %v after they stopped (%v before)", round, cuts, r.at.Sub(stopped), stopped.Sub(r.at))
		if r.l.Token() <= h.Token() {
			t.Fatalf("token %d after %d", r.l.Token(), h.Token())
		}
		_ = r.l.Release(ctx)
	}
	for giveUp := time.Now().Add(20 * time.Second); ; {
		n, where := acquirerGoroutines()
		if n <= n0 {
			break
		}
		if time.Now().After(giveUp) {
			t.Fatalf("20s after the last release, %d acquirer goroutines (before %d): %s", n, n0, where)
		}
		time.Sleep(100 * time.Millisecond) // polling
	}
}

// TestAcquirersConcurrentCutRate: acquirers on clients of their own, two of
// them behind proxies that cut connections at random, contend for one name;
// each lease is released, renewed then released, or left to expire. Whenever
// a lease is granted, every earlier lease's context is done and its token is
// below the new one.
func TestAcquirersConcurrentCutRate(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("contend")
	var mu sync.Mutex
	var granted []fence.Lease
	const acquirers, rounds = 3, 6
	done := make(chan struct{}, acquirers)
	for i := 0; i < acquirers; i++ {
		j := js(t)
		var p interface{ CutRate(float64) }
		if i < 2 {
			j, p = proxied(t)
		}
		a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Timeout: 500 * time.Millisecond, RetryFor: 2 * time.Second, Recheck: 500 * time.Millisecond})
		if p != nil {
			p.CutRate(0.05)
		}
		go func(i int) {
			defer func() { done <- struct{}{} }()
			for n := 0; n < rounds; n++ {
				wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				start := time.Now()
				l, err := a.Acquire(wctx, name, time.Second)
				cancel()
				if err != nil {
					continue // ErrUnknown or a cut: nothing was granted to us
				}
				took := time.Since(start)
				mu.Lock()
				t.Logf("acquirer %d: token %d after %v (context err %v)", i, l.Token(), took, l.Context().Err())
				for _, e := range granted {
					if e.Context().Err() == nil {
						t.Errorf("acquirer %d granted token %d while token %d's context is live", i, l.Token(), e.Token())
					}
					if e.Token() >= l.Token() {
						t.Errorf("acquirer %d granted token %d after token %d", i, l.Token(), e.Token())
					}
				}
				granted = append(granted, l)
				mu.Unlock()
				switch (i + n) % 3 {
				case 0:
					_ = l.Release(ctx)
				case 1:
					_ = l.Renew(ctx)
					_ = l.Release(ctx)
				case 2:
					<-l.Context().Done()
				}
			}
		}(i)
	}
	for i := 0; i < acquirers; i++ {
		<-done
	}
	if len(granted) < acquirers {
		t.Fatalf("only %d grants", len(granted))
	}
	t.Logf("%d grants", len(granted))
}
