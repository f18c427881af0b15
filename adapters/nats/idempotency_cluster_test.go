package natsfence_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/natstest"
)

// TestClusterStoreLeaderLoss: on a 3-node cluster with an R3 bucket, Do goes
// on over 40 keys (each called twice) while the bucket's stream leader is
// killed. Every effect runs at most once, no Do hangs past its bound, and a
// Do that returned its effect's result left the key completed with it, as
// the new leader holds it.
func TestClusterStoreLeaderLoss(t *testing.T) {
	if testing.Short() {
		t.Skip("a 3-node cluster")
	}
	c := natstest.StartCluster(t, 3)
	j := jsOn(t, natstest.Connect(t, c.URLs()))
	cfg := natsfence.LockBucket("idem-r3")
	cfg.Replicas = 3
	o := &natsfence.IdempotencyOptions{Timeout: time.Second, RetryFor: 10 * time.Second}
	s := newStoreOpts(t, j, cfg, o)
	const keys = 40
	var runs [keys]atomic.Int32
	var done [keys]atomic.Bool
	var wg sync.WaitGroup
	var mu sync.Mutex
	outcomes := map[string]int{}
	// Key 5's first effect holds its Do open until the leader's shutdown is
	// over, so at least one Do straddles the kill whatever the scheduling.
	inEffect, killDone := make(chan struct{}), make(chan struct{})
	var killed atomic.Int64    // when the leader's shutdown began, unix ns
	var straddled atomic.Int32 // Do calls under way when it began
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range keys {
			k := fmt.Sprintf("order-%d", i)
			for attempt := range 2 {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				begun := time.Now()
				r, err := idempotency.Do(ctx, s, k, "fp", func(context.Context, string) ([]byte, error) {
					runs[i].Add(1)
					if i == 5 && attempt == 0 {
						close(inEffect)
						<-killDone
					}
					return []byte(k), nil
				}, &idempotency.Options{Lease: 5 * time.Second})
				cancel()
				if kt := killed.Load(); kt != 0 && begun.UnixNano() < kt && time.Now().UnixNano() > kt {
					straddled.Add(1)
				}
				if d := time.Since(begun); d > 25*time.Second {
					t.Errorf("Do(%s) took %v: a hang", k, d)
				}
				mu.Lock()
				switch {
				case err == nil && string(r.Value) == k:
					done[i].Store(true)
					outcomes["ok"]++
				case err == nil:
					t.Errorf("Do(%s) returned %q", k, r.Value)
				case errors.Is(err, idempotency.ErrInProgress):
					outcomes["in progress"]++
				default:
					outcomes["error"]++
					t.Logf("Do(%s) during the election: %v", k, err)
				}
				mu.Unlock()
			}
		}
	}()
	<-inEffect
	leader := c.StreamLeader("KV_" + cfg.Bucket)
	if leader < 0 {
		t.Fatal("no stream leader")
	}
	t.Logf("killing node %d, the bucket's stream leader", leader)
	killed.Store(time.Now().UnixNano())
	c.Stop(leader)
	close(killDone)
	wg.Wait()
	t.Logf("outcomes of %d Do calls: %v; %d under way when the leader went down", 2*keys, outcomes, straddled.Load())
	if straddled.Load() == 0 {
		t.Fatal("no Do call was under way when the leader went down: the case proved nothing")
	}
	check := newStoreOpts(t, jsOn(t, natstest.Connect(t, c.URLs())), cfg, o)
	for i := range keys {
		k := fmt.Sprintf("order-%d", i)
		if n := runs[i].Load(); n > 1 {
			t.Errorf("%s: the effect ran %d times", k, n)
		}
		if !done[i].Load() {
			continue
		}
		rec, err := check.Get(context.Background(), k)
		if err != nil || rec.State != idempotency.Completed || string(rec.Result) != k {
			t.Errorf("%s: Do returned its result, but the record is %+v, %v", k, rec, err)
		}
	}
	if outcomes["ok"] < keys {
		t.Errorf("only %d of %d keys completed", outcomes["ok"], keys)
	}
}
