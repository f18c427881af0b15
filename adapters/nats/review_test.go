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

// TestGrantUnknownDoesNotBlockName: a grant whose ack was lost and whose
// retries were cut off returns ErrUnknown. The create had landed, so the name
// is held by an entry nobody owns; once the connection is back, the acquirer
// must clean up its own entry (recognised by its nonce) instead of leaving the
// name blocked for the whole ttl (HAZARDS 6).
func TestGrantUnknownDoesNotBlockName(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.Options{Timeout: 300 * time.Millisecond, RetryFor: 300 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	warm, err := a.TryAcquire(ctx, fencetest.Name("warm"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Release(ctx)
	name := fencetest.Name("unknowngrant")
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true)
	_, err = a.TryAcquire(ctx, name, time.Minute)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a grant cut off after its create: %v, want ErrUnknown", err)
	}
	p.Refuse(false)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	l, err := other.Acquire(wctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("the name after an unknown grant of a 1 minute ttl: %v, want it free once the first acquirer could clean up", err)
	}
	_ = l.Release(ctx)
}
