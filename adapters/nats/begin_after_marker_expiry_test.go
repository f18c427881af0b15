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

// TestBeginDroppedClaimResentAfterPurgeMarkerAgedOut: a released record is
// removed by Purge, which leaves a marker on the key that ages out after
// the bucket's LimitMarkerTTL. A Begin of that key reads the marker and
// sends its claim expecting the marker's revision; the claim never reaches
// the server (the connection is cut with it), and the client is kept away
// until the marker has aged out. Nothing landed, and nothing can land any
// more (the claim expected a revision the key no longer has): the key holds
// no record before and after, as when the claim was sent. Begin must resend
// the claim and return it, or at least not report a definite non-event as
// an unknown outcome.
func TestBeginDroppedClaimResentAfterPurgeMarkerAgedOut(t *testing.T) {
	ctx := context.Background()
	j, p := proxied(t)
	cfg := idemBucket(t)
	s := newStoreOpts(t, j, cfg, &natsfence.IdempotencyOptions{Timeout: 500 * time.Millisecond})
	direct := newStore(t, js(t), cfg)
	k := fencetest.Name("purged-then-claimed")
	rec, created, err := direct.Begin(ctx, k, "fp", "first", time.Minute)
	if err != nil || !created {
		t.Fatalf("first claim: %+v %v %v", rec, created, err)
	}
	if _, err := direct.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Released, Fence: rec.Fence, Owner: "first"}); err != nil {
		t.Fatal(err)
	}
	if n, err := direct.Purge(ctx); err != nil || n != 1 {
		t.Fatalf("purge: %d, %v", n, err)
	}
	// The claim is dropped on its way and the client kept away past the
	// marker's life (LimitMarkerTTL, 1s).
	p.DropRequest(publishTo(cfg.Bucket))
	p.Refuse(true)
	go func() {
		for p.Pending() != 0 {
			time.Sleep(time.Millisecond)
		}
		time.Sleep(cfg.LimitMarkerTTL + time.Second) // the marker's life is the case
		p.Refuse(false)
	}()
	start := time.Now()
	rec, created, err = s.Begin(ctx, k, "fp", "second", time.Minute)
	t.Logf("Begin after %v: %+v created %v: %v", time.Since(start).Round(time.Millisecond), rec, created, err)
	got, gerr := direct.Get(ctx, k)
	if err != nil {
		if errors.Is(gerr, fence.ErrNotFound) && errors.Is(err, fence.ErrUnknown) {
			t.Fatalf("Begin reported an unknown outcome (%v) for a claim that never reached the server: the key holds no record, as when the claim was sent, and the claim can no longer land; it was not resent", err)
		}
		t.Fatalf("Begin: %v (record now: %+v, %v)", err, got, gerr)
	}
	if !created || gerr != nil || got.Owner != "second" || got.Fence != rec.Fence {
		t.Fatalf("Begin returned %+v created %v; the record is %+v, %v", rec, created, got, gerr)
	}
}

// TestBeginDroppedClaimResentOverNewerMarker: as in
// TestBeginDroppedClaimResentAfterPurgeMarkerAgedOut, but while the client
// is kept away the key's purge marker is replaced by another (a kv purge of
// the key). The key still holds no record, and the dropped claim, which
// expects the first marker's revision, can no longer land: Begin sends its
// claim again, expecting the new marker, and returns it.
func TestBeginDroppedClaimResentOverNewerMarker(t *testing.T) {
	ctx := context.Background()
	j, p := proxied(t)
	cfg := idemBucket(t)
	s := newStoreOpts(t, j, cfg, &natsfence.IdempotencyOptions{Timeout: 500 * time.Millisecond})
	kv := bucket(t, js(t), cfg)
	direct := newStore(t, js(t), cfg)
	k := fencetest.Name("purged-twice-then-claimed")
	rec, created, err := direct.Begin(ctx, k, "fp", "first", time.Minute)
	if err != nil || !created {
		t.Fatalf("first claim: %+v %v %v", rec, created, err)
	}
	first := rec.Fence
	if _, err := direct.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Released, Fence: rec.Fence, Owner: "first"}); err != nil {
		t.Fatal(err)
	}
	if n, err := direct.Purge(ctx); err != nil || n != 1 {
		t.Fatalf("purge: %d, %v", n, err)
	}
	p.DropRequest(publishTo(cfg.Bucket))
	p.Refuse(true)
	replaced := make(chan error, 1)
	go func() {
		for p.Pending() != 0 {
			time.Sleep(time.Millisecond) // polling the proxy's fault
		}
		// The claim was dropped: replace the marker it expects.
		replaced <- kv.Purge(ctx, natsfence.EncodeKey(k))
		p.Refuse(false)
	}()
	rec, created, err = s.Begin(ctx, k, "fp", "second", time.Minute)
	if perr := <-replaced; perr != nil {
		t.Fatalf("the marker's replacement: %v", perr)
	}
	got, gerr := direct.Get(ctx, k)
	if err != nil {
		t.Fatalf("Begin after its claim was dropped and the key's marker replaced: %v (record now: %+v, %v)", err, got, gerr)
	}
	if !created || gerr != nil || got.Owner != "second" || got.Fence != rec.Fence {
		t.Fatalf("Begin returned %+v created %v; the record is %+v, %v", rec, created, got, gerr)
	}
	if rec.Fence <= first {
		t.Fatalf("the new claim's fence %d is not above the purged record's %d", rec.Fence, first)
	}
}
