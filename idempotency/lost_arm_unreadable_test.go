package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
)

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
