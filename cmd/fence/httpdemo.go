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
	"sync/atomic"
	"time"

	"github.com/fencekit/fencekit/idempotency/idemhttp"
)

// loseFirstResponse is a client's connection that breaks after the server has
// answered the first request: the client never sees that answer.
type loseFirstResponse struct {
	base http.RoundTripper
	lost atomic.Bool
}

func (l *loseFirstResponse) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := l.base.RoundTrip(r)
	if err == nil && l.lost.CompareAndSwap(false, true) {
		resp.Body.Close()
		return nil, errors.New("connection reset by peer")
	}
	return resp, err
}

// httpPayment: the same charge over HTTP. A payment API behind the
// Idempotency-Key middleware (on this backend's store) charges a card; the
// client's first response is lost on the way back, and its transport retries
// with the same key: the card is charged once, and the client gets the first
// answer, marked as a replay.
func (d *demo) httpPayment(ctx context.Context) error {
	d.printf("6. The same over HTTP: an Idempotency-Key middleware, and a client whose response is lost\n")
	if d.b.idem == nil {
		d.printf("   (this backend has no idempotency store)\n")
		return nil
	}
	p := &provider{charges: map[string]string{}}
	mw, err := idemhttp.Middleware(d.b.idem, nil)
	if err != nil {
		return err
	}
	api := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		id := p.charge(idemhttp.EffectKey(r.Context()), 4200)
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "%s for %s", id, body)
	})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mw(api), ErrorLog: log.New(io.Discard, "", 0), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	defer srv.Close()
	url := "http://" + l.Addr().String() + "/v1/charges"
	d.printf("   a payment API on %s, POST /v1/charges behind the middleware\n", url)

	key := fmt.Sprintf("order-43-%d", time.Now().UnixNano())
	client := &http.Client{Transport: &idemhttp.Transport{Base: &loseFirstResponse{base: http.DefaultTransport}}}
	send := func(body string) (*http.Response, string, error) {
		req, err := http.NewRequestWithContext(idemhttp.WithKey(ctx, key), http.MethodPost, url, strings.NewReader(body))
		if err != nil {
			return nil, "", err
		}
		resp, err := client.Do(req)
		if err != nil {
			return nil, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp, string(b), err
	}
	resp, body, err := send("amount=4200")
	if err != nil {
		return fmt.Errorf("client: %w", err)
	}
	d.printf("   client: sent Idempotency-Key %s; the first answer was lost, the transport retried with the same key\n", key)
	d.printf("   client got: %d %q (Idempotent-Replayed: %s)\n", resp.StatusCode, body, resp.Header.Get(idemhttp.ReplayedHeader))
	again, againBody, err := send("amount=4200")
	if err != nil {
		return err
	}
	d.printf("   a later retry of the order: %d %q (replayed: %s)\n", again.StatusCode, againBody, again.Header.Get(idemhttp.ReplayedHeader))
	other, _, err := send("amount=9900")
	if err != nil {
		return err
	}
	d.printf("   the same key with another amount: %d\n", other.StatusCode)
	d.printf("   charges at the provider: %d\n", p.n)
	d.check(p.n == 1 && resp.StatusCode == http.StatusCreated && resp.Header.Get(idemhttp.ReplayedHeader) == "true" &&
		againBody == body && other.StatusCode == http.StatusUnprocessableEntity,
		"a lost response and a retry over HTTP, one charge: the client got the first answer, replayed")
	return nil
}
