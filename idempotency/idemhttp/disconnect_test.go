package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idemhttp"
)

// claimThenGone is a store whose claims land, after which the request's
// context ends (its client disconnected) before the reply arrives: Begin
// returns the context's error.
type claimThenGone struct {
	idempotency.Store
	once   sync.Once
	landed chan struct{}
}

func (s *claimThenGone) Begin(ctx context.Context, key, fp, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	rec, created, err := s.Store.Begin(context.WithoutCancel(ctx), key, fp, owner, lease)
	first := false
	if err == nil && created {
		s.once.Do(func() { first = true; close(s.landed) })
	}
	if !first {
		return rec, created, err
	}
	<-ctx.Done()
	return idempotency.Record{}, false, fmt.Errorf("injected: the claim's reply was in flight: %w", ctx.Err())
}

// TestClientGoneDuringClaimFreesKey: a client that disconnects while its
// request's claim is answered leaves no claim behind: its retry with the same
// key is served (the handler runs once) long before the claim's lease would
// have ended, instead of 409s until then.
func TestClientGoneDuringClaimFreesKey(t *testing.T) {
	const lease = time.Minute
	for name, store := range stores(t) {
		t.Run(name, func(t *testing.T) {
			st := &claimThenGone{Store: store, landed: make(chan struct{})}
			e := newEnv(t, st, &idemhttp.Options{Idempotency: &idempotency.Options{Lease: lease}})
			k := key()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+"/charges?currency=eur", strings.NewReader("10"))
			req.Header.Set(idemhttp.Header, k)
			gone := make(chan error, 1)
			go func() {
				resp, err := http.DefaultClient.Do(req)
				if err == nil {
					resp.Body.Close()
					err = fmt.Errorf("answered %d", resp.StatusCode)
				}
				gone <- err
			}()
			select {
			case <-st.landed:
			case <-time.After(20 * time.Second):
				t.Fatal("the first request's claim did not land within 20s")
			}
			cancel() // the client disconnects while the claim's reply is in flight
			if err := <-gone; !errors.Is(err, context.Canceled) {
				t.Fatalf("the disconnected client: %v, want context.Canceled", err)
			}
			begun := time.Now()
			var conflicts []string
			for {
				resp, body := e.post(t, k, "10")
				if resp.StatusCode == http.StatusCreated {
					break
				}
				if resp.StatusCode != http.StatusConflict {
					t.Fatalf("the retry: %d %s, want 201 (or 409 while the abandoned claim is settled)", resp.StatusCode, body)
				}
				conflicts = append(conflicts, "Retry-After "+resp.Header.Get("Retry-After"))
				if time.Since(begun) > 20*time.Second {
					t.Fatalf("the retry still gets 409 %v after the client left, with the claim's lease (%v) not over: %v", time.Since(begun).Round(time.Millisecond), lease, conflicts)
				}
				time.Sleep(10 * time.Millisecond) // a client's retry interval, not synchronisation
			}
			if len(conflicts) > 0 {
				t.Logf("retries answered 409 before the key was freed: %v", conflicts)
			}
			if n := e.h.ranFor(k); n != 1 {
				t.Errorf("the handler ran %d times for the key", n)
			}
		})
	}
}
