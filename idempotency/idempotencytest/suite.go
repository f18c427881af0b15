// Package idempotencytest is the contract suite every idempotency.Store runs
// against a real backend, including a matrix of owner crashes at each step and,
// for a store reached over a network (Suite.Faulty), the loss of each step's
// reply after the store acted. The suite's own tests run it on an in-memory
// store and on one-bug copies of it, each of which a named case must fail.
package idempotencytest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
)

// Suite is the contract suite for an idempotency.Store.
type Suite struct {
	// New returns a store on a live backend; tests use fresh random keys.
	New func(t *testing.T) idempotency.Store
	// Lease is the short lease of the crash tests. Default: 300ms.
	Lease time.Duration
	// SelfExpiring says the store removes records past their retention by
	// itself (Redis key expiry), so Purge may find nothing to remove. Such a
	// store must also remove released records within a few seconds (a short
	// retention for them), for the tests that need a record gone.
	SelfExpiring bool
	// BadKeys are keys the store cannot hold, beside the empty key, which it
	// must refuse with ErrInvalid before any request.
	BadKeys []string
	// Faulty returns a store on the same backend as New, reached through a
	// faultnet.Proxy that the lost-reply cases use to lose the reply to one
	// step. Nil (a store with no network between it and its data): those
	// cases skip. They also skip when the environment variable named by
	// LostReplyEnv is "0".
	Faulty func(t *testing.T) (idempotency.Store, *faultnet.Proxy)
}

// Run runs every test of the suite as a subtest of t.
func (s Suite) Run(t *testing.T) {
	if s.Lease <= 0 {
		s.Lease = 300 * time.Millisecond
	}
	for _, tc := range []struct {
		name string
		fn   func(*testing.T)
	}{
		{"RunsOnceThenReplays", s.testRunsOnce},
		{"FingerprintMismatch", s.testFingerprint},
		{"InProgress", s.testInProgress},
		{"WaitForOtherOwner", s.testWait},
		{"ConcurrentCallersOneEffect", s.testConcurrent},
		{"NotSentReleases", s.testNotSent},
		{"DefinitiveFailureReplays", s.testDefinitive},
		{"AmbiguousStaysArmedThenUnknown", s.testAmbiguous},
		{"CrashAfterClaim", s.testCrashAfterClaim},
		{"CrashAfterArmWithoutReconcile", s.testCrashAfterArm},
		{"CrashDuringEffectReconcileNotDone", s.testCrashReconcileNotDone},
		{"CrashAfterEffectReconcileDone", s.testCrashReconcileDone},
		{"CrashDuringCompletion", s.testCrashDuringCompletion},
		{"StaleOwnerCannotComplete", s.testStaleOwner},
		{"ResultSizeLimit", s.testResultSize},
		{"PurgeAfterRetention", s.testPurge},
		{"UpdateErrors", s.testUpdateErrors},
		{"FenceSurvivesPurgeOfReleased", func(t *testing.T) { s.testFenceSurvivesRemoval(t, false) }},
		{"FenceSurvivesPurgeOfCompleted", func(t *testing.T) { s.testFenceSurvivesRemoval(t, true) }},
		{"EffectKeyPerClaim", s.testEffectKeyPerClaim},
		{"RenewalFailureCancelsEffect", s.testRenewalFailure},
		{"BadInput", s.testBadInput},
		{"StaleOwnerCannotTouchTakenOverArmed", s.testStaleOwnerOnArmedTakeover},
		{"PurgeKeepsLiveRecords", s.testPurgeKeeps},
		{"RenewalKeepsKeyPastLease", s.testRenewalKeepsKey},
		{"LateArmReplyRenewsInTime", s.testLateArmReplyRenewsInTime},
		{"PanicStopsRenewals", s.testPanicStopsRenewals},
		{"TakeoverKeepsFingerprint", s.testTakeoverFingerprint},
		{"GetMatchesWholeKey", s.testWholeKey},
		{"BeginAfterRetentionWithoutPurge", s.testBeginAfterRetention},
		{"TakeoverRestartsInProgress", s.testTakeoverRestarts},
		{"ResultNotAliased", s.testNotAliased},
		{"LostReplyBegin", s.testLostReplyBegin},
		{"LostReplyArm", func(t *testing.T) { s.testLostReplyStep(t, stepArm) }},
		{"LostReplyRenew", func(t *testing.T) { s.testLostReplyStep(t, stepRenew) }},
		{"LostReplyComplete", func(t *testing.T) { s.testLostReplyStep(t, stepComplete) }},
		{"LostReplyRelease", func(t *testing.T) { s.testLostReplyStep(t, stepRelease) }},
		{"LostRepliesDoAtMostOnce", s.testLostRepliesDo},
		{"CompletionHeldPastCompleteTimeout", s.testCompletionHeldPastTimeout},
		{"CancelledDuringClaimFreesKey", func(t *testing.T) { s.testCancelledDuringClaim(t, false) }},
		{"CancelledDuringTakeoverFreesKey", func(t *testing.T) { s.testCancelledDuringClaim(t, true) }},
		{"SlowNetworkCancelledClaimFreesKey", s.testSlowNetworkCancelledClaim},
		{"SettleNeverFreesTakenOverClaim", s.testSettleNeverFreesTakenOverClaim},
		{"LateClaimAfterSettleFreesKey", s.testLateClaimAfterSettle},
		{"SettleEndsWhenStoreUnreachable", s.testSettleEndsWhenStoreUnreachable},
		{"LostArmReplyThenCancelFreesKey", s.testLostArmReplyThenCancel},
	} {
		t.Run(tc.name, tc.fn)
	}
}

func key() string { return fencetest.Name("idem") }

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// counter is an effect that counts its runs and returns a fixed result.
type counter struct {
	runs atomic.Int32
	keys sync.Map // effect keys seen
}

func (c *counter) effect(result string) idempotency.Effect {
	return func(ctx context.Context, effectKey string) ([]byte, error) {
		c.runs.Add(1)
		c.keys.Store(effectKey, true)
		return []byte(result), nil
	}
}

func (s Suite) opts(extra ...func(*idempotency.Options)) *idempotency.Options {
	o := &idempotency.Options{Lease: s.Lease, Retention: time.Hour}
	for _, f := range extra {
		f(o)
	}
	return o
}

func state(t *testing.T, st idempotency.Store, k string) idempotency.Record {
	t.Helper()
	rec, err := st.Get(ctxT(t), k)
	if err != nil {
		t.Fatalf("Get(%q): %v", k, err)
	}
	return rec
}

func (s Suite) testRunsOnce(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("charged"), s.opts())
	if err != nil || string(r.Value) != "charged" || r.Replayed {
		t.Fatalf("first Do: %+v, %v", r, err)
	}
	if _, ok := c.keys.Load(r.EffectKey); !ok || r.EffectKey != idempotency.EffectKey(state(t, st, k)) {
		t.Errorf("the effect was not given the EffectKey of its record (fence %d)", r.Fence)
	}
	for i := 0; i < 3; i++ {
		r2, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("again"), s.opts())
		if err != nil || string(r2.Value) != "charged" || !r2.Replayed || r2.Fence != r.Fence {
			t.Fatalf("replay %d: %+v, %v", i, r2, err)
		}
	}
	if n := c.runs.Load(); n != 1 {
		t.Errorf("effect ran %d times, want 1", n)
	}
	if rec := state(t, st, k); rec.State != idempotency.Completed {
		t.Errorf("state %s, want completed", rec.State)
	}
}

func (s Suite) testFingerprint(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	if _, err := idempotency.Do(ctxT(t), st, k, "amount=10", c.effect("ok"), s.opts()); err != nil {
		t.Fatal(err)
	}
	_, err := idempotency.Do(ctxT(t), st, k, "amount=99", c.effect("ok"), s.opts())
	if !errors.Is(err, idempotency.ErrFingerprintMismatch) {
		t.Fatalf("same key, other request: %v, want ErrFingerprintMismatch", err)
	}
	if c.runs.Load() != 1 {
		t.Errorf("effect ran %d times", c.runs.Load())
	}
}

func (s Suite) testInProgress(t *testing.T) {
	st := s.New(t)
	k := key()
	if _, _, err := st.Begin(ctxT(t), k, "fp", "other", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	c := &counter{}
	_, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("x"), s.opts())
	var ip *idempotency.InProgressError
	if !errors.As(err, &ip) || ip.LeaseLeft <= 0 || ip.LeaseLeft > 10*time.Second || ip.Owner != "other" {
		t.Fatalf("Do on a key held elsewhere: %v, want InProgressError with the lease left", err)
	}
	if c.runs.Load() != 0 {
		t.Error("the effect ran while another owner held the key")
	}
}

func (s Suite) testWait(t *testing.T) {
	st := s.New(t)
	k := key()
	release := make(chan struct{})
	started := make(chan struct{})
	go func() {
		_, _ = idempotency.Do(context.Background(), st, k, "fp", func(context.Context, string) ([]byte, error) {
			close(started)
			<-release
			return []byte("first"), nil
		}, s.opts(func(o *idempotency.Options) { o.Lease = 10 * time.Second }))
	}()
	<-started
	// The first owner finishes once the waiting caller has found the key in
	// progress, so the case shows a wait, not a replay that came too late.
	seen := &seesInProgress{Store: st, k: k, ch: make(chan struct{})}
	go func() {
		select {
		case <-seen.ch:
		case <-time.After(20 * time.Second):
		}
		close(release)
	}()
	c := &counter{}
	r, err := idempotency.Do(ctxT(t), seen, k, "fp", c.effect("second"), s.opts(func(o *idempotency.Options) { o.Wait = true }))
	select {
	case <-seen.ch:
	default:
		t.Error("the waiting caller never found the key in progress")
	}
	if err != nil || string(r.Value) != "first" || !r.Replayed {
		t.Fatalf("waiting Do: %+v, %v; want the first owner's result replayed", r, err)
	}
	if c.runs.Load() != 0 {
		t.Error("the waiting caller ran the effect too")
	}
}

// seesInProgress closes ch the first time Begin finds k held by another owner.
type seesInProgress struct {
	idempotency.Store
	k    string
	ch   chan struct{}
	once sync.Once
}

func (w *seesInProgress) Begin(ctx context.Context, k, fp, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	rec, created, err := w.Store.Begin(ctx, k, fp, owner, lease)
	if err == nil && !created && k == w.k && (rec.State == idempotency.Claimed || rec.State == idempotency.Armed) && rec.LeaseLeft > 0 {
		w.once.Do(func() { close(w.ch) })
	}
	return rec, created, err
}

// Subscribe passes the store's notifications through, so a waiting Do is woken
// as it would be without the wrapper.
func (w *seesInProgress) Subscribe(k string) (<-chan struct{}, func()) {
	if n, ok := w.Store.(idempotency.Notifier); ok {
		return n.Subscribe(k)
	}
	return nil, func() {} // a nil channel never receives: Do polls
}

func (s Suite) testConcurrent(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	var wg sync.WaitGroup
	results := make(chan string, 10)
	for i := 0; i < 10; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := idempotency.Do(ctxT(t), st, k, "fp", func(ctx context.Context, ek string) ([]byte, error) {
				time.Sleep(20 * time.Millisecond)
				return c.effect("once")(ctx, ek)
			}, s.opts(func(o *idempotency.Options) { o.Wait = true; o.Lease = 10 * time.Second }))
			if err != nil {
				t.Error(err)
				return
			}
			results <- string(r.Value)
		}()
	}
	wg.Wait()
	close(results)
	for r := range results {
		if r != "once" {
			t.Errorf("a caller got %q", r)
		}
	}
	if n := c.runs.Load(); n != 1 {
		t.Errorf("10 concurrent callers ran the effect %d times, want 1", n)
	}
}

func (s Suite) testNotSent(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	refused := errors.New("provider refused before charging")
	r1, err := idempotency.Do(ctxT(t), st, k, "fp", func(context.Context, string) ([]byte, error) {
		return nil, idempotency.NotSent(refused)
	}, s.opts())
	if !errors.Is(err, refused) {
		t.Fatalf("not-sent effect: %v", err)
	}
	if rec := state(t, st, k); rec.State != idempotency.Released {
		t.Fatalf("state after a not-sent effect: %s, want released", rec.State)
	}
	r2, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("charged"), s.opts())
	if err != nil || string(r2.Value) != "charged" || r2.Replayed {
		t.Fatalf("after release: %+v, %v", r2, err)
	}
	if r2.Fence <= r1.Fence {
		t.Errorf("fence after the re-claim %d not above %d", r2.Fence, r1.Fence)
	}
}

func (s Suite) testDefinitive(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	_, err := idempotency.Do(ctxT(t), st, k, "fp", func(context.Context, string) ([]byte, error) {
		return nil, idempotency.Definitive(errors.New("card declined"))
	}, s.opts())
	var fe *idempotency.FailedError
	if !errors.As(err, &fe) || fe.Message != "card declined" {
		t.Fatalf("definitive failure: %v", err)
	}
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("x"), s.opts())
	if !errors.As(err, &fe) || fe.Message != "card declined" || !r.Replayed {
		t.Fatalf("replayed failure: %+v, %v", r, err)
	}
	if c.runs.Load() != 0 {
		t.Error("a definitive failure was retried")
	}
}

func (s Suite) testAmbiguous(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	timeout := errors.New("read timeout after sending the charge")
	// The ambiguous owner's lease must outlast its Do's return, one Get and
	// one more Do (three round trips, and the scheduler of a loaded machine):
	// at least 1s. The lease runs on the store from after sent.
	lease := max(s.Lease, time.Second)
	long := func(o *idempotency.Options) { o.Lease = lease }
	sent := time.Now()
	_, err := idempotency.Do(ctxT(t), st, k, "fp", func(context.Context, string) ([]byte, error) { return nil, timeout }, s.opts(long))
	if !errors.Is(err, timeout) {
		t.Fatalf("ambiguous effect: %v", err)
	}
	rec := state(t, st, k)
	if rec.State != idempotency.Armed {
		t.Fatalf("state after an ambiguous error: %s, want armed (never deleted)", rec.State)
	}
	_, err = idempotency.Do(ctxT(t), st, k, "fp", c.effect("x"), s.opts(long))
	if !errors.Is(err, idempotency.ErrInProgress) {
		if time.Since(sent) >= lease {
			t.Fatalf("the ambiguous owner's %v lease may have run out before the second Do returned (%v after the first was sent): nothing shown; %v", lease, time.Since(sent), err)
		}
		t.Errorf("while the ambiguous owner's lease runs: %v, want ErrInProgress", err)
	}
	s.leaseOver(t, st, k)
	if _, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("x"), s.opts()); !errors.Is(err, idempotency.ErrUnknown) {
		t.Fatalf("after the lease, without Reconcile: %v, want ErrUnknown", err)
	}
	rec = state(t, st, k)
	if rec.State != idempotency.Unknown || c.runs.Load() != 0 {
		t.Fatalf("state %s, runs %d: want unknown and no blind retry", rec.State, c.runs.Load())
	}
	if _, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("x"), s.opts()); !errors.Is(err, idempotency.ErrUnknown) {
		t.Errorf("an unknown key again: %v", err)
	}
	// The operator checked with the provider: it happened.
	if err := idempotency.Resolve(ctxT(t), st, k, rec.Fence, idempotency.Completed, []byte("charged (resolved)"), time.Hour); err != nil {
		t.Fatal(err)
	}
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("x"), s.opts())
	if err != nil || string(r.Value) != "charged (resolved)" || !r.Replayed {
		t.Errorf("after Resolve: %+v, %v", r, err)
	}
}

// crashedOwner leaves key as an owner that stopped at a step would: claimed, or armed.
func (s Suite) crashedOwner(t *testing.T, st idempotency.Store, k string, arm bool) idempotency.Record {
	t.Helper()
	rec, created, err := st.Begin(ctxT(t), k, "fp", "crashed", s.Lease)
	if err != nil || !created {
		t.Fatalf("Begin: %v, created %v", err, created)
	}
	if arm {
		if rec, err = st.Update(ctxT(t), k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "crashed", Lease: s.Lease}); err != nil {
			t.Fatal(err)
		}
	}
	s.leaseOver(t, st, k)
	return rec
}

// leaseOver waits until k's lease has run out on the store's clock, as the
// store reports it, so a case never depends on a sleep being long enough.
func (s Suite) leaseOver(t *testing.T, st idempotency.Store, k string) {
	t.Helper()
	time.Sleep(s.Lease)
	deadline := time.Now().Add(s.Lease + 10*time.Second)
	for {
		rec, err := st.Get(ctxT(t), k)
		if err != nil {
			t.Fatalf("Get(%q) while waiting for its lease to run out: %v", k, err)
		}
		if rec.LeaseLeft <= 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the lease of %q (%v) still has %v left after %v", k, s.Lease, rec.LeaseLeft, s.Lease+10*time.Second)
		}
		time.Sleep(s.Lease / 10)
	}
}

func (s Suite) testCrashAfterClaim(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	old := s.crashedOwner(t, st, k, false)
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("taken over"), s.opts())
	if err != nil || string(r.Value) != "taken over" || r.Replayed {
		t.Fatalf("takeover of a claim: %+v, %v", r, err)
	}
	if r.Fence <= old.Fence || c.runs.Load() != 1 {
		t.Errorf("takeover fence %d (old %d), runs %d", r.Fence, old.Fence, c.runs.Load())
	}
	if _, ok := c.keys.Load(idempotency.EffectKey(old)); ok {
		t.Error("the takeover reused the crashed attempt's effect key")
	}
}

func (s Suite) testCrashAfterArm(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	s.crashedOwner(t, st, k, true)
	if _, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("x"), s.opts()); !errors.Is(err, idempotency.ErrUnknown) {
		t.Fatalf("armed and abandoned, no Reconcile: %v, want ErrUnknown", err)
	}
	if rec := state(t, st, k); rec.State != idempotency.Unknown || c.runs.Load() != 0 {
		t.Errorf("state %s, runs %d", rec.State, c.runs.Load())
	}
}

func (s Suite) testCrashReconcileNotDone(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	old := s.crashedOwner(t, st, k, true)
	var asked string
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("second attempt"), s.opts(func(o *idempotency.Options) {
		o.Reconcile = func(_ context.Context, ek string) (bool, []byte, error) { asked = ek; return false, nil, nil }
	}))
	if err != nil || string(r.Value) != "second attempt" {
		t.Fatalf("reconcile not done: %+v, %v", r, err)
	}
	if asked != idempotency.EffectKey(old) {
		t.Errorf("Reconcile asked about %q, want the crashed attempt's effect key", asked)
	}
	if _, ok := c.keys.Load(idempotency.EffectKey(old)); ok || r.Fence <= old.Fence {
		t.Errorf("the new attempt must use a new effect key and a larger fence (got fence %d after %d)", r.Fence, old.Fence)
	}
}

func (s Suite) testCrashReconcileDone(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	s.crashedOwner(t, st, k, true)
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("x"), s.opts(func(o *idempotency.Options) {
		o.Reconcile = func(context.Context, string) (bool, []byte, error) { return true, []byte("found at the provider"), nil }
	}))
	if err != nil || string(r.Value) != "found at the provider" || !r.Replayed {
		t.Fatalf("reconcile done: %+v, %v", r, err)
	}
	if c.runs.Load() != 0 {
		t.Error("the effect ran although Reconcile found it done")
	}
	if rec := state(t, st, k); rec.State != idempotency.Completed {
		t.Errorf("state %s, want completed", rec.State)
	}
}

// failCompletion is a store whose completions fail, as a crash during the
// completion write would leave it.
type failCompletion struct{ idempotency.Store }

func (f failCompletion) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if ch.State == idempotency.Completed {
		return idempotency.Record{}, errors.New("injected: connection lost during completion")
	}
	return f.Store.Update(ctx, k, from, ff, ch)
}

func (s Suite) testCrashDuringCompletion(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	r, err := idempotency.Do(ctxT(t), failCompletion{st}, k, "fp", c.effect("charged"), s.opts(func(o *idempotency.Options) {
		o.CompleteTimeout = 200 * time.Millisecond
	}))
	if !errors.Is(err, idempotency.ErrNotRecorded) || string(r.Value) != "charged" {
		t.Fatalf("completion that cannot be recorded: %+v, %v; want the value and ErrNotRecorded", r, err)
	}
	if rec := state(t, st, k); rec.State != idempotency.Armed {
		t.Fatalf("state %s, want armed (never deleted)", rec.State)
	}
	s.leaseOver(t, st, k)
	r2, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("again"), s.opts(func(o *idempotency.Options) {
		o.Reconcile = func(context.Context, string) (bool, []byte, error) { return true, []byte("charged"), nil }
	}))
	if err != nil || string(r2.Value) != "charged" || c.runs.Load() != 1 {
		t.Fatalf("after reconcile: %+v, %v, runs %d", r2, err, c.runs.Load())
	}
}

func (s Suite) testStaleOwner(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	old := s.crashedOwner(t, st, k, true)
	if _, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("new owner"), s.opts(func(o *idempotency.Options) {
		o.Reconcile = func(context.Context, string) (bool, []byte, error) { return false, nil, nil }
	})); err != nil {
		t.Fatal(err)
	}
	// The old owner wakes up and tries to record its completion.
	_, err := st.Update(ctxT(t), k, idempotency.Armed, old.Fence, idempotency.Change{State: idempotency.Completed, Fence: old.Fence, Result: []byte("stale")})
	var se *fence.StaleError
	if !errors.As(err, &se) || se.Current <= old.Fence {
		t.Fatalf("stale owner's completion: %v, want StaleError", err)
	}
	if rec := state(t, st, k); string(rec.Result) != "new owner" {
		t.Errorf("stored result %q", rec.Result)
	}
}

func (s Suite) testResultSize(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	big := fmt.Sprintf("%040d", 7)
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect(big), s.opts(func(o *idempotency.Options) { o.MaxResultSize = 16 }))
	if err != nil || string(r.Value) != big {
		t.Fatalf("first call with an oversized result: %+v, %v", r, err)
	}
	_, err = idempotency.Do(ctxT(t), st, k, "fp", c.effect(big), s.opts(func(o *idempotency.Options) { o.MaxResultSize = 16 }))
	if !errors.Is(err, idempotency.ErrResultNotStored) || c.runs.Load() != 1 {
		t.Fatalf("replay of an oversized result: %v (runs %d), want ErrResultNotStored and no rerun", err, c.runs.Load())
	}
}

func (s Suite) testPurge(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	if _, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("v"), s.opts(func(o *idempotency.Options) { o.Retention = 100 * time.Millisecond })); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if n := s.removed(t, st, k); n < 1 && !s.SelfExpiring {
		t.Fatalf("the record is gone, but Purge reported %d records removed", n)
	}
	if _, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("v2"), s.opts()); err != nil || c.runs.Load() != 2 {
		t.Errorf("a purged key runs anew: %v, runs %d", err, c.runs.Load())
	}
}

func (s Suite) testUpdateErrors(t *testing.T) {
	st := s.New(t)
	k := key()
	if _, err := st.Update(ctxT(t), k, idempotency.Claimed, 1, idempotency.Change{State: idempotency.Armed, Fence: 1}); !errors.Is(err, fence.ErrNotFound) {
		t.Errorf("Update of a missing key: %v", err)
	}
	rec, _, err := st.Begin(ctxT(t), k, "fp", "me", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Update(ctxT(t), k, idempotency.Armed, rec.Fence, idempotency.Change{State: idempotency.Completed, Fence: rec.Fence}); !errors.Is(err, idempotency.ErrStateChanged) {
		t.Errorf("Update from the wrong state: %v", err)
	}
	if _, _, err := st.Begin(ctxT(t), "", "fp", "me", time.Minute); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Begin with an empty key: %v", err)
	}
	if _, err := idempotency.Do(ctxT(t), st, k, "fp", nil, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Do with a nil effect: %v", err)
	}
}

// removed waits until k's record is gone: Purge removes it, or a self-expiring
// store expires it. It returns how many records its Purge calls removed.
func (s Suite) removed(t *testing.T, st idempotency.Store, k string) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	purged := 0
	for {
		n, err := st.Purge(ctxT(t))
		if err != nil {
			t.Fatalf("Purge: %v", err)
		}
		purged += n
		_, err = st.Get(ctxT(t), k)
		if errors.Is(err, fence.ErrNotFound) {
			return purged
		}
		if err != nil {
			t.Fatalf("Get: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the record of %q was not removed within 10s", k)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// testFenceSurvivesRemoval: A arms and stalls; B takes over and releases (or
// completes with a short retention); the record is removed; C claims the key
// anew. C's fence must be above every fence the key had, so A, waking up,
// cannot complete C's record, and C's effect key differs from A's.
func (s Suite) testFenceSurvivesRemoval(t *testing.T, completed bool) {
	st := s.New(t)
	k := key()
	a := s.crashedOwner(t, st, k, true) // armed, then stalled past its lease
	var b idempotency.Result
	var err error
	b, err = idempotency.Do(ctxT(t), st, k, "fp", func(context.Context, string) ([]byte, error) {
		if completed {
			return []byte("B"), nil
		}
		return nil, idempotency.NotSent(errors.New("refused before sending"))
	}, s.opts(func(o *idempotency.Options) {
		o.Retention = 100 * time.Millisecond
		o.Reconcile = func(context.Context, string) (bool, []byte, error) { return false, nil, nil }
	}))
	if completed && err != nil {
		t.Fatalf("B: %v", err)
	}
	if b.Fence <= a.Fence {
		t.Fatalf("B's takeover fence %d not above A's %d", b.Fence, a.Fence)
	}
	time.Sleep(150 * time.Millisecond)
	s.removed(t, st, k)

	c, created, err := st.Begin(ctxT(t), k, "another request", "C", time.Minute)
	if err != nil || !created {
		t.Fatalf("C's claim after removal: created %v, %v", created, err)
	}
	if c.Fence <= b.Fence {
		t.Fatalf("after removal the key restarted at fence %d, not above B's %d (A had %d)", c.Fence, b.Fence, a.Fence)
	}
	if idempotency.EffectKey(c) == idempotency.EffectKey(a) {
		t.Error("C's effect key equals A's")
	}
	// A wakes up and records its completion with its own fence.
	_, err = st.Update(ctxT(t), k, idempotency.Armed, a.Fence, idempotency.Change{State: idempotency.Completed, Fence: a.Fence, Result: []byte("A, late")})
	if !errors.Is(err, fence.ErrStale) && !errors.Is(err, idempotency.ErrStateChanged) {
		t.Fatalf("A's late completion on C's record: %v, want ErrStale", err)
	}
	if rec := state(t, st, k); rec.State != idempotency.Claimed || rec.Fingerprint != "another request" || rec.Fence != c.Fence || rec.Result != nil {
		t.Errorf("C's record after A's late completion: %+v", rec)
	}
}

// testEffectKeyPerClaim: two claims by callers with the same Owner never share
// an effect key, and the recorded owner carries a per-claim nonce.
func (s Suite) testEffectKeyPerClaim(t *testing.T) {
	st := s.New(t)
	k := key()
	seen := map[string]bool{}
	owners := map[string]bool{}
	for i := 0; i < 3; i++ {
		r, err := idempotency.Do(ctxT(t), st, k, "fp", func(_ context.Context, ek string) ([]byte, error) {
			seen[ek] = true
			return nil, idempotency.NotSent(errors.New("not sent"))
		}, s.opts(func(o *idempotency.Options) { o.Owner = "worker-1" }))
		if err == nil || r.EffectKey == "" {
			t.Fatalf("attempt %d: %+v, %v", i, r, err)
		}
		rec := state(t, st, k)
		if !strings.HasPrefix(rec.Owner, "worker-1#") || owners[rec.Owner] {
			t.Errorf("attempt %d recorded owner %q: want worker-1#nonce, new each claim", i, rec.Owner)
		}
		owners[rec.Owner] = true
	}
	if len(seen) != 3 {
		t.Errorf("3 claims used %d distinct effect keys", len(seen))
	}
}

// slowRenewals is a store whose lease renewals (armed -> armed) hang until
// their context ends, as they would with the store cut off.
type slowRenewals struct{ idempotency.Store }

func (f slowRenewals) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if from == idempotency.Armed && ch.State == idempotency.Armed {
		<-ctx.Done()
		return idempotency.Record{}, fmt.Errorf("injected: renewal timed out: %w", ctx.Err())
	}
	return f.Store.Update(ctx, k, from, ff, ch)
}

// takeoverSeen is a store that calls seen once it has accepted a takeover
// (an Update with Restart that returned no error): the moment the store let
// another owner in.
type takeoverSeen struct {
	idempotency.Store
	seen func()
}

func (f takeoverSeen) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	rec, err := f.Store.Update(ctx, k, from, ff, ch)
	if err == nil && ch.Restart {
		f.seen()
	}
	return rec, err
}

// testRenewalFailure: an owner whose renewals cannot reach the store has its
// effect cancelled with ErrLost before its lease runs out on the store, so a
// caller that takes the key over never runs the effect at the same time. The
// check is on events, not durations: when the store accepts B's takeover,
// A's context is already done.
func (s Suite) testRenewalFailure(t *testing.T) {
	st := s.New(t)
	k := key()
	var aCause error
	var aCtx atomic.Pointer[context.Context]
	var takeovers atomic.Int64
	var aLiveAtTakeover, aLiveAtB, bRan atomic.Bool
	aDone, aRuns := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(aDone)
		_, _ = idempotency.Do(ctxT(t), slowRenewals{st}, k, "fp", func(ctx context.Context, _ string) ([]byte, error) {
			aCtx.Store(&ctx)
			close(aRuns)
			select {
			case <-ctx.Done():
				aCause = context.Cause(ctx)
				return nil, ctx.Err()
			case <-time.After(10 * s.Lease):
				return []byte("A ran on"), nil
			}
		}, s.opts())
	}()
	select {
	case <-aRuns:
	case <-aDone:
		t.Fatal("A's Do ended before its effect ran")
	}
	aLive := func() bool { return (*aCtx.Load()).Err() == nil }
	// B keeps trying to take the key over, and runs the effect once it can.
	b := takeoverSeen{st, func() {
		if takeovers.Add(1) == 1 {
			aLiveAtTakeover.Store(aLive())
		}
	}}
	deadline := time.Now().Add(10 * s.Lease)
	for time.Now().Before(deadline) {
		_, err := idempotency.Do(ctxT(t), b, k, "fp", func(context.Context, string) ([]byte, error) {
			bRan.Store(true)
			aLiveAtB.Store(aLive())
			return []byte("B"), nil
		}, s.opts(func(o *idempotency.Options) {
			o.Reconcile = func(context.Context, string) (bool, []byte, error) { return false, nil, nil }
		}))
		if err == nil {
			break
		}
		if !errors.Is(err, idempotency.ErrInProgress) {
			t.Fatalf("B: %v", err)
		}
		time.Sleep(s.Lease / 20) // polling the store, not synchronisation
	}
	<-aDone
	if !errors.Is(aCause, fence.ErrLost) || !strings.Contains(aCause.Error(), "local deadline") {
		t.Fatalf("A's effect ended with cause %v, want fence.ErrLost from the local deadline", aCause)
	}
	if takeovers.Load() == 0 || !bRan.Load() {
		t.Fatalf("B never took the key over (%d takeovers accepted, effect ran: %v)", takeovers.Load(), bRan.Load())
	}
	// The guarantee itself: the store let B in only after A's context ended.
	if aLiveAtTakeover.Load() {
		t.Error("the store accepted B's takeover while A's context was still live")
	}
	if aLiveAtB.Load() {
		t.Error("B's effect started while A's context was still live: two effects ran at once")
	}
}

// testBadInput: nil contexts, a nil store, negative options and keys the store
// cannot hold are refused with ErrInvalid, and nothing is recorded.
func (s Suite) testBadInput(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	var nilCtx context.Context
	invalid := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", what, err)
		}
	}
	_, err := idempotency.Do(nilCtx, st, k, "fp", c.effect("x"), s.opts())
	invalid("Do with a nil context", err)
	_, err = idempotency.Do(ctxT(t), nil, k, "fp", c.effect("x"), s.opts())
	invalid("Do with a nil store", err)
	for _, o := range []func(*idempotency.Options){
		func(o *idempotency.Options) { o.Lease = -time.Second },
		func(o *idempotency.Options) { o.Retention = -time.Second },
		func(o *idempotency.Options) { o.MaxResultSize = -1 },
		func(o *idempotency.Options) { o.InProgressCeiling = -time.Second },
		func(o *idempotency.Options) { o.CompleteTimeout = -time.Second },
	} {
		_, err = idempotency.Do(ctxT(t), st, k, "fp", c.effect("x"), s.opts(o))
		invalid(fmt.Sprintf("Do with a negative option %+v", *s.opts(o)), err)
	}
	_, _, err = st.Begin(nilCtx, k, "fp", "me", time.Minute)
	invalid("Begin with a nil context", err)
	_, err = st.Get(nilCtx, k)
	invalid("Get with a nil context", err)
	_, err = st.Update(nilCtx, k, idempotency.Claimed, 1, idempotency.Change{State: idempotency.Armed, Fence: 1})
	invalid("Update with a nil context", err)
	_, err = st.Purge(nilCtx)
	invalid("Purge with a nil context", err)
	invalid("Resolve with a nil context", idempotency.Resolve(nilCtx, st, k, 1, idempotency.Completed, nil, time.Hour))
	invalid("Resolve with a negative retention", idempotency.Resolve(ctxT(t), st, k, 1, idempotency.Completed, nil, -time.Hour))
	for _, bad := range s.BadKeys {
		what := fmt.Sprintf("%.40q (%d bytes)", bad, len(bad))
		_, err = idempotency.Do(ctxT(t), st, bad, "fp", c.effect("x"), s.opts())
		invalid("Do with key "+what, err)
		_, _, err = st.Begin(ctxT(t), bad, "fp", "me", time.Minute)
		invalid("Begin with key "+what, err)
		_, err = st.Get(ctxT(t), bad)
		invalid("Get with key "+what, err)
	}
	if c.runs.Load() != 0 {
		t.Errorf("the effect ran %d times on refused calls", c.runs.Load())
	}
	if _, err := st.Get(ctxT(t), k); !errors.Is(err, fence.ErrNotFound) {
		t.Errorf("a refused call left a record: %v", err)
	}
	// Huge durations are not negative: a lease near the top of time.Duration
	// works, and its default in-progress ceiling does not overflow.
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("long"), s.opts(func(o *idempotency.Options) { o.Lease = math.MaxInt64 }))
	if err != nil || string(r.Value) != "long" {
		t.Errorf("Do with the largest lease: %+v, %v", r, err)
	}
}

// armed claims k for owner and arms it, both with lease.
func armed(t *testing.T, st idempotency.Store, k, owner string, lease time.Duration) idempotency.Record {
	t.Helper()
	rec, created, err := st.Begin(ctxT(t), k, "fp", owner, lease)
	if err != nil || !created {
		t.Fatalf("Begin(%q): created %v, %v", k, created, err)
	}
	rec, err = st.Update(ctxT(t), k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: owner, Lease: lease})
	if err != nil {
		t.Fatalf("arm %q: %v", k, err)
	}
	return rec
}

// testStaleOwnerOnArmedTakeover: A armed at fence f and stalled; B took the key
// over (fence f' > f) and armed its own attempt. The state A expects (armed) is
// the state the record is in, so only the fence can refuse A: its completion,
// renewal and release must each be stale, and B's record stay as it was.
func (s Suite) testStaleOwnerOnArmedTakeover(t *testing.T) {
	st := s.New(t)
	k := key()
	a := s.crashedOwner(t, st, k, true)
	b, err := st.Update(ctxT(t), k, idempotency.Armed, a.Fence, idempotency.Change{State: idempotency.Claimed, Fence: a.Fence + 1, Owner: "B", Lease: time.Minute, Restart: true})
	if err != nil {
		t.Fatalf("B's takeover: %v", err)
	}
	if b, err = st.Update(ctxT(t), k, idempotency.Claimed, b.Fence, idempotency.Change{State: idempotency.Armed, Fence: b.Fence, Owner: "B", Lease: time.Minute}); err != nil {
		t.Fatalf("B's arm: %v", err)
	}
	for _, ch := range []idempotency.Change{
		{State: idempotency.Completed, Fence: a.Fence, Owner: "crashed", Result: []byte("A, late"), Retention: time.Hour},
		{State: idempotency.Armed, Fence: a.Fence, Owner: "crashed", Lease: time.Hour},
		{State: idempotency.Released, Fence: a.Fence, Owner: "crashed"},
	} {
		_, err := st.Update(ctxT(t), k, idempotency.Armed, a.Fence, ch)
		var se *fence.StaleError
		if !errors.As(err, &se) || se.Current != b.Fence || se.Offered != a.Fence {
			t.Errorf("A (fence %d) changing B's armed record (fence %d) to %s: %v, want a StaleError offered %d, current %d",
				a.Fence, b.Fence, ch.State, err, a.Fence, b.Fence)
		}
	}
	rec := state(t, st, k)
	if rec.State != idempotency.Armed || rec.Fence != b.Fence || rec.Owner != "B" || rec.Result != nil || rec.LeaseLeft <= 0 || rec.LeaseLeft > time.Minute {
		t.Errorf("B's record after A's stale updates: %+v, want armed, fence %d, owner B, no result, B's lease", rec, b.Fence)
	}
}

// testPurgeKeeps: Purge removes only completed and failed records past their
// retention, and released ones. A completed record within its retention, a
// claimed and an armed record whose leases ran out, and an unknown record all
// stay, and Do neither runs the armed nor the unknown key's effect again.
func (s Suite) testPurgeKeeps(t *testing.T) {
	st := s.New(t)
	c := &counter{}
	kDone, kClaimed, kArmed, kUnknown := key(), key(), key(), key()
	if _, err := idempotency.Do(ctxT(t), st, kDone, "fp", c.effect("done"), s.opts()); err != nil {
		t.Fatal(err)
	}
	if _, _, err := st.Begin(ctxT(t), kClaimed, "fp", "crashed", s.Lease); err != nil {
		t.Fatal(err)
	}
	armed(t, st, kArmed, "crashed", s.Lease)
	armed(t, st, kUnknown, "crashed", s.Lease)
	for _, k := range []string{kClaimed, kArmed, kUnknown} {
		s.leaseOver(t, st, k)
	}
	if _, err := idempotency.Do(ctxT(t), st, kUnknown, "fp", c.effect("x"), s.opts()); !errors.Is(err, idempotency.ErrUnknown) {
		t.Fatalf("Do on an abandoned armed key: %v, want ErrUnknown", err)
	}
	keys := map[string]string{kDone: "completed within its retention", kClaimed: "claimed past its lease", kArmed: "armed past its lease", kUnknown: "unknown"}
	before := map[string]idempotency.Record{}
	for k := range keys {
		before[k] = state(t, st, k)
	}
	if _, err := st.Purge(ctxT(t)); err != nil {
		t.Fatalf("Purge: %v", err)
	}
	for k, what := range keys {
		rec, err := st.Get(ctxT(t), k)
		if err != nil {
			t.Errorf("the %s record after Purge: %v, want it kept", what, err)
			continue
		}
		if b := before[k]; rec.State != b.State || rec.Fence != b.Fence || !bytes.Equal(rec.Result, b.Result) {
			t.Errorf("the %s record changed in Purge: %+v, was %+v", what, rec, b)
		}
	}
	runs := c.runs.Load() // 1: kDone's
	if _, err := idempotency.Do(ctxT(t), st, kArmed, "fp", c.effect("again"), s.opts()); !errors.Is(err, idempotency.ErrUnknown) {
		t.Errorf("Do on the armed key after Purge: %v, want ErrUnknown", err)
	}
	if _, err := idempotency.Do(ctxT(t), st, kUnknown, "fp", c.effect("again"), s.opts()); !errors.Is(err, idempotency.ErrUnknown) {
		t.Errorf("Do on the unknown key after Purge: %v, want ErrUnknown", err)
	}
	if r, err := idempotency.Do(ctxT(t), st, kDone, "fp", c.effect("again"), s.opts()); err != nil || !r.Replayed || string(r.Value) != "done" {
		t.Errorf("Do on the completed key after Purge: %+v, %v, want the replay of done", r, err)
	}
	if n := c.runs.Load() - runs; n != 0 {
		t.Errorf("after Purge, Do ran an effect %d times on keys whose effect may already have happened", n)
	}
}

// testRenewalKeepsKey: an effect that runs for three leases keeps the key
// while renewals reach the store: every other Do meanwhile gets ErrInProgress
// and never runs the effect, and the owner completes.
func (s Suite) testRenewalKeepsKey(t *testing.T) {
	st := s.New(t)
	k := key()
	lease := max(s.Lease, time.Second) // renewals every lease/3 must get through on a loaded machine
	started, finish := make(chan struct{}), make(chan struct{})
	var aErr, aCtxErr error
	var aRes idempotency.Result
	aDone := make(chan struct{})
	go func() {
		defer close(aDone)
		aRes, aErr = idempotency.Do(ctxT(t), st, k, "fp", func(ctx context.Context, _ string) ([]byte, error) {
			close(started)
			select {
			case <-finish:
			case <-ctx.Done():
			}
			aCtxErr = context.Cause(ctx)
			return []byte("long"), aCtxErr
		}, s.opts(func(o *idempotency.Options) { o.Lease = lease }))
	}()
	select {
	case <-started:
	case <-aDone:
		t.Fatalf("A ended before its effect ran: %v", aErr)
	}
	c := &counter{}
	tries := 0
	for begun := time.Now(); time.Since(begun) < 3*lease; tries++ {
		_, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("B"), s.opts(func(o *idempotency.Options) { o.Lease = lease }))
		if !errors.Is(err, idempotency.ErrInProgress) {
			t.Errorf("B's Do %v into A's renewed effect (lease %v): %v, want ErrInProgress", time.Since(begun).Round(time.Millisecond), lease, err)
			break
		}
		time.Sleep(lease / 10)
	}
	close(finish)
	<-aDone
	if aCtxErr != nil || aErr != nil || string(aRes.Value) != "long" {
		t.Errorf("A, renewing for 3 leases: %+v, %v (effect's context: %v), want its result", aRes, aErr, aCtxErr)
	}
	if n := c.runs.Load(); n != 0 || tries < 3 {
		t.Errorf("B ran the effect %d times in %d tries while A held the key", n, tries)
	}
}

// testTakeoverFingerprint: a takeover keeps the key's fingerprint, so after it
// completes the same request replays and another one is refused.
func (s Suite) testTakeoverFingerprint(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	s.crashedOwner(t, st, k, false)
	if r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("taken over"), s.opts()); err != nil || r.Replayed {
		t.Fatalf("takeover: %+v, %v", r, err)
	}
	if rec := state(t, st, k); rec.Fingerprint != "fp" {
		t.Errorf("fingerprint after the takeover: %q, want fp", rec.Fingerprint)
	}
	if r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("again"), s.opts()); err != nil || !r.Replayed || string(r.Value) != "taken over" {
		t.Errorf("the same request after the takeover: %+v, %v, want the replay", r, err)
	}
	if _, err := idempotency.Do(ctxT(t), st, k, "another request", c.effect("again"), s.opts()); !errors.Is(err, idempotency.ErrFingerprintMismatch) {
		t.Errorf("another request after the takeover: %v, want ErrFingerprintMismatch", err)
	}
	if n := c.runs.Load(); n != 1 {
		t.Errorf("effect ran %d times, want 1", n)
	}
}

// testWholeKey: keys are compared whole and byte for byte: a record under
// k+"-x" is not k's, and neither are keys that a collation, a character set or
// Unicode normalisation would take for k or for each other (another case, a
// trailing space, NFC and NFD forms, a 4-byte character and the "?" a 3-byte
// character set turns it into). A neighbour the store refuses with ErrInvalid
// is one it cannot hold, and is left out.
func (s Suite) testWholeKey(t *testing.T) {
	st := s.New(t)
	k := key()
	if _, created, err := st.Begin(ctxT(t), k+"-x", "fp", "prefixed", time.Minute); err != nil || !created {
		t.Fatalf("Begin(%q): created %v, %v", k+"-x", created, err)
	}
	if rec, err := st.Get(ctxT(t), k); !errors.Is(err, fence.ErrNotFound) {
		t.Fatalf("Get(%q) with only %q recorded: %+v, %v, want ErrNotFound", k, k+"-x", rec, err)
	}
	owners := map[string]string{k + "-x": "prefixed"}
	for i, n := range []string{k, strings.ToUpper(k), k + " ", k + "\u00e9", k + "e\u0301", k + "\U0001F600", k + "?"} {
		owner := fmt.Sprintf("owner-%d", i)
		rec, created, err := st.Begin(ctxT(t), n, "fp", owner, time.Minute)
		if errors.Is(err, fence.ErrInvalid) && n != k {
			t.Logf("the store cannot hold %+q: %v", n, err)
			continue
		}
		if err != nil || !created || rec.Owner != owner {
			t.Errorf("Begin(%+q) beside %d other keys: %+v, created %v, %v: want a claim of its own", n, len(owners), rec, created, err)
			continue
		}
		owners[n] = owner
	}
	for n, owner := range owners {
		if rec := state(t, st, n); rec.Owner != owner {
			t.Errorf("Get(%+q): owner %q, want %q: two keys share one record", n, rec.Owner, owner)
		}
	}
}

// testBeginAfterRetention: past its retention a completed record no longer
// holds the key, even if nobody purged it: Begin claims it anew, above its
// fence.
func (s Suite) testBeginAfterRetention(t *testing.T) {
	st := s.New(t)
	k, c := key(), &counter{}
	const retention = 100 * time.Millisecond
	r, err := idempotency.Do(ctxT(t), st, k, "fp", c.effect("v"), s.opts(func(o *idempotency.Options) { o.Retention = retention }))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(retention)
	wait := 5 * time.Second
	for deadline := time.Now().Add(wait); ; {
		rec, created, err := st.Begin(ctxT(t), k, "fp2", "C", time.Minute)
		if err != nil {
			t.Fatalf("Begin past the retention: %v", err)
		}
		if created {
			if rec.Fence <= r.Fence || rec.Fingerprint != "fp2" || rec.State != idempotency.Claimed {
				t.Errorf("the new claim past the retention: %+v, want claimed with fp2 above fence %d", rec, r.Fence)
			}
			return
		}
		if rec.State != idempotency.Completed || rec.Fence != r.Fence {
			t.Fatalf("Begin before the retention ran out: %+v, want the completed record", rec)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v past a retention of %v, without Purge, Begin still returns the completed record instead of claiming the key", wait, retention)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// testTakeoverRestarts: a takeover (Change.Restart) starts InProgressFor
// again, so the in-progress time of the new owner does not include the
// crashed owner's.
func (s Suite) testTakeoverRestarts(t *testing.T) {
	st := s.New(t)
	k := key()
	s.crashedOwner(t, st, k, false)
	// The takeover's own lease is long: the effect reads the store with the
	// effect's context, which a short lease's missed renewal on a loaded
	// machine would cancel (CI: "idempotency get: context canceled").
	begun := time.Now()
	var inProgress, elapsed time.Duration
	_, err := idempotency.Do(ctxT(t), st, k, "fp", func(ctx context.Context, _ string) ([]byte, error) {
		rec, err := st.Get(ctx, k)
		elapsed = time.Since(begun)
		inProgress = rec.InProgressFor
		return nil, err
	}, s.opts(func(o *idempotency.Options) { o.Lease = 10 * time.Second }))
	if err != nil {
		t.Fatal(err)
	}
	// The crashed claim is at least a lease older than begun; the store's
	// clock reads in milliseconds, hence the small margin.
	if inProgress < 0 || inProgress > elapsed+10*time.Millisecond {
		t.Errorf("InProgressFor %v into the takeover (%v since it began): it did not start again", inProgress, elapsed)
	}
}

// testNotAliased: the store keeps its own copy of a result: changing the
// caller's buffer after Update or after Do, or the buffer a read returned,
// does not change what is stored and replayed.
func (s Suite) testNotAliased(t *testing.T) {
	st := s.New(t)
	k := key()
	rec := armed(t, st, k, "me", time.Minute)
	buf := []byte("original")
	if _, err := st.Update(ctxT(t), k, idempotency.Armed, rec.Fence, idempotency.Change{State: idempotency.Completed, Fence: rec.Fence, Owner: "me", Result: buf, Retention: time.Hour}); err != nil {
		t.Fatal(err)
	}
	copy(buf, "XXXXXXXX")
	got := state(t, st, k)
	if string(got.Result) != "original" {
		t.Fatalf("stored result after the caller changed its buffer: %q, want original", got.Result)
	}
	copy(got.Result, "YYYYYYYY")
	if got := state(t, st, k); string(got.Result) != "original" {
		t.Errorf("stored result after the caller changed what Get returned: %q, want original", got.Result)
	}

	k2 := key()
	out := []byte("charged")
	r, err := idempotency.Do(ctxT(t), st, k2, "fp", func(context.Context, string) ([]byte, error) { return out, nil }, s.opts())
	if err != nil {
		t.Fatal(err)
	}
	copy(out, "XXXXXXX")
	copy(r.Value, "XXXXXXX")
	r2, err := idempotency.Do(ctxT(t), st, k2, "fp", func(context.Context, string) ([]byte, error) { return []byte("again"), nil }, s.opts())
	if err != nil || !r2.Replayed || string(r2.Value) != "charged" {
		t.Fatalf("replay after the caller changed the effect's buffer: %+v, %v, want charged", r2, err)
	}
	copy(r2.Value, "YYYYYYY")
	if r3, err := idempotency.Do(ctxT(t), st, k2, "fp", func(context.Context, string) ([]byte, error) { return []byte("again"), nil }, s.opts()); err != nil || string(r3.Value) != "charged" {
		t.Errorf("replay after the caller changed a replayed value: %+v, %v, want charged", r3, err)
	}
}
