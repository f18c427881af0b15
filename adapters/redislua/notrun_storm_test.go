package redislua_test

import (
	"context"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// TestRedlockWithOneNodeBusyForever: one of three Redlock nodes answers BUSY
// for the whole test. A try still gets a majority within its node timeout,
// the release frees the name on the other two (and returns nil), and the
// next try is granted a larger token.
func TestRedlockWithOneNodeBusyForever(t *testing.T) {
	b := startBusyRedis(t)
	n1, n2 := testenv.StartRedis(t), testenv.StartRedis(t)
	ctx := context.Background()
	r := newRedlock(t, []redislua.Client{n1.Client(t), n2.Client(t), b.c}, nil)
	name := fencetest.Name("redlock-busy")
	warm := mustTryAcquire(ctx, t, r, fencetest.Name("warm"), time.Minute) // loads the scripts
	_ = warm.Release(ctx)
	b.busy(t)
	var last fence.Token
	for i := 0; i < 3; i++ {
		tctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		l, err := r.TryAcquire(tctx, name, 10*time.Second)
		cancel()
		if err != nil {
			t.Fatalf("try %d with one node busy: %v", i, err)
		}
		if l.Token() <= last {
			t.Errorf("token %d after %d", l.Token(), last)
		}
		last = l.Token()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err = l.Release(rctx)
		cancel()
		if err != nil {
			t.Errorf("release %d with one node busy: %v", i, err)
		}
	}
}
