package idemhttp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/fencekit/fencekit/fence"
)

type keyCtx struct{}

// WithKey returns a context whose requests, sent through Transport, carry key
// as their Idempotency-Key. Inside an idempotency.Do effect, pass the effect
// key: every attempt family then has one key, and a takeover after a crash
// has another.
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyCtx{}, key)
}

// requestKey is the key a request carries: WithKey's, else, inside a handler
// behind the middleware, a key of its own for this call (see CallKey).
func requestKey(req *http.Request) string {
	if k, _ := req.Context().Value(keyCtx{}).(string); k != "" {
		return k
	}
	if a := attemptOf(req.Context()); a != nil {
		return a.nextCallKey(req.Method, req.URL.Host, req.URL.Path)
	}
	return ""
}

// Transport is an http.RoundTripper for calls to services that deduplicate by
// Idempotency-Key. A request whose context holds a key (WithKey; or, from a
// handler behind the middleware, a key derived for each call from the
// attempt's effect key: the n-th call with one method to one host and path,
// see CallKey) and whose method is one of Methods gets the header
// (unless it has one) and is retried, with the same key, after a transport
// error or a 409, 429, 500, 502, 503 or 504 (but not the middleware's final
// 500s: outcome unknown, response not kept), waiting as Retry-After says (at
// most MaxRetryAfter) or with jittered backoff, at most MaxAttempts times in
// all. Any other answer is final (a 422 says the key was reused with another
// request; a 4xx is the provider's decision). Retrying a 5xx is safe only
// because the key goes with it: this package's middleware answers a retry
// after a 5xx with 409 while the first attempt's lease lasts, then with what
// its Reconcile hook found or a final outcome-unknown, and never runs the
// handler again; a provider that releases its key on a 5xx would. A request without a key is sent
// once, as it is: retrying it could run it twice. A derived key counts calls,
// so a retry made around Transport (a handler's own retry loop, a retrying
// client whose transport this is) is the next call, with a new key, and a
// provider runs it again: let Transport do the retries, or name the call
// (WithKey(ctx, CallKey(ctx, name))) so that every send of it has one key.
// A retry needs the request's
// GetBody (http.NewRequest sets it for in-memory bodies); without it there is
// none.
type Transport struct {
	// Base sends the requests. Default: http.DefaultTransport.
	Base http.RoundTripper
	// Methods are the methods that get a key. Default: POST and PATCH.
	Methods []string
	// MaxAttempts bounds the attempts of one request. Default: 4.
	MaxAttempts int
	// MaxRetryAfter caps the wait a Retry-After asks for. Default: 10s.
	MaxRetryAfter time.Duration
	// Quote sends the key as a structured field string ("key"), the draft's
	// form; otherwise it is sent bare, as Stripe's API takes it. Default: bare.
	Quote bool
}

// RoundTrip sends req, adding the key and retrying as the type describes.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	methods := t.Methods
	if len(methods) == 0 {
		methods = []string{http.MethodPost, http.MethodPatch}
	}
	key := ""
	if slices.Contains(methods, req.Method) {
		key = requestKey(req)
	}
	keyed := key != ""
	if !keyed {
		return base.RoundTrip(req)
	}
	if _, err := ParseKey(key); err != nil && !t.Quote {
		return nil, &fence.InvalidError{Op: "idemhttp transport", Arg: "key", Reason: err.Error()}
	}
	attempts := t.MaxAttempts
	if attempts <= 0 {
		attempts = 4
	}
	maxWait := t.MaxRetryAfter
	if maxWait <= 0 {
		maxWait = 10 * time.Second
	}
	for attempt := 1; ; attempt++ {
		r := req.Clone(req.Context())
		if attempt > 1 {
			body, err := req.GetBody()
			if err != nil {
				return nil, err
			}
			r.Body = body
		}
		if r.Header.Get(Header) == "" {
			r.Header.Set(Header, t.encode(key))
		}
		resp, err := base.RoundTrip(r)
		retry := err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
		if err == nil {
			retry = retryable(resp.StatusCode) && !finalProblem(resp)
		}
		if !retry || attempt >= attempts || (req.Body != nil && req.GetBody == nil) {
			return resp, err
		}
		wait := fence.Backoff{Min: 50 * time.Millisecond, Max: time.Second}.Delay(attempt - 1)
		if resp != nil {
			if s, perr := strconv.ParseInt(resp.Header.Get("Retry-After"), 10, 64); perr == nil && s >= 0 {
				wait = maxWait
				if s < int64(maxWait/time.Second)+1 {
					wait = min(time.Duration(s)*time.Second, maxWait)
				}
			}
			resp.Body.Close()
		}
		tm := time.NewTimer(wait)
		select {
		case <-req.Context().Done():
			tm.Stop()
			return nil, context.Cause(req.Context())
		case <-tm.C:
		}
	}
}

func (t *Transport) encode(key string) string {
	if !t.Quote {
		return key
	}
	b := []byte{'"'}
	for i := 0; i < len(key); i++ {
		if key[i] == '"' || key[i] == '\\' {
			b = append(b, '\\')
		}
		b = append(b, key[i])
	}
	return string(append(b, '"'))
}

// finalProblem reports a problem answer of this package's middleware that no
// retry can change: the outcome is unknown until an operator resolves the
// key, or the response was not kept. The head of the body (64 KiB at most)
// is read to tell, and put back in front of the rest.
func finalProblem(resp *http.Response) bool {
	if resp.StatusCode != http.StatusInternalServerError || resp.Header.Get("Content-Type") != "application/problem+json" {
		return false
	}
	rest := resp.Body
	b, err := io.ReadAll(io.LimitReader(rest, 64<<10))
	resp.Body = struct {
		io.Reader
		io.Closer
	}{io.MultiReader(bytes.NewReader(b), rest), rest}
	if err != nil {
		return false
	}
	var p struct {
		Code string `json:"code"`
	}
	_ = json.Unmarshal(b, &p)
	return p.Code == "outcome-unknown" || p.Code == "response-not-stored"
}

// retryable: the answers after which the request, with its key, may be sent
// again: in progress (409), throttled (429), and server errors that say it did
// not finish.
func retryable(status int) bool {
	switch status {
	case http.StatusConflict, http.StatusTooManyRequests, http.StatusInternalServerError,
		http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}
