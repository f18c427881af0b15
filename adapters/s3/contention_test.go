package s3fence_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestAcquireWaitsThroughContention: a waiting Acquire whose attempts keep
// meeting other contenders' writes of the lock object (each TryAcquire ends
// in ErrContention after MaxAttempts, here 1) was not granted and waits on,
// as for a held lock, until its context ends; it does not return
// ErrContention (the conformance suite's MutualExclusion failed so on a
// loaded machine, on versitygw). Every worker gets its increments.
func TestAcquireWaitsThroughContention(t *testing.T) {
	e := fakeS3(t)
	a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{MaxAttempts: 1, Backoff: fence.Backoff{Min: time.Millisecond, Max: 5 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("contention")
	var (
		wg      sync.WaitGroup
		holders atomic.Int32
		errs    = make(chan error, 8)
	)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 10; i++ {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				l, err := a.Acquire(ctx, name, 10*time.Second)
				cancel()
				if err != nil {
					errs <- err
					return
				}
				if holders.Add(1) != 1 {
					errs <- errors.New("two holders at once")
				}
				holders.Add(-1)
				if err := l.Release(context.Background()); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("a worker: %v", err)
	}
}
