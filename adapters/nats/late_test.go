package natsfence_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
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
	j, p := proxied(t)
	ctx := context.Background()
	a := newAcquirer(t, j, lockBucket, nil)
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
