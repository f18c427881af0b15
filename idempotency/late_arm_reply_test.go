package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
)

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
