package idemhttp_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idemhttp"
)

// The tests here show that the middleware fails safe: a 5xx, a panic or a
// client that left never makes the handler's effect run twice, and the
// options that would fail every keyed request are refused.

// serveMW serves h behind the middleware on s; the server's error log (a
// panic's stack) goes to logw, or nowhere when it is nil.
func serveMW(t *testing.T, s idempotency.Store, o *idemhttp.Options, h http.Handler, logw io.Writer) *httptest.Server {
	t.Helper()
	mw, err := idemhttp.Middleware(s, o)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(mw(h))
	if logw == nil {
		logw = io.Discard
	}
	srv.Config.ErrorLog = log.New(logw, "", 0)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

// leaseOpts is middleware options with a short lease, so that a test sees it
// run out; a lease is sized so that a renewal (every lease/3) gets through on a
// loaded machine.
func leaseOpts(lease time.Duration, reconcile idempotency.Reconcile) *idemhttp.Options {
	return &idemhttp.Options{Idempotency: &idempotency.Options{Lease: lease, Reconcile: reconcile}}
}

// untilNot posts key until the answer is no longer a 409 (the key's lease ran
// out or its handler finished), within 20s, and returns that answer.
func untilNot409(t *testing.T, url, key, body string, headers ...string) (*http.Response, string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		r, b := post(t, url, key, body, headers...)
		if r.StatusCode != http.StatusConflict {
			return r, b
		}
		if time.Now().After(deadline) {
			t.Fatalf("still 409 after 20s: %s", b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// wantCode fails unless the answer has status and problem code.
func wantCode(t *testing.T, what string, r *http.Response, b string, status int, code string) {
	t.Helper()
	if r.StatusCode != status || problemCode(t, r, b) != code {
		t.Fatalf("%s: %d %s; want %d %s", what, r.StatusCode, b, status, code)
	}
}

// chargeThen500 charges (counts a run) and then answers 500, as a handler
// whose write after the charge failed does.
func chargeThen500(runs *atomic.Int32) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, "charged, then the order update failed")
	})
}

// A 5xx after the effect keeps the key: the retry gets 409
// while the lease lasts, then outcome-unknown (no Reconcile) or the result the
// Reconcile hook found.
func testServerError(t *testing.T, s idempotency.Store) {
	var runs atomic.Int32
	srv := serveMW(t, s, leaseOpts(300*time.Millisecond, nil), chargeThen500(&runs), nil)
	k := key()
	r, b := post(t, srv.URL, k, "4200")
	if r.StatusCode != http.StatusInternalServerError || b != "charged, then the order update failed" || r.Header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("first: %d %s; want the handler's own 500", r.StatusCode, b)
	}
	r, b = post(t, srv.URL, k, "4200")
	wantCode(t, "retry at once", r, b, http.StatusConflict, "in-progress")
	r, b = untilNot409(t, srv.URL, k, "4200")
	wantCode(t, "retry after the lease", r, b, http.StatusInternalServerError, "outcome-unknown")
	if n := runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1: a 5xx after the charge charged again", n)
	}

	found := idemhttp.RecordedResponse(http.StatusCreated, http.Header{"Content-Type": {"application/json"}}, []byte(`{"charge":"found"}`))
	rec := serveMW(t, s, leaseOpts(300*time.Millisecond, func(context.Context, string) (bool, []byte, error) { return true, found, nil }), chargeThen500(&runs), nil)
	k = key()
	if r, _ := post(t, rec.URL, k, "4200"); r.StatusCode != http.StatusInternalServerError {
		t.Fatalf("first, with Reconcile: %d", r.StatusCode)
	}
	r, b = untilNot409(t, rec.URL, k, "4200")
	if r.StatusCode != http.StatusCreated || b != `{"charge":"found"}` || r.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("retry with a Reconcile hook that found the charge: %d %s", r.StatusCode, b)
	}
	if n := runs.Load(); n != 2 {
		t.Fatalf("handler ran %d times for two keys, want 2", n)
	}
}

// The explicit way out: a handler that calls NotSent releases the key, and
// the retry runs it again.
func testNotSent(t *testing.T, s idempotency.Store) {
	var runs atomic.Int32
	srv := serveMW(t, s, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			idemhttp.NotSent(r) // the database was down before the charge
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "charged")
	}), nil)
	k := key()
	if r, _ := post(t, srv.URL, k, "4200"); r.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("first: %d", r.StatusCode)
	}
	if r, b := post(t, srv.URL, k, "4200"); r.StatusCode != http.StatusCreated || r.Header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("after NotSent the key runs again: %d %s", r.StatusCode, b)
	}
	if r, b := post(t, srv.URL, k, "4200"); r.Header.Get(idemhttp.ReplayedHeader) != "true" || b != "charged" {
		t.Fatalf("the success after NotSent is not replayed: %d %s", r.StatusCode, b)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
}

// One call through Transport to a handler that charges and
// answers 500 charges once, whatever the Transport retries.
func testTransport5xx(t *testing.T, s idempotency.Store) {
	var runs atomic.Int32
	srv := serveMW(t, s, leaseOpts(300*time.Millisecond, nil), chargeThen500(&runs), nil)
	client := &http.Client{Transport: &idemhttp.Transport{MaxAttempts: 6, MaxRetryAfter: 100 * time.Millisecond}}
	req, _ := http.NewRequestWithContext(idemhttp.WithKey(context.Background(), key()), http.MethodPost, srv.URL+"/charges", strings.NewReader("4200"))
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if n := runs.Load(); n != 1 {
		t.Fatalf("one call through Transport ran the handler %d times (last answer %d), want 1", n, resp.StatusCode)
	}
	if resp.StatusCode != http.StatusInternalServerError && resp.StatusCode != http.StatusConflict {
		t.Errorf("last answer %d, want the 500 (outcome unknown) or a 409", resp.StatusCode)
	}
}

// syncBuffer is a bytes.Buffer safe for the server's error log.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// panicAfterCharge charges and then panics.
func panicAfterCharge(runs *atomic.Int32) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		panic("bug after the charge")
	})
}

// A panic after the effect keeps the key, and the server sees
// the panic with the handler's own stack.
func testPanic(t *testing.T, s idempotency.Store) {
	var runs atomic.Int32
	logs := &syncBuffer{}
	srv := serveMW(t, s, leaseOpts(300*time.Millisecond, nil), panicAfterCharge(&runs), logs)
	k := key()
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges?currency=eur", strings.NewReader("4200"))
	req.Header.Set(idemhttp.Header, k)
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("a panicking handler answered %d", resp.StatusCode)
	}
	r, b := post(t, srv.URL, k, "4200")
	wantCode(t, "retry after a panic", r, b, http.StatusConflict, "in-progress")
	r, b = untilNot409(t, srv.URL, k, "4200")
	wantCode(t, "retry after the lease", r, b, http.StatusInternalServerError, "outcome-unknown")
	if n := runs.Load(); n != 1 {
		t.Fatalf("handler ran %d times, want 1", n)
	}
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(logs.String(), "bug after the charge"); {
		if time.Now().After(deadline) {
			t.Fatalf("the server never logged the panic: %q", logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if l := logs.String(); !strings.Contains(l, "panicAfterCharge") {
		t.Errorf("the panic's stack lost the handler's frames:\n%s", l)
	}
}

// A client that leaves does not stop the renewals while its
// handler runs: a retry gets 409 (never a takeover, with or without a Reconcile
// hook that says "not done"), and the original answer is replayed once the
// handler finished.
func testClientLeft(t *testing.T, s idempotency.Store, reconcile bool) {
	// Renewals every 667ms. A 600ms lease (renewals every 200ms) was lost
	// on PostgreSQL beside two busy loops: the handler finished after the
	// lease's local deadline, and its result could not be recorded.
	lease := 2 * time.Second
	var runs, reconciles atomic.Int32
	started, noticed, release := make(chan struct{}, 4), make(chan struct{}, 4), make(chan struct{})
	var rh idempotency.Reconcile
	if reconcile {
		rh = func(context.Context, string) (bool, []byte, error) { reconciles.Add(1); return false, nil, nil }
	}
	srv := serveMW(t, s, leaseOpts(lease, rh), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		if n == 1 {
			started <- struct{}{}
			<-r.Context().Done()
			noticed <- struct{}{}
			<-release // a synchronous call to the card network that ignores its context
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charge %d", n)
	}), nil)
	k := key()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/charges?currency=eur", strings.NewReader("4200"))
		req.Header.Set(idemhttp.Header, k)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	<-started
	cancel()
	if err := <-errc; err == nil {
		t.Fatal("the client that left got an answer")
	}
	<-noticed // the handler's context was cancelled: the server saw the client leave
	// The time under test: past the lease, which only renewals keep.
	time.Sleep(2 * lease)
	r, b := post(t, srv.URL, k, "4200")
	if r.StatusCode != http.StatusConflict {
		close(release)
		t.Fatalf("retry while the first run is alive: %d %s (runs %d); want 409", r.StatusCode, b, runs.Load())
	}
	close(release)
	r, b = untilNot409(t, srv.URL, k, "4200")
	if r.StatusCode != http.StatusCreated || b != "charge 1" || r.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("retry after the first run finished: %d %s; want its 201, replayed", r.StatusCode, b)
	}
	if n := runs.Load(); n != 1 || reconciles.Load() != 0 {
		t.Fatalf("handler ran %d times, Reconcile asked %d times; want 1 and 0", n, reconciles.Load())
	}
}

// Each keyed downstream call from one handler gets its own
// Idempotency-Key, and the Transport's retry of one call keeps that call's key.
func testDownstreamKeys(t *testing.T, s idempotency.Store) {
	type call struct{ path, key string }
	var mu sync.Mutex
	var calls []call
	var failed atomic.Bool
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls = append(calls, call{r.URL.Path, r.Header.Get(idemhttp.Header)})
		mu.Unlock()
		if r.URL.Path == "/charges" && failed.CompareAndSwap(false, true) {
			w.Header().Set("Retry-After", "0")
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer provider.Close()
	var effectKey string
	var named [3]string
	srv := serveMW(t, s, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		effectKey = idemhttp.EffectKey(r.Context())
		named = [3]string{idemhttp.CallKey(r.Context(), "leg-1"), idemhttp.CallKey(r.Context(), "leg-1"), idemhttp.CallKey(r.Context(), "leg-2")}
		client := &http.Client{Transport: &idemhttp.Transport{}}
		for _, p := range []string{"/customers", "/charges", "/charges"} { // two equal ledger legs
			req, _ := http.NewRequestWithContext(r.Context(), http.MethodPost, provider.URL+p, strings.NewReader("4200"))
			resp, err := client.Do(req)
			if err != nil {
				w.WriteHeader(http.StatusBadGateway)
				return
			}
			resp.Body.Close()
		}
		w.WriteHeader(http.StatusCreated)
	}), nil)
	if r, b := post(t, srv.URL, key(), "4200"); r.StatusCode != http.StatusCreated {
		t.Fatalf("%d %s", r.StatusCode, b)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 4 || calls[1].key != calls[2].key || calls[1].path != "/charges" || calls[2].path != "/charges" {
		t.Fatalf("provider saw %v; want /customers, /charges twice with one key (a 503, the Transport's retry), /charges", calls)
	}
	seen := map[string]bool{effectKey: true}
	for _, c := range []call{calls[0], calls[1], calls[3]} {
		if c.key == "" || seen[c.key] {
			t.Fatalf("provider saw %v (effect key %s): the calls do not have keys of their own", calls, effectKey)
		}
		seen[c.key] = true
	}
	if named[0] != named[1] || named[0] == named[2] || named[0] == "" || seen[named[0]] {
		t.Errorf("CallKey: leg-1 %s and %s, leg-2 %s; want one key per name, the same for the same name", named[0], named[1], named[2])
	}
}

// A handler charges a provider through Transport (or with a CallKey it
// named), then answers 502: the key stays armed. The Reconcile hook asks the
// provider whether that call happened, by the key the call carried, derived
// from the effect key the hook is given (CallKeyFor): it finds the charge, and
// the retry gets the original answer. The provider charged once.
func testReconcileDownstream(t *testing.T, s idempotency.Store) {
	for _, named := range []bool{false, true} {
		var mu sync.Mutex
		charged := map[string]int{} // by Idempotency-Key
		provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			defer mu.Unlock()
			if r.Method == http.MethodGet { // GET /charges/{key}: did it happen?
				if charged[strings.TrimPrefix(r.URL.Path, "/charges/")] == 0 {
					w.WriteHeader(http.StatusNotFound)
				}
				return
			}
			charged[r.Header.Get(idemhttp.Header)]++
			w.WriteHeader(http.StatusCreated)
		}))
		host := strings.TrimPrefix(provider.URL, "http://")
		callName := "POST " + host + "/charges #1" // the Transport's name for the first such call
		if named {
			callName = "charge"
		}
		reconcile := func(ctx context.Context, ek string) (bool, []byte, error) {
			resp, err := http.Get(provider.URL + "/charges/" + idemhttp.CallKeyFor(ek, callName))
			if err != nil {
				return false, nil, err
			}
			resp.Body.Close()
			if resp.StatusCode == http.StatusNotFound {
				return false, nil, nil
			}
			return true, idemhttp.RecordedResponse(http.StatusCreated, nil, []byte("charged")), nil
		}
		srv := serveMW(t, s, leaseOpts(600*time.Millisecond, reconcile), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			if named {
				ctx = idemhttp.WithKey(ctx, idemhttp.CallKey(ctx, "charge"))
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL+"/charges", strings.NewReader("4200"))
			resp, err := (&http.Client{Transport: &idemhttp.Transport{}}).Do(req)
			if err == nil {
				resp.Body.Close()
			}
			w.WriteHeader(http.StatusBadGateway) // our own write after the charge failed
		}), nil)
		k := key()
		if r, b := post(t, srv.URL, k, "4200"); r.StatusCode != http.StatusBadGateway {
			t.Fatalf("first answer %d %s, want the handler's 502", r.StatusCode, b)
		}
		r, b := untilNot409(t, srv.URL, k, "4200")
		mu.Lock()
		n := 0
		for _, c := range charged {
			n += c
		}
		mu.Unlock()
		if n != 1 || r.StatusCode != http.StatusCreated || b != "charged" {
			t.Errorf("named %v: the provider charged %d times; the retry got %d %s; want one charge, and the reconciled 201", named, n, r.StatusCode, b)
		}
		provider.Close()
	}
}

// A handler that returns without answering after its client
// left is not a 200 success: the key stays armed (409, then outcome-unknown),
// or, when it called NotSent, the key is released and the retry runs it.
func testNoAnswer(t *testing.T, s idempotency.Store) {
	for _, notSent := range []bool{false, true} {
		var runs atomic.Int32
		started, returned := make(chan struct{}, 4), make(chan struct{}, 4)
		srv := serveMW(t, s, leaseOpts(300*time.Millisecond, nil), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				defer func() { returned <- struct{}{} }()
				started <- struct{}{}
				<-r.Context().Done()
				if notSent {
					idemhttp.NotSent(r)
				}
				return // nothing written
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, "charged")
		}), nil)
		k := key()
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/charges?currency=eur", strings.NewReader("4200"))
			req.Header.Set(idemhttp.Header, k)
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
		<-started
		cancel()
		<-returned
		r, b := untilNot409(t, srv.URL, k, "4200")
		if notSent {
			if r.StatusCode != http.StatusCreated || r.Header.Get(idemhttp.ReplayedHeader) != "" || runs.Load() != 2 {
				t.Fatalf("NotSent, then the client left: the retry got %d %s (runs %d); want a new run's 201", r.StatusCode, b, runs.Load())
			}
			continue
		}
		wantCode(t, "no answer after the client left, the retry", r, b, http.StatusInternalServerError, "outcome-unknown")
		if n := runs.Load(); n != 1 {
			t.Fatalf("handler ran %d times, want 1", n)
		}
	}
}

// With default options, a response is replayed only to the
// credentials that made it.
func testDefaultScope(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, nil)
	k := key()
	_, alice := e.post(t, k, "4200", "Authorization", "Bearer alice")
	rb, bob := e.post(t, k, "4200", "Authorization", "Bearer bob")
	if bob == alice || rb.Header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("bob, same key and body, got %s (replayed %q) after alice's %s; want a run of his own", bob, rb.Header.Get(idemhttp.ReplayedHeader), alice)
	}
	if r, b := e.post(t, k, "4200", "Authorization", "Bearer alice"); b != alice || r.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Errorf("alice's retry: %s, want her replay", b)
	}
	_, c1 := e.post(t, k, "4200", "Cookie", "session=carol")
	rc, c2 := e.post(t, k, "4200", "Cookie", "session=dave")
	if c1 == c2 || rc.Header.Get(idemhttp.ReplayedHeader) != "" {
		t.Errorf("two session cookies, one key: %s and %s; want two runs", c1, c2)
	}
	// API keys in their own headers, as many payment APIs take them.
	for _, h := range []string{"X-Api-Key", "Api-Key", "X-Auth-Token", "Proxy-Authorization"} {
		k := key()
		_, erin := e.post(t, k, "4200", h, "erin-secret")
		rf, frank := e.post(t, k, "4200", h, "frank-secret")
		if erin == frank || rf.Header.Get(idemhttp.ReplayedHeader) != "" {
			t.Errorf("two %s credentials, one key and body: frank got %s (replayed %q) after erin's %s; want a run of his own", h, frank, rf.Header.Get(idemhttp.ReplayedHeader), erin)
		}
	}
	if n := e.h.runs.Load(); n != 12 {
		t.Errorf("handler ran %d times, want 12 (alice, bob, carol, dave, and two per API-key header)", n)
	}
}

// A 103 Early Hints before the final status keeps the final
// status, for the first answer and the replay.
func testEarlyHints(t *testing.T, s idempotency.Store) {
	srv := serveMW(t, s, nil, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "charged")
	}), nil)
	k := key()
	for i, what := range []string{"first answer", "replay"} {
		r, b := post(t, srv.URL, k, "4200")
		if r.StatusCode != http.StatusCreated || b != "charged" || (r.Header.Get(idemhttp.ReplayedHeader) == "true") != (i == 1) {
			t.Errorf("%s: %d %s; want 201 charged", what, r.StatusCode, b)
		}
	}
}

// A handler that charges and then writes a status net/http refuses (outside
// 100-999) panics there without the middleware. Behind it, the status must not
// be recorded as the key's final answer, which no replay could then send: the
// key stays armed, as after any panic after the effect, and a retry gets
// outcome-unknown, never a connection cut on every replay.
func testInvalidStatus(t *testing.T, s idempotency.Store) {
	for _, status := range []int{42, 1000} {
		var runs atomic.Int32
		srv := serveMW(t, s, leaseOpts(600*time.Millisecond, nil), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(status)
			_, _ = io.WriteString(w, "charged")
		}), nil)
		k := key()
		send := func() (*http.Response, error) {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader("4200"))
			req.Header.Set(idemhttp.Header, k)
			return http.DefaultClient.Do(req)
		}
		if resp, err := send(); err == nil {
			resp.Body.Close()
		}
		for i := 0; i < 2; i++ {
			var r *http.Response
			var err error
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				if r, err = send(); err != nil || r.StatusCode != http.StatusConflict || time.Now().After(deadline) {
					break
				}
				r.Body.Close()
			}
			if err != nil {
				t.Fatalf("retry %d after a status %d: %v; want an answer", i, status, err)
			}
			b, _ := io.ReadAll(r.Body)
			r.Body.Close()
			wantCode(t, fmt.Sprintf("retry after a status %d", status), r, string(b), http.StatusInternalServerError, "outcome-unknown")
		}
		if n := runs.Load(); n != 1 {
			t.Errorf("status %d: the handler ran %d times, want 1", status, n)
		}
	}
}

// Options that would fail every keyed request are refused,
// naming the option; the largest accepted MaxResponseSize works.
func TestBadOptions(t *testing.T) {
	if _, err := idemhttp.Middleware(nil, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("nil store: %v", err)
	}
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			for _, c := range []struct {
				option string
				o      idemhttp.Options
			}{
				{"MaxBodySize", idemhttp.Options{MaxBodySize: -1}},
				{"MaxResponseSize", idemhttp.Options{MaxResponseSize: -1}},
				{"MaxResponseSize", idemhttp.Options{MaxResponseSize: math.MaxInt}},
				{"MaxResponseSize", idemhttp.Options{MaxResponseSize: idemhttp.MaxRecordSize + 1}},
				{"Idempotency.Lease", idemhttp.Options{Idempotency: &idempotency.Options{Lease: -time.Second}}},
				{"Idempotency.CompleteTimeout", idemhttp.Options{Idempotency: &idempotency.Options{CompleteTimeout: -time.Second}}},
				{"Idempotency.Retention", idemhttp.Options{Idempotency: &idempotency.Options{Retention: -time.Second}}},
				// Methods are case-sensitive: "post" would let every POST
				// through without its key, and a retry charge again.
				{"Methods", idemhttp.Options{Methods: []string{"post"}}},
				{"Methods", idemhttp.Options{Methods: []string{http.MethodPost, "Patch"}}},
				{"Methods", idemhttp.Options{Methods: []string{""}}},
			} {
				_, err := idemhttp.Middleware(s, &c.o)
				if !errors.Is(err, fence.ErrInvalid) || !strings.Contains(err.Error(), c.option) {
					t.Errorf("%+v: %v; want ErrInvalid naming %s", c.o, err, c.option)
				}
			}
			// The limits themselves work for a keyed request: the largest
			// MaxResponseSize, and the largest lease (Do's own limit).
			srv := serveMW(t, s, &idemhttp.Options{MaxResponseSize: idemhttp.MaxRecordSize, Idempotency: &idempotency.Options{Lease: math.MaxInt64}},
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }), nil)
			k := key()
			for i := 0; i < 2; i++ {
				if r, b := post(t, srv.URL, k, "4200"); r.StatusCode != http.StatusCreated {
					t.Fatalf("MaxResponseSize %d, the largest lease, request %d: %d %s", idemhttp.MaxRecordSize, i, r.StatusCode, b)
				}
			}
		})
	}
}

// lossyConn loses what the server writes once lose is set: the connection
// closes instead, after the handler ran, as a reset on the way back does.
type lossyConn struct {
	net.Conn
	lose atomic.Bool
}

func (c *lossyConn) Write(b []byte) (int, error) {
	if c.lose.Load() {
		c.Conn.Close()
		return 0, net.ErrClosed
	}
	return c.Conn.Write(b)
}

type lossyListener struct{ net.Listener }

func (l lossyListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &lossyConn{Conn: c}, nil
}

type connKey struct{}

// retryingClient is an independent retrying client, with the retry policy of
// the common retrying HTTP client libraries (go-retryablehttp's default): the
// same request, hence the same Idempotency-Key, is sent again after a
// connection error or a timeout, a 429 or any 5xx but 501, at most retries
// times, with exponential backoff; a 409 is returned as it is.
type retryingClient struct {
	http    *http.Client
	retries int
}

func (c *retryingClient) post(ctx context.Context, url, key, body string, headers ...string) (*http.Response, error) {
	var resp *http.Response
	var err error
	for attempt := 0; ; attempt++ {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
		ctx = context.Background() // the caller's patience bounds the first attempt
		req.Header.Set(idemhttp.Header, key)
		for i := 0; i+1 < len(headers); i += 2 {
			req.Header.Set(headers[i], headers[i+1])
		}
		resp, err = c.http.Do(req)
		retry := err != nil || resp.StatusCode == http.StatusTooManyRequests || (resp.StatusCode >= 500 && resp.StatusCode != http.StatusNotImplemented)
		if !retry || attempt == c.retries {
			return resp, err
		}
		if resp != nil {
			resp.Body.Close()
		}
		time.Sleep((20 * time.Millisecond) << attempt)
	}
}

// testOneEffectPerKey drives the middleware with an independent retrying
// client and with Transport, through lost responses, 5xx after the effect,
// panics after the effect and client timeouts, and counts the effects: exactly
// one per key. Then every key's answer is what it must be: the original
// replayed, or outcome-unknown for a 5xx or a panic after the effect.
func testOneEffectPerKey(t *testing.T, s idempotency.Store) {
	var mu sync.Mutex
	effects := map[string]int{}
	lost := map[string]bool{}
	started := map[string]chan struct{}{} // closed once the key's handler runs
	var inflight atomic.Int32
	slow := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inflight.Add(1)
		defer inflight.Add(-1)
		k := r.Header.Get(idemhttp.Header)
		mu.Lock()
		effects[k]++
		n := effects[k]
		mu.Unlock()
		switch r.Header.Get("X-Scenario") {
		case "5xx":
			w.WriteHeader(http.StatusBadGateway)
			return
		case "panic":
			panic("bug after the charge")
		case "timeout":
			close(started[k]) // the client gives up now
			<-slow            // a card network call slower than the client's patience, ignoring its context
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charge %s #%d", k, n)
	})
	// The lease is sized for renewals (every second) to get through 30
	// concurrent requests on SQLite under -race on a loaded machine.
	mw, err := idemhttp.Middleware(s, leaseOpts(3*time.Second, nil))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k := r.Header.Get(idemhttp.Header)
		mu.Lock()
		if r.Header.Get("X-Scenario") == "lost" && !lost[k] {
			lost[k] = true
			r.Context().Value(connKey{}).(*lossyConn).lose.Store(true)
		}
		mu.Unlock()
		mw(h).ServeHTTP(w, r)
	}))
	srv.Listener = lossyListener{srv.Listener}
	srv.Config.ConnContext = func(ctx context.Context, c net.Conn) context.Context { return context.WithValue(ctx, connKey{}, c) }
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.Start()
	t.Cleanup(srv.Close)
	base := &http.Transport{}
	t.Cleanup(base.CloseIdleConnections)
	retrying := &retryingClient{http: &http.Client{Transport: base, Timeout: 10 * time.Second}, retries: 4}
	transport := &http.Client{Transport: &idemhttp.Transport{Base: base, MaxRetryAfter: 100 * time.Millisecond}, Timeout: 10 * time.Second}
	viaTransport := func(ctx context.Context, key, scenario string) (*http.Response, error) {
		req, _ := http.NewRequestWithContext(idemhttp.WithKey(ctx, key), http.MethodPost, srv.URL+"/charges?currency=eur", strings.NewReader("4200"))
		req.Header.Set("X-Scenario", scenario)
		return transport.Do(req)
	}
	type job struct{ client, scenario, key string }
	var jobs []job
	for _, client := range []string{"retrying", "transport"} {
		for _, scenario := range []string{"ok", "lost", "5xx", "panic", "timeout"} {
			for i := 0; i < 3; i++ {
				j := job{client, scenario, key()}
				started[j.key] = make(chan struct{})
				jobs = append(jobs, j)
			}
		}
	}
	send := func(j job) (*http.Response, error) {
		// A client timeout: the client's patience ends while the handler runs.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		if j.scenario == "timeout" {
			go func() {
				select {
				case <-started[j.key]:
					cancel()
				case <-ctx.Done():
				}
			}()
		}
		if j.client == "transport" {
			return viaTransport(ctx, j.key, j.scenario)
		}
		return retrying.post(ctx, srv.URL+"/charges?currency=eur", j.key, "4200", "X-Scenario", j.scenario)
	}
	var wg sync.WaitGroup
	for _, j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if resp, err := send(j); err == nil {
				resp.Body.Close()
			}
		}()
	}
	wg.Wait()
	close(slow)
	for deadline := time.Now().Add(20 * time.Second); inflight.Load() > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("handlers still running after 20s")
		}
	}
	// Every key's answer now, after its lease.
	for _, j := range jobs {
		r, b := untilNot409(t, srv.URL, j.key, "4200", "X-Scenario", "check")
		mu.Lock()
		n := effects[j.key]
		mu.Unlock()
		switch {
		case n != 1:
			t.Errorf("%s client, %s: the effect ran %d times for key %s", j.client, j.scenario, n, j.key)
		case j.scenario == "5xx" || j.scenario == "panic":
			if r.StatusCode != http.StatusInternalServerError || !strings.Contains(b, "outcome-unknown") {
				t.Errorf("%s client, %s: the key answers %d %s; want 500 outcome-unknown", j.client, j.scenario, r.StatusCode, b)
			}
		case r.StatusCode != http.StatusCreated || b != "charge "+j.key+" #1" || r.Header.Get(idemhttp.ReplayedHeader) != "true":
			t.Errorf("%s client, %s: the key answers %d %s; want the first 201, replayed", j.client, j.scenario, r.StatusCode, b)
		}
	}
}
