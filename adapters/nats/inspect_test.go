package natsfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestInspect: a free name, a held one (also after renewals, which write new
// revisions: the token shown stays the grant's), and one released; the
// counter is at least every token granted and below the next grant's.
func TestInspect(t *testing.T) {
	a := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Owner: "inspector"})
	ctx := context.Background()
	name := fencetest.Name("inspect")
	info, err := a.Inspect(ctx, name)
	if err != nil || info.Held || info.Token != 0 {
		t.Fatalf("a free name: %+v, %v", info, err)
	}
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := l.Renew(ctx); err != nil {
			t.Fatalf("renew %d: %v", i, err)
		}
	}
	info, err = a.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != l.Token() || info.Owner != "inspector" || info.TimeLeft <= 0 || info.TimeLeft > 10*time.Second {
		t.Fatalf("held after 3 renewals: %+v, %v, want token %d, owner inspector, up to 10s left", info, err, l.Token())
	}
	if info.Counter < l.Token() {
		t.Fatalf("counter %d below the granted token %d", info.Counter, l.Token())
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	info, err = a.Inspect(ctx, name)
	if err != nil || info.Held {
		t.Fatalf("after the release: %+v, %v", info, err)
	}
	l2, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release(ctx)
	if l2.Token() <= info.Counter {
		t.Fatalf("the next grant's token %d is not above the counter %d", l2.Token(), info.Counter)
	}
	if _, err := a.Inspect(ctx, ""); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("Inspect of an empty name: %v", err)
	}
}
