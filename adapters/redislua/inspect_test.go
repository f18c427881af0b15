package redislua_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

func TestInspectAndBump(t *testing.T) {
	ctx := context.Background()
	// Counter tokens, so that the grant after a bump to 1000 is exactly 1001.
	a := newAcquirerOn(t, testenv.RedisClient(t), &redislua.AcquirerOptions{CounterTokens: true})
	name := fencetest.Name("inspect")
	if _, err := a.Inspect(ctx, name); !errors.Is(err, fence.ErrNotFound) {
		t.Errorf("Inspect of an unknown name: %v", err)
	}
	l := mustTryAcquire(ctx, t, a, name, time.Minute)
	info, err := a.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != l.Token() || info.Owner == "" || info.TimeLeft <= 50*time.Second || info.Counter != l.Token() {
		t.Fatalf("Inspect of a held lock: %+v, %v", info, err)
	}
	// A bump while held raises the counter and leaves the holder its lease.
	if err := a.Bump(ctx, name, 1000); err != nil {
		t.Fatal(err)
	}
	if err := a.Bump(ctx, name, 999); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Bump downwards: %v, want ErrInvalid", err)
	}
	if err := l.Renew(ctx); err != nil {
		t.Errorf("the holder's Renew after a bump: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l2, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil || l2.Token() != 1001 {
		t.Fatalf("grant after the bump: %v, %v; want token 1001", l2, err)
	}
	_ = l2.Release(ctx)
}
