package natsfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
)

// TestStoreUnknownStepDoesNotLandLater (HAZARDS 3): the arm's first publish
// is dropped and the client cannot reconnect; the arm returns an error
// matching fence.ErrUnknown and a read on another client then shows the key
// still claimed. When the client reconnects later, nothing of that arm may
// land: the caller was told to read the record to know, the read said "not
// armed", and idempotency.Do has by then reported that the effect did not
// run. An arm landing after that leaves an armed key whose effect never ran
// (it ends unknown). The nats client keeps what is published while it
// reconnects and sends it after the reconnect, so the store must not publish
// while disconnected.
func TestStoreUnknownStepDoesNotLandLater(t *testing.T) {
	j, p := proxied(t)
	cfg := idemBucket(t)
	s2 := newStore(t, js(t), cfg)
	s, err := natsfence.NewStore(context.Background(), j, cfg.Bucket, &natsfence.StoreOptions{Timeout: 200 * time.Millisecond, RetryFor: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	k := fencetest.Name("late")
	rec, _, err := s.Begin(ctx, k, "fp", "me", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	p.Refuse(true)
	defer p.Refuse(false)
	p.DropRequest(publishTo(cfg.Bucket))
	_, err = s.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("an arm cut off from the server: %v, want fence.ErrUnknown", err)
	}
	if p.Pending() != 0 {
		t.Fatal("the first publish was not dropped")
	}
	got, err := s2.Get(ctx, k)
	if err != nil || got.State != idempotency.Claimed {
		t.Fatalf("after the unknown arm: %+v, %v, want claimed", got, err)
	}
	// The client reconnects; whatever it kept is sent now.
	p.Refuse(false)
	reconnected := time.Now().Add(10 * time.Second)
	for !j.Conn().IsConnected() {
		if time.Now().After(reconnected) {
			t.Fatal("the client did not reconnect")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := j.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, k); err != nil { // a round trip after the flush
		t.Fatal(err)
	}
	got, err = s2.Get(ctx, k)
	if err != nil || got.State != idempotency.Claimed {
		t.Fatalf("after the reconnect: %+v, %v, want still claimed (an arm reported unknown and read as not landed must not land later)", got, err)
	}
}
