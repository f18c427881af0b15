package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
)

// provider is a payment API that cannot check a fencing token but deduplicates
// by the Idempotency-Key header, like real payment providers do.
type provider struct {
	mu      sync.Mutex
	charges map[string]string // idempotency key -> charge id
	n       int
}

func (p *provider) charge(idemKey string, amount int) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if id, ok := p.charges[idemKey]; ok {
		return id
	}
	p.n++
	id := fmt.Sprintf("ch_%03d (%d cents)", p.n, amount)
	p.charges[idemKey] = id
	return id
}

func (p *provider) lookup(idemKey string) (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	id, ok := p.charges[idemKey]
	return id, ok
}

// payment: two workers are told to charge order 42. Worker 1 charges the card
// and crashes before it records the charge. Worker 2 takes over once worker 1's
// claim expires, asks the provider about worker 1's attempt, and finds it: the
// card is charged once, and every later call replays the charge.
func (d *demo) payment(ctx context.Context) error {
	d.printf("5. A side effect that cannot be fenced: charging a card, with an idempotency key\n")
	if d.b.idem == nil {
		d.printf("   (this backend has no idempotency store)\n")
		return nil
	}
	p := &provider{charges: map[string]string{}}
	key := fmt.Sprintf("order-42-%d", time.Now().UnixNano())
	lease := 500 * time.Millisecond
	if d.timing != lessonTiming {
		lease = d.lease
	}
	opts := &idempotency.Options{Lease: lease, Reconcile: func(_ context.Context, ek string) (bool, []byte, error) {
		id, ok := p.lookup(ek)
		return ok, []byte(id), nil
	}}

	// Worker 1: claims, arms, charges, and crashes before recording.
	var charged string
	w1 := &idempotency.Options{Owner: "worker-1", Lease: lease, CompleteTimeout: 50 * time.Millisecond}
	_, err := idempotency.Do(ctx, crashAfterEffect{d.b.idem}, key, "amount=4200", func(_ context.Context, ek string) ([]byte, error) {
		charged = p.charge(ek, 4200)
		return []byte(charged), nil
	}, w1)
	if !errors.Is(err, idempotency.ErrNotRecorded) {
		return fmt.Errorf("worker 1: %v", err)
	}
	d.printf("   worker 1: claimed the key, armed it, charged %s, then crashed before recording it\n", charged)

	// Worker 2, at once: the key is in progress.
	_, err = idempotency.Do(ctx, d.b.idem, key, "amount=4200", func(context.Context, string) ([]byte, error) {
		return nil, errors.New("must not run")
	}, &idempotency.Options{Owner: "worker-2", Lease: lease, Reconcile: opts.Reconcile})
	var ip *idempotency.InProgressError
	inProgress := errors.As(err, &ip)
	if inProgress {
		d.printf("   worker 2, right away: in progress (worker 1's claim has %v left): it does not charge\n", ip.LeaseLeft.Round(10*time.Millisecond))
	}
	time.Sleep(lease + 100*time.Millisecond)

	// Worker 2, after the claim expired: reconcile with the provider.
	opts.Owner = "worker-2"
	r, err := idempotency.Do(ctx, d.b.idem, key, "amount=4200", func(_ context.Context, ek string) ([]byte, error) {
		return []byte(p.charge(ek, 4200)), nil
	}, opts)
	if err != nil {
		return fmt.Errorf("worker 2: %w", err)
	}
	d.printf("   worker 2, after the claim expired: asked the provider about worker 1's attempt: found %s (replayed: %v)\n", r.Value, r.Replayed)
	r2, err := idempotency.Do(ctx, d.b.idem, key, "amount=4200", func(context.Context, string) ([]byte, error) {
		return nil, errors.New("must not run")
	}, opts)
	if err != nil {
		return err
	}
	d.printf("   a retry of the order: %s (replayed: %v)\n", r2.Value, r2.Replayed)
	_, err = idempotency.Do(ctx, d.b.idem, key, "amount=9900", func(context.Context, string) ([]byte, error) {
		return nil, errors.New("must not run")
	}, opts)
	mismatch := errors.Is(err, idempotency.ErrFingerprintMismatch)
	d.printf("   the same key with another amount: %v\n", err)
	d.printf("   charges at the provider: %d\n", p.n)
	d.check(p.n == 1 && inProgress && string(r.Value) == charged && r2.Replayed && mismatch,
		"two workers, one crash, one charge: the idempotency key and the provider's lookup kept the card from a second charge")
	return nil
}

// crashAfterEffect is a store whose owner dies after the effect: its completion
// never reaches the store.
type crashAfterEffect struct{ idempotency.Store }

func (c crashAfterEffect) Update(ctx context.Context, key string, from idempotency.State, f fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if ch.State == idempotency.Completed {
		return idempotency.Record{}, errors.New("worker 1 crashed")
	}
	return c.Store.Update(ctx, key, from, f, ch)
}
