package fence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

func TestBackoffSleep(t *testing.T) {
	b := fence.Backoff{Min: time.Millisecond, Max: 2 * time.Millisecond}
	if err := b.Sleep(context.Background(), 3); err != nil {
		t.Errorf("Sleep on a live context: %v", err)
	}
	cause := errors.New("stop")
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(cause)
	slow := fence.Backoff{Min: time.Hour, Max: time.Hour}
	start := time.Now()
	// Delay is uniform in [0, 1h]: a done context must end the wait at once.
	if err := slow.Sleep(ctx, 0); !errors.Is(err, cause) || time.Since(start) > time.Second {
		t.Errorf("Sleep on a done context: %v after %v, want its cause at once", err, time.Since(start))
	}
}
