package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idemhttp"
	"github.com/fencekit/fencekit/internal/idemstores"
)

// stores returns the three stores the middleware is tested on.
func stores(t testing.TB) map[string]idempotency.Store { return idemstores.All(t) }

// charges is a payment handler: it counts its runs and answers 201 with a
// charge id, a Location and a cookie (which must never be recorded).
type charges struct {
	runs    atomic.Int32
	delay   time.Duration
	status  atomic.Int32 // answered status; 0 means 201
	panics  atomic.Bool
	effects sync.Map // effect keys seen
	perKey  sync.Map // Idempotency-Key -> *atomic.Int32: runs with that key
}

func (c *charges) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := c.runs.Add(1)
	k, _ := c.perKey.LoadOrStore(r.Header.Get(idemhttp.Header), new(atomic.Int32))
	k.(*atomic.Int32).Add(1)
	c.effects.Store(idemhttp.EffectKey(r.Context()), true)
	body, _ := io.ReadAll(r.Body)
	if c.panics.Load() {
		panic("handler bug")
	}
	time.Sleep(c.delay)
	status := int(c.status.Load())
	if status == 0 {
		status = http.StatusCreated
	}
	w.Header().Set("Location", fmt.Sprintf("/charges/%d", n))
	w.Header().Set("Set-Cookie", "session=secret")
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"charge":%d,"amount":%q}`, n, body)
}

// ranFor is how many times the handler ran for requests with Idempotency-Key
// key. A test that asserts a key's runs counts these: a server's port can be
// one another test's client still sends to after its own server closed.
func (c *charges) ranFor(key string) int32 {
	if n, ok := c.perKey.Load(key); ok {
		return n.(*atomic.Int32).Load()
	}
	return 0
}

type env struct {
	srv *httptest.Server
	h   *charges
}

func newEnv(t *testing.T, store idempotency.Store, o *idemhttp.Options) *env {
	t.Helper()
	mw, err := idemhttp.Middleware(store, o)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{h: &charges{}}
	e.srv = httptest.NewServer(mw(e.h))
	t.Cleanup(e.srv.Close)
	return e
}

// post sends a POST with key (none when empty) and headers.
func (e *env) post(t *testing.T, key, body string, headers ...string) (*http.Response, string) {
	t.Helper()
	return post(t, e.srv.URL, key, body, headers...)
}

// post sends a POST to url's /charges with key (none when empty) and headers.
func post(t *testing.T, url, key, body string, headers ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+"/charges?currency=eur", strings.NewReader(body))
	if key != "" {
		req.Header.Set(idemhttp.Header, key)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, string(b)
}

// problemCode returns the "code" member of a problem+json body.
func problemCode(t *testing.T, resp *http.Response, body string) string {
	t.Helper()
	if ct := resp.Header.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("status %d with Content-Type %q, want application/problem+json", resp.StatusCode, ct)
	}
	var p struct {
		Code   string `json:"code"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}
	if err := json.Unmarshal([]byte(body), &p); err != nil || p.Status != resp.StatusCode || p.Detail == "" {
		t.Errorf("problem body %q: %v", body, err)
	}
	return p.Code
}

func key() string { return fencetest.Name("key") }

func TestMiddleware(t *testing.T) {
	for name, store := range stores(t) {
		t.Run(name, func(t *testing.T) {
			for _, tc := range []struct {
				name string
				fn   func(*testing.T, idempotency.Store)
			}{
				{"RunsOnceThenReplays", testReplay},
				{"ConcurrentIdentical", testConcurrent},
				{"ConcurrentWaiting", testConcurrentWait},
				{"DroppedResponseThenRetry", testDroppedResponse},
				{"CrashBetweenEffectAndCompletion", testCrash},
				{"FingerprintMismatch", testFingerprint},
				{"OversizedBody", testOversized},
				{"OversizedResponse", testOversizedResponse},
				{"PrincipalScoping", testPrincipals},
				{"ServerErrorAfterEffectKeepsKey", testServerError},
				{"NotSentReleases", testNotSent},
				{"TransportDoesNotMultiply5xx", testTransport5xx},
				{"PanicAfterEffectKeepsKeyAndStack", testPanic},
				{"ClientLeftLeaseRenewed", func(t *testing.T, s idempotency.Store) { testClientLeft(t, s, false) }},
				{"ClientLeftReconcileNotDone", func(t *testing.T, s idempotency.Store) { testClientLeft(t, s, true) }},
				{"DistinctDownstreamKeys", testDownstreamKeys},
				{"ReconcileFindsDownstreamCall", testReconcileDownstream},
				{"NoAnswerAfterClientLeft", testNoAnswer},
				{"DefaultScopeIsCredentials", testDefaultScope},
				{"EarlyHintsKeepStatus", testEarlyHints},
				{"InvalidStatusIsAPanic", testInvalidStatus},
				{"OneEffectPerKeyUnderFaults", testOneEffectPerKey},
				{"ClientErrorIsFinal", testClientError},
				{"KeysAndMethods", testKeys},
			} {
				t.Run(tc.name, func(t *testing.T) { tc.fn(t, store) })
			}
		})
	}
}

func testReplay(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, nil)
	k := key()
	r1, b1 := e.post(t, k, "4200")
	if r1.StatusCode != http.StatusCreated || r1.Header.Get(idemhttp.ReplayedHeader) != "" || r1.Header.Get("Set-Cookie") == "" {
		t.Fatalf("first: %d %v %s", r1.StatusCode, r1.Header, b1)
	}
	for i := 0; i < 3; i++ {
		r, b := e.post(t, k, "4200")
		if r.StatusCode != http.StatusCreated || b != b1 || r.Header.Get("Location") != r1.Header.Get("Location") ||
			r.Header.Get("Content-Type") != "application/json" || r.Header.Get(idemhttp.ReplayedHeader) != "true" {
			t.Fatalf("replay %d: %d %v %s; want the first response, marked replayed", i, r.StatusCode, r.Header, b)
		}
		if r.Header.Get("Set-Cookie") != "" {
			t.Errorf("replay %d sent the first response's Set-Cookie", i)
		}
	}
	if n := e.h.runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
	if _, ok := e.h.effects.Load(""); ok {
		t.Error("the handler had no effect key in its context")
	}
}

func testConcurrent(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, nil)
	e.h.delay = 200 * time.Millisecond
	k := key()
	var wg sync.WaitGroup
	var created, conflicts, replays atomic.Int32
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, b := e.post(t, k, "4200")
			switch {
			case r.StatusCode == http.StatusCreated && r.Header.Get(idemhttp.ReplayedHeader) == "":
				created.Add(1)
			case r.StatusCode == http.StatusCreated:
				replays.Add(1)
			case r.StatusCode == http.StatusConflict && r.Header.Get("Retry-After") != "" && problemCode(t, r, b) == "in-progress":
				conflicts.Add(1)
			default:
				t.Errorf("unexpected answer %d %s", r.StatusCode, b)
			}
		}()
	}
	wg.Wait()
	if n := e.h.runs.Load(); n != 1 || created.Load() != 1 {
		t.Errorf("handler ran %d times, %d original answers; want 1 and 1", n, created.Load())
	}
	t.Logf("1 ran, %d got 409, %d a replay", conflicts.Load(), replays.Load())
}

func testConcurrentWait(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, &idemhttp.Options{Idempotency: &idempotency.Options{Wait: true}})
	e.h.delay = 200 * time.Millisecond
	k := key()
	var wg sync.WaitGroup
	bodies := make(chan string, 6)
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, b := e.post(t, k, "4200")
			if r.StatusCode != http.StatusCreated {
				t.Errorf("waiting request: %d %s", r.StatusCode, b)
			}
			bodies <- b
		}()
	}
	wg.Wait()
	close(bodies)
	first := ""
	for b := range bodies {
		if first == "" {
			first = b
		}
		if b != first {
			t.Errorf("answers differ: %s vs %s", b, first)
		}
	}
	if n := e.h.runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1", n)
	}
}

// dropFirst loses the first response after the server sent it, as a broken
// connection would.
type dropFirst struct {
	base    http.RoundTripper
	dropped atomic.Bool
}

func (d *dropFirst) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := d.base.RoundTrip(r)
	if err == nil && d.dropped.CompareAndSwap(false, true) {
		resp.Body.Close()
		return nil, errors.New("injected: connection reset after the request was processed")
	}
	return resp, err
}

func testDroppedResponse(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, nil)
	client := &http.Client{Transport: &idemhttp.Transport{Base: &dropFirst{base: http.DefaultTransport}}}
	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/charges", strings.NewReader("4200"))
	req = req.WithContext(idemhttp.WithKey(context.Background(), key()))
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("request whose first response was lost: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("the retry: %d %v %s; want the first answer, replayed", resp.StatusCode, resp.Header, b)
	}
	if n := e.h.runs.Load(); n != 1 {
		t.Errorf("handler ran %d times, want 1: one charge", n)
	}
}

// failCompletion loses every completion write, as a crash between the
// handler's effect and the record would.
type failCompletion struct{ idempotency.Store }

func (f failCompletion) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if ch.State == idempotency.Completed && from == idempotency.Armed && ch.Owner != "" {
		return idempotency.Record{}, errors.New("injected: connection lost during completion")
	}
	return f.Store.Update(ctx, k, from, ff, ch)
}

func testCrash(t *testing.T, s idempotency.Store) {
	lease := 300 * time.Millisecond
	crashed := newEnv(t, failCompletion{s}, &idemhttp.Options{Idempotency: &idempotency.Options{Lease: lease, CompleteTimeout: 100 * time.Millisecond}})
	k := key()
	r, _ := crashed.post(t, k, "4200")
	if r.StatusCode != http.StatusCreated {
		t.Fatalf("the crashing attempt still answers its client: %d", r.StatusCode)
	}
	time.Sleep(lease + 100*time.Millisecond)
	plain := newEnv(t, s, &idemhttp.Options{Idempotency: &idempotency.Options{Lease: lease}})
	r, b := plain.post(t, k, "4200")
	if r.StatusCode != http.StatusInternalServerError || problemCode(t, r, b) != "outcome-unknown" {
		t.Fatalf("after the crash, without Reconcile: %d %s; want 500 outcome-unknown", r.StatusCode, b)
	}
	if n := plain.h.ranFor(k); n != 0 {
		t.Errorf("the handler ran again (%d times) although the first attempt may have charged", n)
	} else if n := plain.h.runs.Load(); n != 0 {
		t.Logf("the handler ran %d times for requests with other keys than this test's", n)
	}
	// With a Reconcile hook that finds the charge at the provider.
	k2 := key()
	if r, _ := crashed.post(t, k2, "4200"); r.StatusCode != http.StatusCreated {
		t.Fatal(r.StatusCode)
	}
	time.Sleep(lease + 100*time.Millisecond)
	found := idemhttp.RecordedResponse(http.StatusCreated, http.Header{"Content-Type": {"application/json"}}, []byte(`{"charge":"found"}`))
	rec := newEnv(t, s, &idemhttp.Options{Idempotency: &idempotency.Options{Lease: lease,
		Reconcile: func(context.Context, string) (bool, []byte, error) { return true, found, nil }}})
	r, b = rec.post(t, k2, "4200")
	if r.StatusCode != http.StatusCreated || b != `{"charge":"found"}` || r.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("after the crash, with Reconcile: %d %s", r.StatusCode, b)
	}
	if n := rec.h.ranFor(k2); n != 0 {
		t.Errorf("the handler ran again (%d times) although Reconcile found the charge", n)
	}
}

func testFingerprint(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, &idemhttp.Options{FingerprintHeaders: []string{"X-Currency"}})
	k := key()
	if r, _ := e.post(t, k, "4200", "X-Currency", "eur"); r.StatusCode != http.StatusCreated {
		t.Fatal(r.StatusCode)
	}
	for _, c := range []struct {
		what, body string
		headers    []string
	}{{"another body", "9900", []string{"X-Currency", "eur"}}, {"another fingerprinted header", "4200", []string{"X-Currency", "usd"}}} {
		r, b := e.post(t, k, c.body, c.headers...)
		if r.StatusCode != http.StatusUnprocessableEntity || problemCode(t, r, b) != "key-reused" {
			t.Errorf("same key, %s: %d %s; want 422 key-reused", c.what, r.StatusCode, b)
		}
	}
	if n := e.h.runs.Load(); n != 1 {
		t.Errorf("handler ran %d times", n)
	}
}

func testOversized(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, &idemhttp.Options{MaxBodySize: 16})
	r, b := e.post(t, key(), strings.Repeat("x", 17))
	if r.StatusCode != http.StatusRequestEntityTooLarge || problemCode(t, r, b) != "body-too-large" || e.h.runs.Load() != 0 {
		t.Errorf("oversized body: %d %s, runs %d", r.StatusCode, b, e.h.runs.Load())
	}
	if r, _ := e.post(t, key(), strings.Repeat("x", 16)); r.StatusCode != http.StatusCreated {
		t.Errorf("a body at the limit: %d", r.StatusCode)
	}
}

func testOversizedResponse(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, &idemhttp.Options{MaxResponseSize: 8})
	k := key()
	r, b := e.post(t, k, "4200")
	if r.StatusCode != http.StatusCreated || !strings.Contains(b, "charge") {
		t.Fatalf("first: %d %s", r.StatusCode, b)
	}
	r, b = e.post(t, k, "4200")
	if r.StatusCode != http.StatusInternalServerError || problemCode(t, r, b) != "response-not-stored" || e.h.runs.Load() != 1 {
		t.Errorf("replay of an unrecorded response: %d %s, runs %d", r.StatusCode, b, e.h.runs.Load())
	}
}

func testPrincipals(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, &idemhttp.Options{Principal: func(r *http.Request) (string, error) {
		if u := r.Header.Get("X-User"); u != "" {
			return u, nil
		}
		return "", errors.New("no X-User")
	}})
	k := key()
	ra, ba := e.post(t, k, "4200", "X-User", "alice")
	rb, bb := e.post(t, k, "4200", "X-User", "bob")
	if ra.StatusCode != http.StatusCreated || rb.StatusCode != http.StatusCreated || ba == bb || rb.Header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("two principals, one key: %s / %s; want two separate runs", ba, bb)
	}
	if r, b := e.post(t, k, "4200", "X-User", "bob"); b != bb || r.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Errorf("bob's replay: %s", b)
	}
	if r, b := e.post(t, k, "4200"); r.StatusCode != http.StatusUnauthorized || problemCode(t, r, b) != "unauthenticated" {
		t.Errorf("no principal: %d %s", r.StatusCode, b)
	}
	if n := e.h.runs.Load(); n != 2 {
		t.Errorf("handler ran %d times, want 2", n)
	}
}

func testClientError(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, nil)
	e.h.status.Store(http.StatusPaymentRequired)
	k := key()
	r1, b1 := e.post(t, k, "4200")
	e.h.status.Store(0)
	r2, b2 := e.post(t, k, "4200")
	if r1.StatusCode != http.StatusPaymentRequired || r2.StatusCode != http.StatusPaymentRequired || b1 != b2 || r2.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Errorf("a 4xx is final and replayed: %d %s, then %d %s", r1.StatusCode, b1, r2.StatusCode, b2)
	}
	if n := e.h.runs.Load(); n != 1 {
		t.Errorf("handler ran %d times", n)
	}
}

func testKeys(t *testing.T, s idempotency.Store) {
	e := newEnv(t, s, nil)
	for _, bad := range []string{`""`, strings.Repeat("k", idemhttp.MaxKeyLength+1), `"unclosed`, "two words", "caf\xc3\xa9", `"a\b"`} {
		r, b := e.post(t, bad, "4200")
		if r.StatusCode != http.StatusBadRequest || problemCode(t, r, b) != "malformed-key" {
			t.Errorf("key %q: %d %s; want 400 malformed-key", bad, r.StatusCode, b)
		}
	}
	if e.h.runs.Load() != 0 {
		t.Fatal("the handler ran for a malformed key")
	}
	// The draft's quoted form and the bare form name the same key.
	k := key()
	e.post(t, `"`+k+`"`, "4200")
	if r, _ := e.post(t, k, "4200"); r.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Error(`"key" and key are not one key`)
	}
	// No key: passed through, every time; or 400 when Required.
	e.post(t, "", "4200")
	e.post(t, "", "4200")
	if n := e.h.runs.Load(); n != 3 {
		t.Errorf("runs %d, want 3 (one keyed, two without a key)", n)
	}
	req := newEnv(t, s, &idemhttp.Options{Required: true})
	if r, b := req.post(t, "", "4200"); r.StatusCode != http.StatusBadRequest || problemCode(t, r, b) != "missing-key" {
		t.Errorf("Required, no key: %d %s", r.StatusCode, b)
	}
	// Other methods pass through.
	g, _ := http.NewRequest(http.MethodGet, e.srv.URL, nil)
	g.Header.Set(idemhttp.Header, k)
	resp, err := http.DefaultClient.Do(g)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.Header.Get(idemhttp.ReplayedHeader) != "" || e.h.runs.Load() != 4 {
		t.Errorf("a GET went through the middleware (runs %d)", e.h.runs.Load())
	}
}

// flaky answers 503 a number of times, then passes requests on; it records the
// keys it saw.
type flaky struct {
	fails atomic.Int32
	next  http.Handler
	keys  sync.Map
	seen  atomic.Int32
}

func (f *flaky) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.seen.Add(1)
	f.keys.Store(r.Header.Get(idemhttp.Header), true)
	if f.fails.Add(-1) >= 0 {
		w.Header().Set("Retry-After", "0")
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	f.next.ServeHTTP(w, r)
}

func TestTransport(t *testing.T) {
	s := stores(t)["sqlite"]
	mw, _ := idemhttp.Middleware(s, nil)
	h := &charges{}
	f := &flaky{next: mw(h)}
	srv := httptest.NewServer(f)
	defer srv.Close()
	send := func(tr *idemhttp.Transport, ctx context.Context) *http.Response {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, bytes.NewReader([]byte("4200")))
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	// A keyed request is retried after 503s, with the same key, and runs once.
	f.fails.Store(2)
	k := key()
	if r := send(&idemhttp.Transport{}, idemhttp.WithKey(context.Background(), k)); r.StatusCode != http.StatusCreated {
		t.Fatalf("keyed request after two 503s: %d", r.StatusCode)
	}
	var keys []string
	f.keys.Range(func(k, _ any) bool { keys = append(keys, k.(string)); return true })
	if f.seen.Load() != 3 || len(keys) != 1 || keys[0] != k || h.runs.Load() != 1 {
		t.Errorf("%d attempts with keys %v, runs %d; want 3 attempts, the one key %q, one run", f.seen.Load(), keys, h.runs.Load(), k)
	}
	// The draft's quoted form reaches the same key: a replay.
	if r := send(&idemhttp.Transport{Quote: true}, idemhttp.WithKey(context.Background(), k)); r.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Errorf("the quoted key did not replay: %d", r.StatusCode)
	}
	// Without a key: sent once, no header, no retry.
	f.seen.Store(0)
	f.fails.Store(1)
	if r := send(&idemhttp.Transport{}, context.Background()); r.StatusCode != http.StatusServiceUnavailable || f.seen.Load() != 1 {
		t.Errorf("unkeyed request: %d after %d attempts; want one attempt", r.StatusCode, f.seen.Load())
	}
	// A bounded number of attempts.
	f.seen.Store(0)
	f.fails.Store(100)
	if r := send(&idemhttp.Transport{MaxAttempts: 3}, idemhttp.WithKey(context.Background(), key())); r.StatusCode != http.StatusServiceUnavailable || f.seen.Load() != 3 {
		t.Errorf("always 503: %d after %d attempts; want 3", r.StatusCode, f.seen.Load())
	}
	// The middleware's "outcome unknown" is final: a retry cannot change it.
	unknown := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.seen.Add(1)
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, `{"type":"about:blank","status":500,"code":"outcome-unknown","detail":"x"}`)
	}))
	defer unknown.Close()
	f.seen.Store(0)
	ureq, _ := http.NewRequestWithContext(idemhttp.WithKey(context.Background(), key()), http.MethodPost, unknown.URL, strings.NewReader("4200"))
	uresp, err := (&http.Client{Transport: &idemhttp.Transport{}}).Do(ureq)
	if err != nil {
		t.Fatal(err)
	}
	ub, _ := io.ReadAll(uresp.Body)
	uresp.Body.Close()
	if uresp.StatusCode != http.StatusInternalServerError || f.seen.Load() != 1 || !strings.Contains(string(ub), "outcome-unknown") {
		t.Errorf("outcome unknown: %d after %d attempts, body %q; want one attempt and the body intact", uresp.StatusCode, f.seen.Load(), ub)
	}
	// A large 500 problem body that is not final reaches the caller whole
	// after the last attempt (the transport reads its head to decide).
	big := `{"type":"about:blank","status":500,"code":"other","detail":"` + strings.Repeat("x", 100<<10) + `"}`
	large := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, big)
	}))
	defer large.Close()
	lreq, _ := http.NewRequestWithContext(idemhttp.WithKey(context.Background(), key()), http.MethodPost, large.URL, strings.NewReader("4200"))
	lresp, err := (&http.Client{Transport: &idemhttp.Transport{MaxAttempts: 1}}).Do(lreq)
	if err != nil {
		t.Fatal(err)
	}
	lb, _ := io.ReadAll(lresp.Body)
	lresp.Body.Close()
	if string(lb) != big {
		t.Errorf("a %d-byte 500 problem body reached the caller as %d bytes", len(big), len(lb))
	}
	// A 422 (the key reused with another request) is final.
	f.fails.Store(0)
	f.seen.Store(0)
	req, _ := http.NewRequestWithContext(idemhttp.WithKey(context.Background(), k), http.MethodPost, srv.URL, strings.NewReader("9900"))
	resp, err := (&http.Client{Transport: &idemhttp.Transport{}}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnprocessableEntity || f.seen.Load() != 1 {
		t.Errorf("reused key: %d after %d attempts; want 422 once", resp.StatusCode, f.seen.Load())
	}
}

// A Retry-After too large for a time.Duration is capped at MaxRetryAfter, as
// every other large one is: it must not overflow into "retry at once".
func TestTransportHugeRetryAfter(t *testing.T) {
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("Retry-After", "9300000000") // seconds: over math.MaxInt64 ns
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer srv.Close()
	// The caller's patience ends long before the cap (the default 10s).
	ctx, cancel := context.WithTimeout(idemhttp.WithKey(context.Background(), key()), 2*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("4200"))
	resp, err := (&http.Client{Transport: &idemhttp.Transport{}}).Do(req)
	if err == nil {
		resp.Body.Close()
	}
	if n := hits.Load(); n != 1 {
		t.Fatalf("Retry-After 9300000000: %d attempts before the caller's 2s ended (%v); want 1, then the capped wait", n, err)
	}
}
