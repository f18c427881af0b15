package natsfence_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestCreateHeldPastCleanupDoesNotHoldName: a TryAcquire's create is held in a
// partition from just before it is sent until well after the TryAcquire
// returned ErrUnknown and its background cleanup gave up (it looks for at
// most the ttl), and is then delivered. It must not land and hold the name
// for a fresh ttl with an owner that is gone: a create lands
// within a bound counted from its send, or never.
func TestCreateHeldPastCleanupDoesNotHoldName(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Timeout: 500 * time.Millisecond, RetryFor: time.Second})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	name := fencetest.Name("heldcreate")
	key := natsfence.EncodeKey(name)
	var once sync.Once
	natsfence.SetCreateHook(func(k string) {
		if k == key {
			once.Do(p.Partition)
		}
	})
	defer natsfence.SetCreateHook(nil)
	defer p.Heal()
	const ttl = 4 * time.Second
	_, err := a.TryAcquire(ctx, name, ttl)
	returned := time.Now()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a grant whose create is held in a partition: %v, want ErrUnknown", err)
	}
	// The partition's length is the case, not a wait for an event: it
	// outlasts the cleanup, which gives up a ttl after it began (at the
	// return), by a generous margin.
	time.Sleep(time.Until(returned.Add(ttl + 3*time.Second)))
	p.Heal()
	// A grant of another name on the same connection: its create's ack
	// comes after the stream has handled the held create (one connection,
	// one stream, handled in order).
	probe, err := a.TryAcquire(ctx, fencetest.Name("heldcreate-probe"), ttl)
	if err != nil {
		t.Fatalf("a grant after the heal: %v", err)
	}
	_ = probe.Release(ctx)
	li, err := other.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if li.Held {
		t.Fatalf("the create delivered %v after its TryAcquire returned ErrUnknown holds the name: token %d, owner %q, %v left", time.Since(returned).Round(time.Millisecond), li.Token, li.Owner, li.TimeLeft.Round(time.Millisecond))
	}
	l, err := other.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("the name after the held create was delivered: %v, want it free", err)
	}
	_ = l.Release(ctx)
}
