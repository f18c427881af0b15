package idemhttp_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/fencekit/fencekit/idempotency/idemhttp"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// BenchmarkMiddleware compares a request through the middleware (subject) with
// the same request to the bare handler (baseline), interleaved, in process (no
// network), on SQLite and Redis: on a fresh key (claim, arm, complete: 3 store
// round trips) and on a replay (1 or 2). It checks its work, so that a
// middleware that passed requests through would fail rather than look free:
// every fresh key runs the handler exactly once and answers unreplayed (and
// the last one then replays), and every replay is marked replayed and leaves
// the handler alone.
func BenchmarkMiddleware(b *testing.B) {
	all := stores(b)
	for _, name := range []string{"sqlite", "redis"} {
		for _, mode := range []string{"fresh", "replay"} {
			b.Run(name+"/"+mode, func(b *testing.B) {
				mw, err := idemhttp.Middleware(all[name], nil)
				if err != nil {
					b.Fatal(err)
				}
				h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(http.StatusCreated)
					_, _ = w.Write([]byte(`{"charge":"ch_001","amount":4200}`))
				})
				var mu sync.Mutex
				runs := map[string]int{} // handler runs behind the middleware, by key
				wrapped := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					mu.Lock()
					runs[r.Header.Get(idemhttp.Header)]++
					mu.Unlock()
					h(w, r)
				}))
				prefix := key()
				serve := func(handler http.Handler, k, replayed string) error {
					req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader("amount=4200"))
					req.Header.Set(idemhttp.Header, k)
					rec := httptest.NewRecorder()
					handler.ServeHTTP(rec, req)
					if rec.Code != http.StatusCreated || rec.Header().Get(idemhttp.ReplayedHeader) != replayed {
						return fmt.Errorf("key %s: status %d, %s %q (want %q): %s", k, rec.Code, idemhttp.ReplayedHeader, rec.Header().Get(idemhttp.ReplayedHeader), replayed, rec.Body)
					}
					return nil
				}
				if err := serve(wrapped, prefix, ""); err != nil {
					b.Fatal(err)
				}
				fresh, last := 0, prefix
				benchutil.Pair(b, func(i int) error {
					if mode == "fresh" {
						fresh++
						last = fmt.Sprintf("%s-%d", prefix, i)
						return serve(wrapped, last, "")
					}
					return serve(wrapped, prefix, "true")
				}, func(i int) error { return serve(h, prefix, "") })
				// The fresh keys were recorded: the last one replays.
				if err := serve(wrapped, last, "true"); err != nil {
					b.Fatal(err)
				}
				mu.Lock()
				defer mu.Unlock()
				if len(runs) != fresh+1 {
					b.Fatalf("the handler ran for %d keys, want %d (the fresh ones and the first)", len(runs), fresh+1)
				}
				for k, n := range runs {
					if n != 1 {
						b.Fatalf("the handler ran %d times for key %s, want 1", n, k)
					}
				}
			})
		}
	}
}
