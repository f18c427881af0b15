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
	p.LoseReply(createTo(lockBucket.Bucket))
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

// TestReleaseLostAckThenRegranted: the ack of a release is lost (the purge
// landed), and a waiter is granted the name before the releaser can look
// again. The release did land: reporting ErrLost ("it had already expired")
// is a definite wrong outcome (HAZARDS 3); nil or ErrUnknown are honest.
func TestReleaseLostAckThenRegranted(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, nil)
	other := newAcquirer(t, js(t), lockBucket, &natsfence.Options{Recheck: time.Minute})
	ctx := context.Background()
	name := fencetest.Name("lostrelease")
	l, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan fence.Lease, 1)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	go func() {
		l2, err := other.Acquire(wctx, name, 5*time.Second)
		if err != nil {
			t.Errorf("the waiter: %v", err)
		}
		got <- l2
	}()
	// The waiter watches the key before its first try, so it is woken by
	// the release whenever that lands.
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true) // the releaser stays cut off until the waiter is granted
	done := make(chan error, 1)
	go func() { done <- l.Release(ctx) }()
	waitLost(t, p, before)
	l2 := <-got
	p.Refuse(false)
	err = <-done
	if errors.Is(err, fence.ErrLost) {
		t.Fatalf("a release that landed, its ack lost, then the name granted to another: %v, want nil or ErrUnknown, not ErrLost", err)
	}
	if err != nil && !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("release: %v", err)
	}
	if l2 != nil {
		if l2.Token() <= l.Token() {
			t.Errorf("token %d not above %d", l2.Token(), l.Token())
		}
		_ = l2.Release(ctx)
	}
}

// TestDriftNotBelowTTL: a Drift at least the lease's ttl makes a lease whose
// context is done at birth while the server holds the name for the ttl: a
// lease already lost must not come with a nil error (HAZARDS 6, 8), and the
// name must not be blocked by it.
func TestDriftNotBelowTTL(t *testing.T) {
	a := newAcquirer(t, js(t), lockBucket, &natsfence.Options{Drift: 10 * time.Second})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	name := fencetest.Name("drift")
	l, err := a.TryAcquire(ctx, name, 5*time.Second)
	if err == nil {
		defer func() { _ = l.Release(ctx) }()
		if l.Context().Err() != nil {
			t.Fatalf("TryAcquire with Drift 10s and ttl 5s: a lease whose context is already done (%v), with a nil error", context.Cause(l.Context()))
		}
		t.Fatalf("TryAcquire with Drift 10s and ttl 5s: nil error, want ErrInvalid naming Drift")
	}
	var ie *fence.InvalidError
	if !errors.As(err, &ie) || ie.Arg != "Drift" {
		t.Fatalf("TryAcquire with Drift 10s and ttl 5s: %v, want ErrInvalid naming Drift", err)
	}
	l2, err := other.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("the name after the refused acquire: %v", err)
	}
	_ = l2.Release(ctx)
}

// TestWriterLostAckNotReplayed: the ack of a write with token 6 is lost (it
// landed), and a later write with the same token lands before the writer
// looks again. The writer must not publish its entry a second time over the
// later one (a step applied twice, undoing a later write): the key keeps the
// later value, and the first write reports nil or ErrUnknown.
func TestWriterLostAckNotReplayed(t *testing.T) {
	j, p := proxied(t)
	bucket(t, j, writerBucket)
	// The retry after the lost ack waits for the 5s attempt timeout, long
	// after the later write below.
	w, err := natsfenceWriter(j, 5*time.Second, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	check := newWriter(t, js(t), writerBucket)
	ctx := context.Background()
	key := fencetest.Name("replay")
	if err := w.Write(ctx, key, []byte("v5"), 5); err != nil {
		t.Fatal(err)
	}
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(writerBucket.Bucket))
	done := make(chan error, 1)
	go func() { done <- w.Write(ctx, key, []byte("first"), 6) }()
	waitLost(t, p, before)
	if v, tok, err := check.Read(ctx, key); err != nil || string(v) != "first" || tok != 6 {
		t.Fatalf("the write whose ack was lost did not land: %q %d %v", v, tok, err)
	}
	if err := check.Write(ctx, key, []byte("later"), 6); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil && !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("the first write: %v, want nil or ErrUnknown", err)
	}
	if v, tok, err := check.Read(ctx, key); err != nil || string(v) != "later" || tok != 6 {
		t.Fatalf("Read = %q %d %v, want the later write (later 6): the first was applied twice", v, tok, err)
	}
}

// TestLateRenewalDoesNotBlockName: a renewal sent before the lease's local
// deadline lands after it (held by a partition until the holder's context is
// done). The server then holds the key for a fresh ttl that nobody holds:
// Renew reports the lease lost, and the name must not stay blocked past the
// original grant's server expiry for that fresh ttl (HAZARDS 6).
func TestLateRenewalDoesNotBlockName(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.Options{Timeout: 10 * time.Second})
	other := newAcquirer(t, js(t), lockBucket, &natsfence.Options{Recheck: time.Minute})
	ctx := context.Background()
	name := fencetest.Name("laterenew")
	// 2.5s is 3s on the server: the renewal lands between the two, and
	// would hold the name until about 5.5s after the grant.
	l, err := a.TryAcquire(ctx, name, 2500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	p.Partition()
	renewed := make(chan error, 1)
	go func() { renewed <- l.Renew(ctx) }()
	<-l.Context().Done()
	p.Heal()
	if err := <-renewed; !errors.Is(err, fence.ErrLost) {
		t.Fatalf("a renewal that landed after the local deadline: %v, want ErrLost", err)
	}
	// The original grant expires on the server within about 0.5s from
	// here; the late renewal, if left, about 3s from here.
	wctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	l2, err := other.Acquire(wctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("the name after the holder learnt its lease was lost: %v, want it free by the original expiry (the late renewal undone)", err)
	}
	if l2.Token() <= l.Token() {
		t.Errorf("token %d not above %d", l2.Token(), l.Token())
	}
	_ = l2.Release(ctx)
}

// TestGrantConfirmedAfterLocalDeadline: the ack of a grant is lost and the
// client cannot reconnect until the lease's local deadline has passed; the
// key is still there (the server's ttl is rounded up), so the retry
// recognises it. A lease already past its local deadline must not be
// returned with a nil error (HAZARDS 6): either a live lease or an error.
func TestGrantConfirmedAfterLocalDeadline(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.Options{Timeout: 300 * time.Millisecond, RetryFor: 10 * time.Second})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	warm, err := a.TryAcquire(ctx, fencetest.Name("warm"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Release(ctx)
	name := fencetest.Name("lateconfirm")
	before := p.Stats().LostReplies
	p.LoseReply(createTo(lockBucket.Bucket))
	p.Refuse(true)
	type res struct {
		l   fence.Lease
		err error
	}
	got := make(chan res, 1)
	start := time.Now()
	go func() {
		l, err := a.TryAcquire(ctx, name, 1500*time.Millisecond)
		got <- res{l, err}
	}()
	waitLost(t, p, before)
	// A lease granted after a's was sent, with the same ttl: once its
	// context is done, a's local deadline has passed too.
	clock, err := other.TryAcquire(ctx, fencetest.Name("clock"), 1500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	<-clock.Context().Done()
	p.Refuse(false)
	r := <-got
	t.Logf("TryAcquire after %v: %v", time.Since(start), r.err)
	if r.err == nil {
		defer func() { _ = r.l.Release(ctx) }()
		// Its local deadline was due before the return: the lease's timer
		// ends its context at once. A live 1.5s lease is not done within
		// 100ms.
		select {
		case <-r.l.Context().Done():
			t.Fatalf("TryAcquire returned token %d with a nil error, past its local deadline: %v", r.l.Token(), context.Cause(r.l.Context()))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// TestCancelledAcquireDoesNotBlockName: an Acquire cancelled while its
// create's ack is lost (the create landed, the reconnect refused) returns,
// and once the connection is back the name is free well before the ttl.
func TestCancelledAcquireDoesNotBlockName(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.Options{Timeout: 300 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	warm, err := a.TryAcquire(ctx, fencetest.Name("warm"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Release(ctx)
	name := fencetest.Name("cancelled")
	before := p.Stats().LostReplies
	p.LoseReply(createTo(lockBucket.Bucket))
	p.Refuse(true)
	actx, cancel := context.WithCancel(ctx)
	got := make(chan error, 1)
	go func() {
		l, err := a.Acquire(actx, name, time.Minute)
		if err == nil {
			_ = l.Release(ctx)
		}
		got <- err
	}()
	waitLost(t, p, before)
	cancel()
	if err := <-got; err == nil {
		t.Fatal("a cancelled Acquire returned a lease")
	}
	p.Refuse(false)
	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	l, err := other.Acquire(wctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("the name after a cancelled Acquire of a 1 minute ttl: %v", err)
	}
	_ = l.Release(ctx)
}
