package sqlfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

func TestInspectAndBump(t *testing.T) {
	ctx := context.Background()
	_, fdb := openSQLite(t)
	a := newSQLiteAcquirer(t, fdb)
	if _, err := a.Inspect(ctx, "never"); !errors.Is(err, fence.ErrNotFound) {
		t.Errorf("Inspect of an unknown name: %v", err)
	}
	l, err := a.TryAcquire(ctx, "job", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	info, err := a.Inspect(ctx, "job")
	if err != nil || !info.Held || info.Token != l.Token() || info.Owner != a.Owner() || info.TimeLeft <= 50*time.Second || info.Counter != l.Token() {
		t.Fatalf("Inspect of a held lock: %+v, %v", info, err)
	}
	if err := a.Bump(ctx, "job", l.Token()+100); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("Bump while held: %v, want ErrHeld", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.Bump(ctx, "job", l.Token()+100); err != nil {
		t.Fatal(err)
	}
	if err := a.Bump(ctx, "job", l.Token()+50); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Bump downwards: %v, want ErrInvalid", err)
	}
	if err := a.Bump(ctx, "fresh", 7); err != nil {
		t.Errorf("Bump of a name never granted: %v", err)
	}
	l2, err := a.TryAcquire(ctx, "job", time.Minute)
	if err != nil || l2.Token() != l.Token()+101 {
		t.Fatalf("grant after the bump: token %v, %v; want %d", l2, err, l.Token()+101)
	}
	info, _ = a.Inspect(ctx, "job")
	if info.Counter != l.Token()+101 {
		t.Errorf("counter %d after the grant", info.Counter)
	}
}
