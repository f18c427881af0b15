package redislua_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// TestTryAcquireOnReplicaReturns: a client pointed at a read-only replica
// (a configuration mistake, not a pause) gets READONLY for every write.
// TryAcquire "grants the lease or returns ErrHeld at once": with a context
// that has no deadline it must still return (an error that names READONLY),
// not send the try again forever.
func TestTryAcquireOnReplicaReturns(t *testing.T) {
	primary := testenv.StartRedis(t)
	replica := testenv.StartRedis(t, "--replicaof", "127.0.0.1", strconv.Itoa(primary.Port))
	a, err := redislua.NewAcquirer(replica.Client(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		l, err := a.TryAcquire(ctx, fencetest.Name("replica"), time.Minute)
		if l != nil {
			_ = l.Release(context.Background())
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Error("TryAcquire on a read-only replica granted")
		}
		t.Logf("TryAcquire on a replica: %v", err)
	case <-time.After(20 * time.Second):
		cancel()
		t.Errorf("TryAcquire on a read-only replica, context without deadline: no answer after 20s (READONLY sent again forever); after cancel: %v", <-done)
	}
}
