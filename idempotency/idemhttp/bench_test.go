package idemhttp_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/fencekit/fencekit/idempotency/idemhttp"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// BenchmarkMiddleware compares a request through the middleware (subject) with
// the same request to the bare handler (baseline), interleaved, in process (no
// network), on SQLite and Redis: on a fresh key (claim, arm, complete: 3 store
// round trips) and on a replay (1 or 2).
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
				wrapped := mw(h)
				prefix := key()
				serve := func(handler http.Handler, k string) error {
					req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader("amount=4200"))
					req.Header.Set(idemhttp.Header, k)
					rec := httptest.NewRecorder()
					handler.ServeHTTP(rec, req)
					if rec.Code != http.StatusCreated {
						return fmt.Errorf("status %d: %s", rec.Code, rec.Body)
					}
					return nil
				}
				if err := serve(wrapped, prefix); err != nil {
					b.Fatal(err)
				}
				benchutil.Pair(b, func(i int) error {
					k := prefix
					if mode == "fresh" {
						k = fmt.Sprintf("%s-%d", prefix, i)
					}
					return serve(wrapped, k)
				}, func(i int) error { return serve(h, prefix) })
			})
		}
	}
}
