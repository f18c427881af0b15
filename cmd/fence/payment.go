package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idemhttp"
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
	// Worker 2 again, waiting until the claim expired (Wait: the store tells
	// when, no sleep): reconcile with the provider. The bound only keeps a
	// broken store from hanging the demo.
	opts.Owner = "worker-2"
	wctx, cancel := context.WithTimeout(ctx, lease+30*time.Second)
	wopts := *opts
	wopts.Wait = true
	r, err := idempotency.Do(wctx, d.b.idem, key, "amount=4200", func(_ context.Context, ek string) ([]byte, error) {
		return []byte(p.charge(ek, 4200)), nil
	}, &wopts)
	cancel()
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
	return d.paymentServerError(ctx, lease)
}

// paymentServerError: over HTTP, a payment API behind the Idempotency-Key
// middleware charges the card and then answers 500 (its own database write
// failed after the charge). A 5xx does not prove that nothing happened, so the
// key stays armed: the client's Transport retries with the same key, gets 409
// while the attempt's lease lasts, and then the charge the Reconcile hook
// found at the provider. The card is charged once.
func (d *demo) paymentServerError(ctx context.Context, lease time.Duration) error {
	p := &provider{charges: map[string]string{}}
	found := func(_ context.Context, ek string) (bool, []byte, error) {
		id, ok := p.lookup(ek)
		return ok, idemhttp.RecordedResponse(http.StatusCreated, http.Header{"Content-Type": {"text/plain"}}, []byte(id)), nil
	}
	mw, err := idemhttp.Middleware(d.b.idem, &idemhttp.Options{Idempotency: &idempotency.Options{Lease: lease, Reconcile: found}})
	if err != nil {
		return err
	}
	api := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.charge(idemhttp.EffectKey(r.Context()), 4200)
		http.Error(w, "charged, but recording the order failed", http.StatusInternalServerError)
	})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mw(api), ErrorLog: log.New(io.Discard, "", 0), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()

	var answers []int
	tr := &idemhttp.Transport{MaxAttempts: 20, MaxRetryAfter: lease / 4, Base: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp, err := http.DefaultTransport.RoundTrip(r)
		if err == nil {
			answers = append(answers, resp.StatusCode)
		}
		return resp, err
	})}
	key := fmt.Sprintf("order-44-%d", time.Now().UnixNano())
	req, err := http.NewRequestWithContext(idemhttp.WithKey(ctx, key), http.MethodPost, "http://"+l.Addr().String()+"/v1/charges", strings.NewReader("amount=4200"))
	if err != nil {
		return err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return err
	}
	d.printf("   over HTTP: the API charges, then answers 500; the client's transport retries with the same key\n")
	d.printf("   answers on the wire: %v; the client got %d %q (Idempotent-Replayed: %s)\n", answers, resp.StatusCode, body, resp.Header.Get(idemhttp.ReplayedHeader))
	d.printf("   charges at the provider after the 5xx and its retries: %d\n", p.n)
	d.check(p.n == 1 && len(answers) > 1 && answers[0] == http.StatusInternalServerError && resp.StatusCode == http.StatusCreated &&
		resp.Header.Get(idemhttp.ReplayedHeader) == "true",
		"a 5xx after the charge, retried over HTTP: the key stayed armed, the retry got the charge found at the provider, one charge")
	return nil
}

// roundTripFunc is an http.RoundTripper from a function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// crashAfterEffect is a store whose owner dies after the effect: its completion
// never reaches the store.
type crashAfterEffect struct{ idempotency.Store }

func (c crashAfterEffect) Update(ctx context.Context, key string, from idempotency.State, f fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if ch.State == idempotency.Completed {
		return idempotency.Record{}, errors.New("worker 1 crashed")
	}
	return c.Store.Update(ctx, key, from, f, ch)
}
