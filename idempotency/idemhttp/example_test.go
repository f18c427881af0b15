package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idemhttp"
)

// A payment API: POST /charges runs once per Idempotency-Key and client; a
// retry gets the recorded answer, marked Idempotent-Replayed.
func ExampleMiddleware() {
	dir, _ := os.MkdirTemp("", "idemhttp")
	defer os.RemoveAll(dir)
	db, err := sqlfence.OpenSQLite(filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	store, _ := sqlfence.NewIdempotencyStore(sqlfence.SQLite(db), nil)
	if err := store.CreateTable(context.Background()); err != nil {
		log.Fatal(err)
	}
	mw, err := idemhttp.Middleware(store, &idemhttp.Options{
		// Scope keys by the authenticated client.
		Principal: func(r *http.Request) (string, error) {
			if u, _, ok := r.BasicAuth(); ok {
				return u, nil
			}
			return "", errors.New("log in first")
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	charged := 0
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charged++
		// Calls to the card processor carry the attempt's effect key.
		_ = idemhttp.EffectKey(r.Context())
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charge %d\n", charged)
	})
	srv := httptest.NewServer(mw(charge))
	defer srv.Close()

	for i := 0; i < 2; i++ {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader("amount=4200"))
		req.SetBasicAuth("alice", "secret")
		req.Header.Set("Idempotency-Key", "order-42")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%d replayed=%q %s", resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), body)
	}
	// Output:
	// 201 replayed="" charge 1
	// 201 replayed="true" charge 1
}

// Calling a provider that deduplicates by Idempotency-Key, from inside an
// idempotency.Do effect: the effect key goes out as the header, and the request
// is retried (same key) after a lost connection or a 5xx.
func ExampleTransport() {
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "charged under key %d chars long", len(r.Header.Get("Idempotency-Key")))
	}))
	defer provider.Close()
	client := &http.Client{Transport: &idemhttp.Transport{}}

	dir, _ := os.MkdirTemp("", "idemhttp")
	defer os.RemoveAll(dir)
	db, _ := sqlfence.OpenSQLite(filepath.Join(dir, "app.db"))
	defer db.Close()
	store, _ := sqlfence.NewIdempotencyStore(sqlfence.SQLite(db), nil)
	_ = store.CreateTable(context.Background())

	res, err := idempotency.Do(context.Background(), store, "order-42", "amount=4200",
		func(ctx context.Context, effectKey string) ([]byte, error) {
			req, _ := http.NewRequestWithContext(idemhttp.WithKey(ctx, effectKey), http.MethodPost,
				provider.URL+"/v1/charges", strings.NewReader("amount=4200"))
			resp, err := client.Do(req)
			if err != nil {
				return nil, err // ambiguous: the key stays armed
			}
			defer resp.Body.Close()
			return io.ReadAll(resp.Body)
		}, nil)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(res.Value))
	// Output: charged under key 32 chars long
}
