// Package idemhttp puts idempotency keys on HTTP: a server middleware for the
// Idempotency-Key request header (draft-ietf-httpapi-idempotency-key-header,
// and the way Stripe's API uses it), and a client transport that sends one key
// per attempt family and retries only when the key makes a retry safe.
//
// # Server
//
// [Middleware] wraps a handler. For a request with one of its methods (POST and
// PATCH by default) and an Idempotency-Key header, it runs the handler at most
// once per key, through [idempotency.Do] on the store, records the response
// (status, the allowed headers, body) and replays it to every later request
// with the same key, marked with "Idempotent-Replayed: true". "At most once"
// lasts as long as the key's record: Options.Idempotency.Retention after the
// answer (24h by default; idempotency.Forever keeps it), and within one
// scope (see Options.Principal). The answers:
//
//   - no key: passed through, or 400 when Options.Required;
//   - a malformed key (empty, over 255 characters, not a draft string): 400;
//   - the same key with another request (method, path and query, body digest,
//     and the headers in Options.FingerprintHeaders): 422;
//   - the key in progress elsewhere: 409 with Retry-After (or a wait, with
//     Options.Wait);
//   - a request body over Options.MaxBodySize: 413;
//   - the handler answered 1xx-4xx: recorded as final and replayed (1xx
//     interim answers such as 103 Early Hints are not recorded, and not sent);
//   - the handler called [NotSent] on its request: its answer is sent once and
//     not recorded, and the key is released: the request may run again;
//   - the handler answered 5xx, panicked, or returned without answering after
//     its client left, and did not call NotSent: the effect may have
//     happened, so the key stays armed: a retry gets 409 while its lease
//     lasts, then what the Reconcile hook finds (the effect done: its result
//     replayed; not done: the handler runs again under a new effect key), or
//     without a hook 500 outcome-unknown until an operator resolves the key
//     (idempotency.Resolve). The 5xx itself goes to its client as it is; a
//     panic goes on to the server, with the handler's stack;
//   - the outcome is unknown (the server stopped between the handler and the
//     record, and no Reconcile hook could tell): 500.
//
// While the handler runs, its key's lease is renewed, also after its client
// left (the request's context is then cancelled): no retry takes the key over
// from a handler that is still running.
//
// Errors are problem details (RFC 9457, application/problem+json). Keys are
// scoped by Options.Principal (by default, the request's credentials), so one
// client cannot replay another's response by sending its key. The handler
// finds the attempt's effect key with [EffectKey], and a key for each call it
// makes downstream with [CallKey] (Transport derives one by itself); a
// Reconcile hook, given an attempt's effect key, finds those calls' keys with
// [CallKeyFor].
//
// # Client
//
// [Transport] adds an Idempotency-Key to outbound requests whose context holds a
// key ([WithKey], or inside a handler behind the middleware a key of each call's
// own, derived from the attempt's effect key), and
// retries such a request, with the same key, after a transport error or an
// answer that says the request did not finish (409, 429, 5xx), a bounded
// number of times: with the key, a provider that deduplicates runs it once.
// Requests without a key are sent once, as they are.
package idemhttp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
)

// Header is the request header that carries the key.
const Header = "Idempotency-Key"

// ReplayedHeader marks a replayed response.
const ReplayedHeader = "Idempotent-Replayed"

// MaxKeyLength is the longest key the middleware accepts, in characters.
const MaxKeyLength = 255

// Options configures Middleware. A nil *Options means the defaults.
type Options struct {
	// Methods are the methods the middleware applies to; others pass through.
	// Default: POST and PATCH.
	Methods []string
	// Required answers 400 to a request with one of Methods and no key.
	// Default: false (such a request passes through).
	Required bool
	// Principal returns the authenticated principal of a request; keys are
	// scoped by it, so the same key from two principals names two requests.
	// An error answers 401. Default: the request's credentials, a digest of
	// its Authorization, Cookie, Proxy-Authorization, X-Api-Key, Api-Key and
	// X-Auth-Token headers, so that a response is replayed
	// only to a request with the same credentials. A client whose credentials
	// change between two tries of one request (a refreshed token, a rotated
	// cookie) is then a new request and runs again: set Principal to the
	// authenticated identity whenever that can happen, and whenever
	// credentials come in another header or a TLS client certificate.
	Principal func(r *http.Request) (string, error)
	// FingerprintHeaders are request headers that, beside the method, the path
	// and query and the body, make two requests the same. Default: none.
	FingerprintHeaders []string
	// RecordHeaders are the response headers recorded and replayed.
	// Set-Cookie is never recorded. Default: Content-Type, Content-Language,
	// Location, Cache-Control, ETag, Last-Modified.
	RecordHeaders []string
	// MaxBodySize bounds the request body, which is read whole to digest it
	// (413 above it). Default: 1 MiB.
	MaxBodySize int64
	// MaxResponseSize bounds a recorded response body. A larger response is
	// sent once; later requests with its key get 500, naming the cause, and the
	// handler does not run again. Every response to a request with a key is
	// held in memory whole until it is recorded, whatever its size: do not put
	// the middleware in front of handlers that stream large bodies.
	// At most MaxRecordSize. Default: 1 MiB.
	MaxResponseSize int
	// Idempotency configures idempotency.Do (lease, retention, Wait, Reconcile,
	// Owner), checked as idempotency.Options.Validate does. Its MaxResultSize
	// is set from MaxResponseSize.
	Idempotency *idempotency.Options
}

// MaxRecordSize is the largest Options.MaxResponseSize: a recorded response
// is stored in one value at the store, which none of the stores takes much
// larger.
const MaxRecordSize = 256 << 20

var standardMethods = []string{http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
	http.MethodDelete, http.MethodConnect, http.MethodOptions, http.MethodTrace}

var defaultRecordHeaders = []string{"Content-Type", "Content-Language", "Location", "Cache-Control", "ETag", "Last-Modified"}

type middleware struct {
	store  idempotency.Store
	o      Options
	do     idempotency.Options
	record map[string]bool
}

// Middleware returns the middleware on store. It returns an error matching
// fence.ErrInvalid, naming the option, for a nil store, an empty method or a
// standard one not in capitals ("post"), a negative size, a
// MaxResponseSize over MaxRecordSize, or Idempotency options that
// idempotency.Do would refuse.
func Middleware(store idempotency.Store, opts *Options) (func(http.Handler) http.Handler, error) {
	if store == nil {
		return nil, &fence.InvalidError{Op: "idemhttp", Arg: "store", Reason: "nil"}
	}
	m := &middleware{store: store}
	if opts != nil {
		m.o = *opts
	}
	switch {
	case m.o.MaxBodySize < 0:
		return nil, &fence.InvalidError{Op: "idemhttp", Arg: "MaxBodySize", Reason: fmt.Sprintf("%d is negative", m.o.MaxBodySize)}
	case m.o.MaxResponseSize < 0 || m.o.MaxResponseSize > MaxRecordSize:
		return nil, &fence.InvalidError{Op: "idemhttp", Arg: "MaxResponseSize", Reason: fmt.Sprintf("%d is outside 0..%d (MaxRecordSize)", m.o.MaxResponseSize, MaxRecordSize)}
	}
	for _, method := range m.o.Methods {
		// Methods are case-sensitive: "post" names no request a client sends
		// as POST, which would then pass through without its key.
		if up := strings.ToUpper(method); method == "" || (up != method && slices.Contains(standardMethods, up)) {
			return nil, &fence.InvalidError{Op: "idemhttp", Arg: "Methods", Reason: fmt.Sprintf("%q is not a method (methods are case-sensitive: %s)", method, up)}
		}
	}
	if err := m.o.Idempotency.Validate(); err != nil {
		var ie *fence.InvalidError
		if errors.As(err, &ie) {
			return nil, &fence.InvalidError{Op: "idemhttp", Arg: "Idempotency." + ie.Arg, Reason: ie.Reason}
		}
		return nil, err
	}
	if len(m.o.Methods) == 0 {
		m.o.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if m.o.MaxBodySize == 0 {
		m.o.MaxBodySize = 1 << 20
	}
	if m.o.MaxResponseSize == 0 {
		m.o.MaxResponseSize = 1 << 20
	}
	if m.o.RecordHeaders == nil {
		m.o.RecordHeaders = defaultRecordHeaders
	}
	m.record = map[string]bool{}
	for _, h := range m.o.RecordHeaders {
		if c := http.CanonicalHeaderKey(h); c != "Set-Cookie" {
			m.record[c] = true
		}
	}
	if m.o.Idempotency != nil {
		m.do = *m.o.Idempotency
	}
	// The recorded result is the response's encoding: its body in base64 and
	// its recorded headers. A body over MaxResponseSize is not recorded at all
	// (see serve); headers over 64 KiB make Do drop the result.
	m.do.MaxResultSize = m.o.MaxResponseSize/3*4 + 8 + 64<<10
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { m.serve(next, w, r) })
	}, nil
}

// ParseKey returns the key of an Idempotency-Key header value: a structured
// field string ("..." with \" and \\ escapes, as the draft defines it), or a
// bare key of visible ASCII characters (as Stripe's clients send it), 1 to
// MaxKeyLength characters either way.
func ParseKey(v string) (string, error) {
	key := v
	if strings.HasPrefix(v, `"`) {
		var b strings.Builder
		i := 1
		for ; i < len(v); i++ {
			c := v[i]
			if c == '\\' {
				i++
				if i == len(v) || (v[i] != '"' && v[i] != '\\') {
					return "", errors.New(`a backslash must escape " or \`)
				}
				b.WriteByte(v[i])
				continue
			}
			if c == '"' {
				break
			}
			if c < 0x20 || c > 0x7e {
				return "", errors.New("a string may hold only printable ASCII characters")
			}
			b.WriteByte(c)
		}
		if i >= len(v) || i != len(v)-1 {
			return "", errors.New("the quoted string is not closed, or something follows it")
		}
		key = b.String()
	} else {
		for i := 0; i < len(v); i++ {
			if c := v[i]; c <= 0x20 || c > 0x7e || c == '"' || c == '\\' {
				return "", fmt.Errorf("byte %#x at %d: a bare key may hold only visible ASCII characters, without quotes or backslashes (quote it as a string otherwise)", c, i)
			}
		}
	}
	switch {
	case key == "":
		return "", errors.New("the key is empty")
	case len(key) > MaxKeyLength:
		return "", fmt.Errorf("the key has %d characters, over %d", len(key), MaxKeyLength)
	}
	return key, nil
}

type attemptCtx struct{}

// attempt is what the middleware tells a handler's run, through its request's
// context: the effect key, the calls made so far, and whether the handler
// said it did nothing.
type attempt struct {
	effectKey string
	notSent   atomic.Bool
	mu        sync.Mutex
	calls     map[string]int
}

func attemptOf(ctx context.Context) *attempt {
	a, _ := ctx.Value(attemptCtx{}).(*attempt)
	return a
}

// EffectKey returns the effect key of the attempt a request runs under, inside
// a handler behind the middleware ("" elsewhere): stable for one attempt, new
// for every takeover. Do not send it as it is to more than one call: derive
// one key per call with CallKey (Transport does so by itself).
func EffectKey(ctx context.Context) string {
	if a := attemptOf(ctx); a != nil {
		return a.effectKey
	}
	return ""
}

// CallKey returns the Idempotency-Key for the downstream call that a handler
// behind the middleware names name: distinct for every name, the same for the
// same name in the same attempt (so the same call, sent again, is
// deduplicated), and new for every takeover. Send it with
// WithKey(ctx, CallKey(ctx, name)). Outside such a handler it returns "".
func CallKey(ctx context.Context, name string) string {
	ek := EffectKey(ctx)
	if ek == "" {
		return ""
	}
	return CallKeyFor(ek, name)
}

// CallKeyFor returns the key that CallKey gives the call named name in the
// attempt whose effect key is effectKey: for a Reconcile hook
// (Options.Idempotency.Reconcile), which is given the effect key of the
// attempt it asks about, and must ask the provider by the keys its calls
// carried. Transport names the n-th keyed call of an attempt with one method
// to one host and path (from 1) "METHOD host/path #n", for example
// "POST api.example.com/v1/charges #1" (the host as in the request's URL,
// with its port if it has one; no query).
func CallKeyFor(effectKey, name string) string {
	if effectKey == "" {
		return ""
	}
	h := sha256.Sum256([]byte(effectKey + "\x00" + name))
	return hex.EncodeToString(h[:16])
}

// nextCallKey is the key Transport gives a keyed call from a handler that
// named none: the n-th call with this method to this host and path in this
// attempt, so that two calls never share a key, and a run of the same
// handler code under the same effect key derives the same keys in the same
// order.
func (a *attempt) nextCallKey(method, host, path string) string {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.calls == nil {
		a.calls = map[string]int{}
	}
	id := method + " " + host + path
	a.calls[id]++
	return CallKeyFor(a.effectKey, fmt.Sprintf("%s #%d", id, a.calls[id]))
}

// NotSent tells the middleware, from a handler, that this request did nothing
// that needs to happen only once (it failed before its effect, or it can
// prove the effect did not happen): its answer is then sent once and not
// recorded, and the key is released, so a retry with the key runs the
// handler again. Call it before the handler returns; it changes nothing once
// the handler panicked (a panic keeps the key armed), and outside the
// middleware.
func NotSent(r *http.Request) {
	if a := attemptOf(r.Context()); a != nil {
		a.notSent.Store(true)
	}
}

// storedResponse is a recorded response, as the store keeps it.
type storedResponse struct {
	Status int                 `json:"s"`
	Header map[string][]string `json:"h,omitempty"`
	Body   []byte              `json:"b,omitempty"`
	// Dropped: the body was over MaxResponseSize and is not kept.
	Dropped bool `json:"d,omitempty"`
}

// RecordedResponse encodes a response the way the middleware records it, for a
// Reconcile hook (Options.Idempotency.Reconcile) that found, elsewhere, what an
// attempt answered: returned as its result, it is replayed like a recorded one.
func RecordedResponse(status int, header http.Header, body []byte) []byte {
	s := storedResponse{Status: status, Header: map[string][]string{}, Body: body}
	for name, v := range header {
		if c := http.CanonicalHeaderKey(name); c != "Set-Cookie" {
			s.Header[c] = v
		}
	}
	b, _ := json.Marshal(s)
	return b
}

// unrecorded is a handler's answer that is sent to its client once and not
// recorded: after NotSent (the key is released), or a 5xx (the key stays
// armed: the effect may have happened).
type unrecorded struct {
	resp *storedResponse
	why  string
}

func (u *unrecorded) Error() string { return "idemhttp: the handler " + u.why }

// errNoAnswer: the handler returned without answering after its client left.
var errNoAnswer = errors.New("idemhttp: the handler returned without answering after its client left")

func (m *middleware) serve(next http.Handler, w http.ResponseWriter, r *http.Request) {
	if !slices.Contains(m.o.Methods, r.Method) {
		next.ServeHTTP(w, r)
		return
	}
	values := r.Header.Values(Header)
	if len(values) == 0 {
		if m.o.Required {
			problem(w, http.StatusBadRequest, "missing-key", "Idempotency-Key required", fmt.Sprintf("%s requests to this resource need an %s header.", r.Method, Header))
			return
		}
		next.ServeHTTP(w, r)
		return
	}
	if len(values) > 1 {
		problem(w, http.StatusBadRequest, "malformed-key", "Malformed Idempotency-Key", "The request has more than one Idempotency-Key header.")
		return
	}
	key, err := ParseKey(values[0])
	if err != nil {
		problem(w, http.StatusBadRequest, "malformed-key", "Malformed Idempotency-Key", err.Error()+".")
		return
	}
	principal, err := m.principal(r)
	if err != nil {
		problem(w, http.StatusUnauthorized, "unauthenticated", "Unauthenticated", err.Error())
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.o.MaxBodySize))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			problem(w, http.StatusRequestEntityTooLarge, "body-too-large", "Request body too large",
				fmt.Sprintf("Requests with an Idempotency-Key are read whole; this one is over %d bytes.", m.o.MaxBodySize))
			return
		}
		problem(w, http.StatusBadRequest, "body-unreadable", "Request body unreadable", err.Error())
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))

	var sent *storedResponse // what this request's own handler answered
	res, err := idempotency.Do(r.Context(), m.store, storeKey(principal, key), m.fingerprint(r, body),
		func(ctx context.Context, effectKey string) ([]byte, error) {
			rec := &recorder{header: http.Header{}}
			a := &attempt{effectKey: effectKey}
			// No recover: a panic goes on through Do, which keeps the key
			// armed, to the server, with the handler's stack.
			next.ServeHTTP(rec, r.WithContext(context.WithValue(ctx, attemptCtx{}, a)))
			resp := rec.response()
			switch {
			case a.notSent.Load():
				return nil, idempotency.NotSent(&unrecorded{resp, "said it did nothing (NotSent)"})
			case rec.status == 0 && r.Context().Err() != nil:
				return nil, fmt.Errorf("%w: %w", errNoAnswer, context.Cause(r.Context()))
			case resp.Status >= 500:
				return nil, &unrecorded{resp, fmt.Sprintf("answered %d: it may have taken effect", resp.Status)}
			}
			sent = resp
			stored := sent.recorded(m.record)
			if len(stored.Body) > m.o.MaxResponseSize {
				stored = &storedResponse{Status: sent.Status, Dropped: true}
			}
			return json.Marshal(stored)
		}, &m.do)
	var ur *unrecorded
	var ip *idempotency.InProgressError
	switch {
	case errors.As(err, &ur):
		writeResponse(w, ur.resp, false)
	case sent != nil && (err == nil || errors.Is(err, idempotency.ErrNotRecorded)):
		// This request ran the handler: send its answer (also when the record
		// could not be written; the store keeps the key armed).
		writeResponse(w, sent, false)
	case err == nil:
		var stored storedResponse
		if jerr := json.Unmarshal(res.Value, &stored); jerr != nil {
			problem(w, http.StatusInternalServerError, "corrupt-record", "Recorded response unreadable", jerr.Error())
			return
		}
		if stored.Dropped {
			problem(w, http.StatusInternalServerError, "response-not-stored", "Response not kept",
				fmt.Sprintf("The request with this key completed with status %d, but its response was over %d bytes and was not kept; it will not run again.", stored.Status, m.o.MaxResponseSize))
			return
		}
		writeResponse(w, &stored, true)
	case errors.Is(err, idempotency.ErrFingerprintMismatch):
		problem(w, http.StatusUnprocessableEntity, "key-reused", "Idempotency-Key reused",
			"This key was used with another request (method, path, body or headers differ). Use a new key for a new request.")
	case errors.As(err, &ip):
		secs := int64(math.Ceil(ip.LeaseLeft.Seconds()))
		if secs < 1 {
			secs = 1
		}
		w.Header().Set("Retry-After", strconv.FormatInt(secs, 10))
		problem(w, http.StatusConflict, "in-progress", "Request in progress",
			"A request with this key is being processed; retry after the time in Retry-After.")
	case errors.Is(err, idempotency.ErrResultNotStored):
		problem(w, http.StatusInternalServerError, "response-not-stored", "Response not kept",
			fmt.Sprintf("The request with this key completed, but its response was over %d bytes and was not kept; it will not run again.", m.o.MaxResponseSize))
	case errors.Is(err, idempotency.ErrUnknown):
		problem(w, http.StatusInternalServerError, "outcome-unknown", "Outcome unknown",
			"An earlier attempt with this key stopped after it may have taken effect, and it cannot be told whether it did; it will not be run again until an operator resolves the key.")
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		problem(w, http.StatusServiceUnavailable, "cancelled", "Request cancelled", err.Error())
	default:
		problem(w, http.StatusInternalServerError, "store-error", "Idempotency store unavailable", err.Error())
	}
}

// moreCredentialHeaders are the request headers, beside Authorization and
// Cookie, whose digest is part of the default principal: where HTTP clients
// also carry credentials.
var moreCredentialHeaders = []string{"Proxy-Authorization", "X-Api-Key", "Api-Key", "X-Auth-Token"}

// principal is the scope of a request's keys: Options.Principal's answer, or
// by default a digest of the request's credentials.
func (m *middleware) principal(r *http.Request) (string, error) {
	if m.o.Principal != nil {
		return m.o.Principal(r)
	}
	h := sha256.New()
	fmt.Fprintf(h, "%q\n%q\n", r.Header.Values("Authorization"), r.Header.Values("Cookie"))
	// The other headers count only when present, so that a request with
	// neither keeps the scope it had before they counted.
	for _, name := range moreCredentialHeaders {
		if v := r.Header.Values(name); len(v) > 0 {
			fmt.Fprintf(h, "%s: %q\n", name, v)
		}
	}
	return "\x00credentials:" + hex.EncodeToString(h.Sum(nil)), nil
}

// fingerprint is the digest of what makes two requests the same.
func (m *middleware) fingerprint(r *http.Request, body []byte) string {
	h := sha256.New()
	fmt.Fprintf(h, "%s\n%s\n", r.Method, r.URL.RequestURI())
	for _, name := range m.o.FingerprintHeaders {
		fmt.Fprintf(h, "%s: %q\n", http.CanonicalHeaderKey(name), r.Header.Values(name))
	}
	bd := sha256.Sum256(body)
	h.Write(bd[:])
	return hex.EncodeToString(h.Sum(nil))
}

// storeKey scopes key by principal; the digest keeps it within every store's
// key limits whatever their lengths.
func storeKey(principal, key string) string {
	h := sha256.Sum256([]byte(strconv.Itoa(len(principal)) + ":" + principal + "\x00" + key))
	return "idemhttp:" + hex.EncodeToString(h[:])
}

// recorder buffers a handler's whole response: it is sent after the store has
// recorded it (or released the key, for a 5xx), so its size is bounded only by
// what the handler writes; MaxResponseSize bounds what is recorded.
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header { return r.header }

// WriteHeader keeps the first final status; 1xx interim answers (103 Early
// Hints) are neither kept nor sent, since the answer goes out only after it
// is recorded. A code outside 100-999 panics, as net/http's own WriteHeader
// does: a panic keeps the key armed, and such a status could not be replayed.
func (r *recorder) WriteHeader(status int) {
	if status < 100 || status > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", status))
	}
	if status >= 100 && status < 200 {
		return
	}
	if r.status == 0 {
		r.status = status
	}
}

func (r *recorder) Write(b []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.body.Write(b)
}

// response returns what the handler answered, all its headers included.
func (r *recorder) response() *storedResponse {
	s := &storedResponse{Status: r.status, Header: map[string][]string(r.header), Body: r.body.Bytes()}
	if s.Status == 0 {
		s.Status = http.StatusOK
	}
	if len(s.Body) > 0 && r.header.Get("Content-Type") == "" {
		r.header.Set("Content-Type", http.DetectContentType(s.Body))
	}
	return s
}

// recorded returns the response with only the headers to record.
func (s *storedResponse) recorded(record map[string]bool) *storedResponse {
	c := &storedResponse{Status: s.Status, Header: map[string][]string{}, Body: s.Body}
	for name, v := range s.Header {
		if record[http.CanonicalHeaderKey(name)] {
			c.Header[http.CanonicalHeaderKey(name)] = v
		}
	}
	return c
}

func writeResponse(w http.ResponseWriter, s *storedResponse, replayed bool) {
	for name, v := range s.Header {
		w.Header()[name] = v
	}
	if replayed {
		w.Header().Set(ReplayedHeader, "true")
	}
	w.Header().Set("Content-Length", strconv.Itoa(len(s.Body)))
	w.WriteHeader(s.Status)
	_, _ = w.Write(s.Body)
}

// problem writes an RFC 9457 problem details body: type about:blank with the
// status's own title, the detail, and the extension member "code" naming the
// case (the kinds listed in the package documentation), for clients to branch
// on.
func problem(w http.ResponseWriter, status int, code, title, detail string) {
	b, _ := json.Marshal(map[string]any{
		"type":   "about:blank",
		"title":  http.StatusText(status),
		"status": status,
		"detail": title + ": " + detail,
		"code":   code,
	})
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}
