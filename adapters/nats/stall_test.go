package natsfence_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestWatchRequestFailsThenWaiterWoken: the first watch requests of a
// waiting Acquire fail (as a consumer refused under load would). Its
// Recheck is a minute, so only its watch can wake it: the request must be
// made again, and the holder's release then wakes the waiter at once. (A
// worker of the MutualExclusion suite case once waited two minutes on a
// busy lock: a watch request that failed once was never made again.)
func TestWatchRequestFailsThenWaiterWoken(t *testing.T) {
	ctx := context.Background()
	holder := newAcquirer(t, js(t), lockBucket, nil)
	waiter, err := natsfence.NewAcquirer(ctx, js(t), lockBucket.Bucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("watchfails")
	key := natsfence.EncodeKey(name)
	var failed atomic.Int32
	natsfence.SetWatchErrHook(func(k string) error {
		if k == key && failed.Add(1) <= 3 {
			return errors.New("test: watch request refused")
		}
		return nil
	})
	t.Cleanup(func() { natsfence.SetWatchErrHook(nil) })
	waiting := waitingHook(t)
	h, err := holder.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	res := goAcquire(wctx, waiter, name, 10*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	// The watch is asked again until a request goes through (the fourth).
	for end := time.Now().Add(10 * time.Second); failed.Load() < 4; {
		if time.Now().After(end) {
			t.Fatalf("the watch was asked %d times in 10s: a failed request was not made again", failed.Load())
		}
		time.Sleep(2 * time.Millisecond) // polling a counter
	}
	released := time.Now()
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-res:
		if r.err != nil {
			t.Fatal(r.err)
		}
		defer r.l.Release(ctx)
		if r.l.Token() <= h.Token() {
			t.Fatalf("token %d after %d", r.l.Token(), h.Token())
		}
		t.Logf("granted %v after the release", r.at.Sub(released))
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter (Recheck a minute) was not granted within 10s of the release: its watch was never made")
	}
}
