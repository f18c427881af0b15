package idempotency_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
)

// An arm whose reply was lost is re-read; when the re-read finds it armed,
// Do renews it and starts the effect. If the arm's lease had already run
// out at the store by then (the re-read came late), another caller may have
// read the record as abandoned and be deciding to take it over: its
// Reconcile hook rightly finds that the first owner's effect did not
// happen, and its takeover is a compare-and-set on the record's state and
// fence, which the renewal does not change. The first owner must not start
// its effect on a lease the store had let lapse: the effect would run twice
// for one key, under two effect keys.
func TestArmRecognisedAfterLeaseLapsedRunsEffectOnce(t *testing.T) {
	const lease = 300 * time.Millisecond
	for name, ss := range serverStores(t) {
		t.Run(name, func(t *testing.T) {
			k := key()
			var runsA, runsB atomic.Int32
			aStarted, bRan := make(chan struct{}), make(chan struct{})
			var aOnce, bOnce sync.Once

			// B: a second caller, on the direct store, with a Reconcile hook
			// that asks the "provider" whether A's effect happened (it had
			// not, when asked) and answers after a provider's round trip.
			var bRes idempotency.Result
			var bErr error
			bDone := make(chan struct{})
			bEntered := make(chan struct{})
			var bEnterOnce sync.Once
			reconcile := func(ctx context.Context, ek string) (bool, []byte, error) {
				done := runsA.Load() > 0
				bEnterOnce.Do(func() { close(bEntered) })
				select { // the provider's round trip
				case <-aStarted:
				case <-time.After(3 * time.Second):
				}
				return done, nil, nil
			}
			startB := func() {
				go func() {
					defer close(bDone)
					bRes, bErr = idempotency.Do(ctxT(t), ss.direct, k, "fp", func(ctx context.Context, ek string) ([]byte, error) {
						runsB.Add(1)
						bOnce.Do(func() { close(bRan) })
						return []byte("B"), nil
					}, &idempotency.Options{Lease: lease, Reconcile: reconcile})
				}()
			}

			// A: its arm's reply is lost; its re-read of the record comes
			// after the arm's lease ran out at the store, once B has read
			// the record as abandoned.
			var armUpdate atomic.Int32
			hs := &hookedStore{Store: ss.faulty}
			hs.beforeUpdate = func(n int, from idempotency.State, ch idempotency.Change) {
				if from == idempotency.Claimed && ch.State == idempotency.Armed && armUpdate.Add(1) == 1 {
					ss.proxy.LoseReply(func(b []byte) bool { return faultnet.Carries(b, k) })
				}
			}
			var lapsed atomic.Bool
			hs.beforeGet = func(n int) {
				if armUpdate.Load() != 1 || !lapsed.CompareAndSwap(false, true) {
					return
				}
				deadline := time.Now().Add(10 * time.Second)
				for {
					rec, err := ss.direct.Get(context.Background(), k)
					if err == nil && rec.State == idempotency.Armed && rec.LeaseLeft <= 0 {
						break
					}
					if time.Now().After(deadline) {
						t.Errorf("the arm never showed armed with its lease run out: %+v, %v", rec, err)
						return
					}
					time.Sleep(10 * time.Millisecond)
				}
				startB()
				select {
				case <-bEntered:
				case <-time.After(10 * time.Second):
					t.Error("B never consulted its Reconcile hook")
				}
			}
			resA, errA := idempotency.Do(ctxT(t), hs, k, "fp", func(ctx context.Context, ek string) ([]byte, error) {
				if err := ctx.Err(); err != nil {
					return nil, idempotency.NotSent(err)
				}
				runsA.Add(1) // the irreversible step, on a lease A believes live
				aOnce.Do(func() { close(aStarted) })
				select { // waits for the provider's answer
				case <-bRan:
				case <-ctx.Done():
				case <-time.After(3 * time.Second):
				}
				return []byte("A"), nil
			}, &idempotency.Options{Lease: lease})
			if !lapsed.Load() {
				t.Fatalf("A's arm reply was never lost and re-read (Do: %+v, %v)", resA, errA)
			}
			<-bDone
			rec, gerr := ss.direct.Get(context.Background(), k)
			t.Logf("A: %q, %v; B: %q, %v; record %s fence %d result %q (%v)", resA.Value, errA, bRes.Value, bErr, rec.State, rec.Fence, rec.Result, gerr)
			if a, b := runsA.Load(), runsB.Load(); a+b > 1 {
				t.Fatalf("the effect ran %d times for key %q (A %d, B %d): A started it after renewing an arm whose lease had run out at the store, while B took the key over", a+b, k, a, b)
			}
		})
	}
}
