package idempotency_test

// The arm step under faults: a reply lost, answered late or unreadable.

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
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

// An arm whose reply comes after the lease's local deadline does not start
// the effect, returns an error matching fence.ErrLost, and frees the key
// (still this caller's): the next caller claims it at once and runs the
// effect, instead of waiting out the lease and finding it unknown. The same
// when the release's own reply is lost.
func TestLateArmReplyFreesKeyForNextCaller(t *testing.T) {
	const lease = 200 * time.Millisecond
	for name, ss := range serverStores(t) {
		for _, loseRelease := range []bool{false, true} {
			sub := name
			if loseRelease {
				sub += "/release-reply-lost"
			}
			t.Run(sub, func(t *testing.T) {
				k := key()
				var arms, releases atomic.Int32
				hs := &hookedStore{Store: ss.faulty}
				hs.beforeUpdate = func(n int, from idempotency.State, ch idempotency.Change) {
					if loseRelease && ch.State == idempotency.Released && releases.Add(1) == 1 {
						ss.proxy.LoseReply(func(b []byte) bool { return faultnet.Carries(b, k) })
					}
				}
				hs.afterUpdate = func(n int, from idempotency.State, ch idempotency.Change, err error) {
					if from == idempotency.Claimed && ch.State == idempotency.Armed && arms.Add(1) == 1 {
						time.Sleep(lease + 50*time.Millisecond) // the reply comes late
					}
				}
				started := false
				_, err := idempotency.Do(ctxT(t), hs, k, "fp", func(context.Context, string) ([]byte, error) {
					started = true
					return []byte("late"), nil
				}, &idempotency.Options{Lease: lease})
				rec, gerr := ss.direct.Get(context.Background(), k)
				t.Logf("Do: %v; record %s fence %d (%v)", err, rec.State, rec.Fence, gerr)
				if started || !errors.Is(err, fence.ErrLost) {
					t.Fatalf("Do whose arm reply came late: started %v, %v; want not started, fence.ErrLost", started, err)
				}
				if loseRelease && ss.proxy.Pending() != 0 {
					t.Fatal("the release's reply was never lost")
				}
				if !(errors.Is(gerr, fence.ErrNotFound) || (gerr == nil && rec.State == idempotency.Released)) {
					t.Fatalf("record after Do returned: %+v, %v; want released", rec, gerr)
				}
				var l ledger
				res, err := idempotency.Do(ctxT(t), ss.direct, k, "fp", l.effect(k), &idempotency.Options{Lease: lease})
				if err != nil || l.count(k) != 1 || string(res.Value) != "charged "+k {
					t.Fatalf("the next caller: %+v, %v, runs %d; want it to claim the freed key and run", res, err, l.count(k))
				}
			})
		}
	}
}

// An arm whose reply was lost, and whose re-read gets no answer before
// CompleteTimeout (the store is unreachable until Do gives up), ends Do without
// starting the effect. The arm may have landed: the key is then armed by
// nobody, and once its lease ends the next caller finds it unknown and
// needs an operator, for an effect that never ran. Do knows it never
// started the effect, and frees a claim it gave up on in the background
// once the store answers again (settleClaim); an arm it gave up on must be
// freed the same way, so that the next caller runs the effect.
func TestLostArmReplyUnreadableDoesNotLeaveKeyUnknown(t *testing.T) {
	const lease = 300 * time.Millisecond
	for name, ss := range serverStores(t) {
		t.Run(name, func(t *testing.T) {
			k := key()
			defer ss.proxy.Heal()
			var arms atomic.Int32
			hs := &hookedStore{Store: ss.faulty}
			hs.beforeUpdate = func(n int, from idempotency.State, ch idempotency.Change) {
				if from == idempotency.Claimed && ch.State == idempotency.Armed && arms.Add(1) == 1 {
					ss.proxy.LoseReply(func(b []byte) bool { return faultnet.Carries(b, k) })
				}
			}
			hs.afterUpdate = func(n int, from idempotency.State, ch idempotency.Change, err error) {
				if from == idempotency.Claimed && ch.State == idempotency.Armed && arms.Load() == 1 && err != nil {
					ss.proxy.Partition() // unreachable until Do gave up
				}
			}
			started := false
			_, err := idempotency.Do(ctxT(t), hs, k, "fp", func(context.Context, string) ([]byte, error) {
				started = true
				return []byte("first"), nil
			}, &idempotency.Options{Lease: lease, CompleteTimeout: 300 * time.Millisecond})
			ss.proxy.Heal()
			if arms.Load() == 0 || started || err == nil {
				t.Fatalf("arms %d, started %v, Do %v: the scenario did not happen", arms.Load(), started, err)
			}
			// The store answers again: the arm Do gave up on is freed in
			// the background. Wait for the record to leave the arm, and
			// fail if it is still armed well past the arm's lease.
			var rec idempotency.Record
			var gerr error
			for deadline := time.Now().Add(lease + 5*time.Second); ; {
				rec, gerr = ss.direct.Get(context.Background(), k)
				if gerr != nil || rec.State != idempotency.Armed {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the arm Do gave up on is still armed (fence %d) %v after the store answered again", rec.Fence, lease+5*time.Second)
				}
				time.Sleep(10 * time.Millisecond) // polling the record's state
			}
			t.Logf("Do: %v; record after the store answered again: %s fence %d (%v)", err, rec.State, rec.Fence, gerr)
			var l ledger
			res, nerr := idempotency.Do(ctxT(t), ss.direct, k, "fp", l.effect(k), &idempotency.Options{Lease: lease})
			if errors.Is(nerr, idempotency.ErrUnknown) || l.count(k) != 1 {
				final, _ := ss.direct.Get(context.Background(), k)
				t.Fatalf("the next caller: %+v, %v, runs %d (record %s): want it to run the effect, which never ran", res, nerr, l.count(k), final.State)
			}
		})
	}
}
