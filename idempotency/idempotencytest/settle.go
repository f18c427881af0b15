package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
)

// settleWait bounds each wait of these cases for a step of Do's background
// settling: generous, so that a loaded machine does not fail them.
const settleWait = 20 * time.Second

// heldRelease is a store whose claim lands after which the caller's context
// ends before the reply arrives (as cancelAfterClaim), and whose release of a
// claimed record (claimed -> released: the background settle's) is held until
// gate is closed, as a request delayed on the network or in a queue at the
// store; releasing is closed when it arrives, and its outcome is sent on
// released.
type heldRelease struct {
	idempotency.Store
	cancel    context.CancelFunc
	fence     *atomic.Uint64 // the abandoned claim's fence
	releasing chan struct{}
	gate      chan struct{}
	released  chan error
	once      *sync.Once
}

func (f heldRelease) Begin(ctx context.Context, key, fp, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	rec, created, err := f.Store.Begin(context.WithoutCancel(ctx), key, fp, owner, lease)
	if err != nil || !created {
		return rec, created, err
	}
	f.fence.Store(uint64(rec.Fence))
	f.cancel()
	<-ctx.Done()
	return idempotency.Record{}, false, fmt.Errorf("injected: the claim's reply was in flight: %w", ctx.Err())
}

func (f heldRelease) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if from != idempotency.Claimed || ch.State != idempotency.Released {
		return f.Store.Update(ctx, k, from, ff, ch)
	}
	first := false
	f.once.Do(func() { first = true; close(f.releasing) })
	if !first {
		return f.Store.Update(ctx, k, from, ff, ch)
	}
	<-f.gate
	rec, err := f.Store.Update(context.WithoutCancel(ctx), k, from, ff, ch)
	f.released <- err
	return rec, err
}

// testSettleNeverFreesTakenOverClaim: a caller whose context ended while its
// claim's reply was in flight leaves a background settle that releases the
// claim. When that release is delayed until the claim's lease ran out and
// another caller took the key over and started its effect, the release must
// be refused at the store (the key is another's now), the key stays armed
// by its new owner, and a third caller is told the key is in progress: it
// never runs the effect a second time.
func (s Suite) testSettleNeverFreesTakenOverClaim(t *testing.T) {
	st := s.New(t)
	k := key()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var abandoned atomic.Uint64
	hs := heldRelease{st, cancel, &abandoned, make(chan struct{}), make(chan struct{}), make(chan error, 1), &sync.Once{}}
	gateOpen := false
	defer func() {
		if !gateOpen {
			close(hs.gate)
		}
	}()
	opts := s.opts()
	var runs atomic.Int32
	_, err := idempotency.Do(ctx, hs, k, "fp", func(context.Context, string) ([]byte, error) {
		runs.Add(1)
		return nil, nil
	}, opts)
	if !errors.Is(err, context.Canceled) || runs.Load() != 0 {
		t.Fatalf("Do cancelled during its claim: %v, effect ran %d times; want context.Canceled and no effect", err, runs.Load())
	}
	select {
	case <-hs.releasing:
	case <-time.After(settleWait):
		t.Fatalf("the abandoned claim (fence %d) was not released within %v", abandoned.Load(), settleWait)
	}
	// The release is on its way; the claim's lease runs out meanwhile, and
	// the next caller takes the key over and starts its effect.
	s.leaseOver(t, st, k)
	started, finish := make(chan struct{}), make(chan struct{})
	type outcome struct {
		r   idempotency.Result
		err error
	}
	second := make(chan outcome, 1)
	var secondCut atomic.Bool // the second's effect ended with its context (its lease lost on a loaded machine)
	go func() {
		r, err := idempotency.Do(ctxT(t), st, k, "fp", func(ctx context.Context, _ string) ([]byte, error) {
			runs.Add(1)
			close(started)
			select {
			case <-finish:
			case <-ctx.Done():
				secondCut.Store(true)
			}
			return []byte("second"), nil
		}, opts)
		second <- outcome{r, err}
	}()
	finished := false
	defer func() {
		if !finished {
			close(finish)
			<-second
		}
	}()
	select {
	case <-started:
	case o := <-second:
		t.Fatalf("the caller after the abandoned claim's lease did not run its effect: %+v, %v", o.r, o.err)
	case <-time.After(settleWait):
		t.Fatalf("the caller after the abandoned claim's lease did not start its effect within %v", settleWait)
	}
	gateOpen = true
	close(hs.gate)
	var rerr error
	select {
	case rerr = <-hs.released:
	case <-time.After(settleWait):
		t.Fatalf("the delayed release did not return within %v", settleWait)
	}
	rec := state(t, st, k)
	if rec.State != idempotency.Armed || uint64(rec.Fence) <= abandoned.Load() {
		t.Fatalf("after the abandoned claim's (fence %d) delayed release (%v), the record is %+v; want armed by the caller that took it over",
			abandoned.Load(), rerr, rec)
	}
	if rerr == nil {
		t.Errorf("the abandoned claim's (fence %d) delayed release returned nil after the key was taken over (fence %d)", abandoned.Load(), rec.Fence)
	}
	third, err := idempotency.Do(ctxT(t), st, k, "fp", func(context.Context, string) ([]byte, error) {
		runs.Add(1)
		return []byte("third"), nil
	}, opts)
	switch {
	case errors.Is(err, idempotency.ErrInProgress):
	case err == nil && secondCut.Load() && third.Replayed && string(third.Value) == "second":
		// The second's effect had already ended (its lease lost, its
		// context cut) and its result was recorded: a replay is right.
		t.Logf("the second caller's effect ended with its context before the third call; the third replayed its result")
	default:
		t.Errorf("a third caller while the second's effect runs: %+v, %v, want ErrInProgress", third, err)
	}
	finished = true
	close(finish)
	o := <-second
	if o.err != nil || string(o.r.Value) != "second" {
		t.Errorf("the second caller: %+v, %v; want its own result", o.r, o.err)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("the effect ran %d times for one key", n)
	}
}

// lateClaim is a store whose claim is held on its way to the store (a lost
// packet waiting for its retransmission, a statement queued at the server)
// while the caller's context ends: Begin returns the context's error at once,
// and the claim lands only after the background settle has looked for it
// twice, well within CompleteTimeout. landed is closed once it has.
type lateClaim struct {
	idempotency.Store
	key    string
	cancel context.CancelFunc
	looks  *atomic.Int32
	land   chan struct{}
	landed chan struct{}
	fence  *atomic.Uint64
	err    *atomic.Value
}

func (f lateClaim) Begin(ctx context.Context, key, fp, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	go func() {
		<-f.land
		rec, _, err := f.Store.Begin(context.WithoutCancel(ctx), key, fp, owner, lease)
		if err != nil {
			f.err.Store(err)
		}
		f.fence.Store(uint64(rec.Fence))
		close(f.landed)
	}()
	f.cancel()
	<-ctx.Done()
	return idempotency.Record{}, false, fmt.Errorf("injected: the claim is still on its way: %w", ctx.Err())
}

func (f lateClaim) Get(ctx context.Context, key string) (idempotency.Record, error) {
	rec, err := f.Store.Get(ctx, key)
	if key == f.key && errors.Is(err, fence.ErrNotFound) && f.looks.Add(1) == 2 {
		close(f.land)
	}
	return rec, err
}

// testLateClaimAfterSettleFreesKey: a caller whose context ended while its
// claim was still on its way gets the context's error at once; Do promises
// to release that claim in the background within CompleteTimeout if it
// landed, "so that the key does not stay claimed by nobody for a whole
// lease". A claim that lands after the settle's two looks, well within
// CompleteTimeout, must not keep the next caller out for its whole lease.
func (s Suite) testLateClaimAfterSettle(t *testing.T) {
	st := s.New(t)
	k := key()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lc := lateClaim{st, k, cancel, &atomic.Int32{}, make(chan struct{}), make(chan struct{}), &atomic.Uint64{}, &atomic.Value{}}
	opts := s.opts(func(o *idempotency.Options) {
		o.Lease = claimLongLease
		o.CompleteTimeout = claimFreedWithin // the claim lands long before this
	})
	ran := false
	_, err := idempotency.Do(ctx, lc, k, "fp", func(context.Context, string) ([]byte, error) {
		ran = true
		return nil, nil
	}, opts)
	if !errors.Is(err, context.Canceled) || ran {
		t.Fatalf("Do cancelled while its claim was on its way: %v, effect ran %v; want context.Canceled and no effect", err, ran)
	}
	select {
	case <-lc.landed:
	case <-time.After(settleWait):
		t.Fatalf("the settle did not look for the claim twice within %v (%d looks)", settleWait, lc.looks.Load())
	}
	if e := lc.err.Load(); e != nil {
		t.Fatalf("the late claim: %v", e)
	}
	t.Logf("the claim landed after the settle's looks: %+v", state(t, st, k))
	keyFreed(t, st, k, opts)
}

// armThenCancel wraps a store behind a fault proxy: the arm's reply is lost
// (the arm lands), the caller's context ends as Do reads the record to learn
// the arm's outcome, and the request that releases the never-started key is
// dropped on its way once (the connection is cut; the store never sees it).
type armThenCancel struct {
	idempotency.Store
	px       *faultnet.Proxy
	key      string
	cancel   context.CancelFunc
	armed    *atomic.Bool
	releases *atomic.Int32
	// known is set when the arm's Update returned the armed record although
	// its reply was lost: the store recognised its own arm (by its write id)
	// on a send of its own, so Do knew the arm's outcome.
	known *atomic.Bool
}

func (f armThenCancel) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	arm := false
	switch {
	case k == f.key && from == idempotency.Claimed && ch.State == idempotency.Armed && !f.armed.Swap(true):
		arm = true
		f.px.LoseReply(func(b []byte) bool { return faultnet.Carries(b, k) })
	case k == f.key && ch.State == idempotency.Released && f.releases.Add(1) == 1:
		f.px.DropRequest(func(b []byte) bool { return faultnet.Carries(b, k) })
	}
	rec, err := f.Store.Update(ctx, k, from, ff, ch)
	if arm && err == nil {
		f.known.Store(true)
	}
	return rec, err
}

func (f armThenCancel) Get(ctx context.Context, k string) (idempotency.Record, error) {
	if k == f.key && f.armed.Load() {
		f.cancel()
	}
	return f.Store.Get(ctx, k)
}

// testLostArmReplyThenCancelFreesKey: the arm's reply is lost (it landed),
// and the caller's context ends while Do reads the record to learn whether
// it did. The effect never runs, so Do frees the key; a first release
// attempt that a flaky network drops (a transient error, as any other step
// retries) must not leave the key armed, to become unknown for the next
// caller although its effect provably never ran.
func (s Suite) testLostArmReplyThenCancel(t *testing.T) {
	fs, px, st := s.faulty(t)
	k := key()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f := armThenCancel{fs, px, k, cancel, &atomic.Bool{}, &atomic.Int32{}, &atomic.Bool{}}
	opts := s.opts()
	ran := false
	_, err := idempotency.Do(ctx, f, k, "fp", func(context.Context, string) ([]byte, error) {
		ran = true
		return nil, nil
	}, opts)
	if f.known.Load() {
		// The store's own resend recognised the arm: Do knew it was armed,
		// never read the record, and the caller's context did not end.
		if !ran || err != nil {
			t.Errorf("the store reported its arm as landed, but Do = %v (effect ran: %v), want the effect's result", err, ran)
		}
		t.Logf("the store recognised its own arm after the lost reply: nothing to settle")
		return
	}
	if ran {
		t.Fatalf("the effect ran although the caller's context ended before the arm's outcome was known (%v)", err)
	}
	if !errors.Is(err, context.Canceled) {
		t.Errorf("Do: %v, want context.Canceled", err)
	}
	if px.Pending() != 0 {
		t.Fatalf("the faults did not all fire (%d pending; %d releases sent)", px.Pending(), f.releases.Load())
	}
	rec, gerr := st.Get(ctxT(t), k)
	if gerr == nil && (rec.State == idempotency.Claimed || rec.State == idempotency.Armed) {
		s.leaseOver(t, st, k)
	}
	var c counter
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("next"), opts)
	if err != nil || string(r.Value) != "next" || c.runs.Load() != 1 {
		t.Fatalf("the next caller, whose effect never ran before (the record was %+v, %v): %+v, %v; want its own result", rec, gerr, r, err)
	}
}

// unreachable is a store whose claim is still on its way when the caller's
// context ends, after which the store stops answering: every Get of the key
// hangs until its context ends (or the case is over). It records the claim's
// send, the Gets whose context could outlive bound after it, and the Gets made
// with a context that had already ended; returned is closed when the first
// Get returns.
type unreachable struct {
	idempotency.Store
	key      string
	cancel   context.CancelFunc
	bound    time.Duration
	sent     *atomic.Int64 // the claim's send, in Unix nanoseconds
	gets     *atomic.Int32
	unbound  *atomic.Int32
	afterEnd *atomic.Int32
	returned chan struct{}
	once     *sync.Once
	over     chan struct{} // closed when the case is over
}

func (f unreachable) Begin(ctx context.Context, key, fp, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	if key != f.key {
		return f.Store.Begin(ctx, key, fp, owner, lease)
	}
	f.sent.CompareAndSwap(0, time.Now().UnixNano())
	f.cancel()
	<-ctx.Done()
	return idempotency.Record{}, false, fmt.Errorf("injected: the claim is still on its way: %w", ctx.Err())
}

func (f unreachable) Get(ctx context.Context, key string) (idempotency.Record, error) {
	if key != f.key {
		return f.Store.Get(ctx, key)
	}
	f.gets.Add(1)
	if ctx.Err() != nil {
		f.afterEnd.Add(1)
	}
	if d, ok := ctx.Deadline(); !ok || d.After(time.Unix(0, f.sent.Load()).Add(f.bound)) {
		f.unbound.Add(1)
	}
	select {
	case <-ctx.Done():
	case <-f.over:
	}
	f.once.Do(func() { close(f.returned) })
	return idempotency.Record{}, fmt.Errorf("injected: the store does not answer: %w", context.DeadlineExceeded)
}

// testSettleEndsWhenStoreUnreachable: a caller whose context ended while its
// claim was on its way leaves a background settle that looks for the claim.
// When the store stops answering, every read of that settle is bounded by
// CompleteTimeout counted from the claim's send, and the settle then ends:
// it neither hangs on a read nor goes on retrying.
func (s Suite) testSettleEndsWhenStoreUnreachable(t *testing.T) {
	st := s.New(t)
	k := key()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const completeTimeout = 200 * time.Millisecond
	f := unreachable{st, k, cancel, completeTimeout, &atomic.Int64{}, &atomic.Int32{}, &atomic.Int32{}, &atomic.Int32{},
		make(chan struct{}), &sync.Once{}, make(chan struct{})}
	defer close(f.over)
	opts := s.opts(func(o *idempotency.Options) { o.CompleteTimeout = completeTimeout })
	_, err := idempotency.Do(ctx, f, k, "fp", func(context.Context, string) ([]byte, error) { return nil, nil }, opts)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Do cancelled while its claim was on its way: %v, want context.Canceled", err)
	}
	select {
	case <-f.returned:
	case <-time.After(settleWait):
		t.Fatalf("the settle's read (%d reads, %d without a deadline by CompleteTimeout after the claim's send) did not end within %v",
			f.gets.Load(), f.unbound.Load(), settleWait)
	}
	if n := f.unbound.Load(); n > 0 {
		t.Errorf("%d reads of the settle could outlive CompleteTimeout (%v) after the claim's send", n, completeTimeout)
	}
	// The first read ended at the settle's deadline; a settle that ends
	// reads no more (bar one read whose context ended as it was made).
	// Reads going on after that are a settle that never ends.
	ended := f.gets.Load()
	quiet := time.NewTimer(time.Second)
	defer quiet.Stop()
	<-quiet.C
	if n := f.gets.Load() - ended; n > 1 || f.afterEnd.Load() > 2 {
		t.Errorf("the settle read the record %d more times in the second after its deadline (%d reads with its context already ended): it does not end",
			n, f.afterEnd.Load())
	}
}
