package fence_test

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// TestHoldDoesNotReleaseAgainAfterWorkReleasedAndEnded: Hold releases a
// lease once. When work released its lease itself and then panics or calls
// runtime.Goexit, Hold must not release it again (it does not when work
// returns): the name may already be another holder's, and the second
// release is a request on the backend for a lease nobody holds. The other
// holder keeps the name. Real SQLite leases.
func TestHoldDoesNotReleaseAgainAfterWorkReleasedAndEnded(t *testing.T) {
	a := sqliteAcquirer(t)
	ends := []struct {
		name string
		end  func()
	}{
		{"returns", func() {}},
		{"panics", func() { panic("boom after releasing") }},
		{"calls Goexit", func() { runtime.Goexit() }},
	}
	for _, e := range ends {
		t.Run(e.name, func(t *testing.T) {
			f := &faulty{Acquirer: a}
			var other fence.Lease
			done := make(chan struct{})
			go func() {
				defer close(done)
				defer func() { _ = recover() }()
				_ = fence.Hold(context.Background(), f, "job-once", time.Second, func(ctx context.Context, l fence.Lease) error {
					if err := l.Release(ctx); err != nil {
						t.Errorf("work's own release: %v", err)
					}
					var err error
					if other, err = a.TryAcquire(ctx, "job-once", time.Second); err != nil {
						t.Errorf("another holder after work released: %v", err)
					}
					e.end()
					return nil
				})
			}()
			select {
			case <-done:
			case <-time.After(hangGuard):
				t.Fatal("Hold never ended")
			}
			if other != nil {
				defer other.Release(context.Background())
				if err := other.Context().Err(); err != nil {
					t.Errorf("the other holder's lease ended: %v", err)
				}
			}
			if n := f.releases.Load(); n != 1 {
				t.Errorf("work %s after releasing its lease: %d releases, want 1 (work's own): Hold released it again", e.name, n)
			}
		})
	}
}
