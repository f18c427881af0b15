package sqlfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestAcquireEndsWithAGrantInFlight: an Acquire whose context ends while its
// grant statement is on a slow link (faultnet latency above the wait) reads
// the row, gives back a grant that landed, and returns what any wait that
// ran out returns: fence.ErrHeld joined with the context's error, not
// fence.ErrUnknown (the conformance suite's AcquireGivesUpAtDeadline and
// AcquireCancelled failed so on PostgreSQL on a loaded machine). On a free
// name the grant lands after the context ended: the name must be free
// within seconds afterwards, not held for the minute's ttl.
func TestAcquireEndsWithAGrantInFlight(t *testing.T) {
	ctx := context.Background()
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			a, err := sqlfence.NewAcquirer(p.db, nil)
			if err != nil {
				t.Fatal(err)
			}
			other, err := sqlfence.NewAcquirer(p.direct, nil)
			if err != nil {
				t.Fatal(err)
			}
			warm := fencetest.Name("inflight")
			l, err := a.TryAcquire(ctx, warm, time.Minute) // connects and prepares
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			held, free := fencetest.Name("inflight"), fencetest.Name("inflight")
			h, err := other.TryAcquire(ctx, held, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			defer h.Release(ctx)
			for _, name := range []string{held, free} {
				p.proxy.Latency(60*time.Millisecond, 60*time.Millisecond)
				wctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
				got, err := a.Acquire(wctx, name, time.Minute)
				cancel()
				p.proxy.Latency(0, 0)
				if err == nil {
					_ = got.Release(ctx)
					t.Fatalf("%s: granted within a 20ms wait over a 60ms link", name)
				}
				if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, fence.ErrUnknown) {
					t.Fatalf("Acquire whose context ended with its grant in flight (name held: %v): %v, want ErrHeld joined with DeadlineExceeded (and not ErrUnknown)", name == held, err)
				}
			}
			// A grant statement still on the link when the Acquire's read
			// settled the row lands after it; the Acquire's watcher gives
			// it back within its watch (grantWatch, 2s), so the name is
			// free within seconds, not held for the minute's ttl.
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			start := time.Now()
			l, err = other.Acquire(wctx, free, time.Minute)
			cancel()
			if err != nil {
				t.Fatalf("the free name after an Acquire gave up with its grant in flight: still held after %v (%v), want it free (the grant given back)", time.Since(start), err)
			}
			t.Logf("the free name was granted %v after the Acquire gave up", time.Since(start))
			_ = l.Release(ctx)
		})
	}
}
