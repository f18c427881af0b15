package s3fence_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/smithy-go"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

// faults wraps the in-process S3 server and injects faults into PutObject
// requests on demand.
type faults struct {
	next http.Handler
	mu   sync.Mutex
	// each entry is consumed by one PUT of an object
	plan []string // "drop-response", "409", "412", "500"
	puts atomic.Int32
	reqs atomic.Int32 // every request
	// afterDrop, when set, runs after a dropped response's write was applied
	// and before the connection is closed.
	afterDrop func()
	// clockOffset shifts the Date header of every response: the server's
	// clock as the client sees it, off from the client's own.
	clockOffset atomic.Int64
	// dateLag makes the Date header of every response that much older than
	// the proxy's clock (then truncated to whole seconds by its format), as
	// from a server that caches its Date header; ownDate makes the proxy set
	// every Date from its own clock even when it is not shifted, in place of
	// the server's (versitygw caches its own, so it may be stale already).
	dateLag atomic.Int64
	ownDate atomic.Bool
	// noDate drops the Date header from the answers to PUTs.
	noDate atomic.Bool
	// A "hold" PUT is read whole, then waits for a value on release before
	// it reaches the server (after its client may have given up); the status
	// the server answered goes to landed.
	release, landed chan int
	// held, when set, is told once a "hold" PUT has arrived and waits.
	held chan struct{}
	// failGets, while set, answers every GET of an object with 503.
	failGets atomic.Bool
	// badHeads, while set, answers every HEAD of an object with 400 and no
	// body, as S3 answers a HEAD signed with an expired session token.
	badHeads atomic.Bool
}

// shiftedDate sets the Date header, shifted by offset, when the header is written.
type shiftedDate struct {
	http.ResponseWriter
	offset time.Duration
	wrote  bool
}

func (s *shiftedDate) WriteHeader(code int) {
	if !s.wrote {
		s.wrote = true
		s.Header().Set("Date", time.Now().Add(s.offset).UTC().Format(http.TimeFormat))
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *shiftedDate) Write(b []byte) (int, error) {
	if !s.wrote {
		s.WriteHeader(http.StatusOK)
	}
	return s.ResponseWriter.Write(b)
}

func (s *shiftedDate) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return s.ResponseWriter.(http.Hijacker).Hijack()
}

func (f *faults) inject(kinds ...string) {
	f.mu.Lock()
	f.plan = append(f.plan, kinds...)
	f.mu.Unlock()
}

func (f *faults) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.reqs.Add(1)
	if off := time.Duration(f.clockOffset.Load() - f.dateLag.Load()); off != 0 || f.ownDate.Load() {
		sd := &shiftedDate{ResponseWriter: w, offset: off}
		// A handler that writes nothing still answers (200): with the date.
		defer func() {
			if !sd.wrote {
				sd.WriteHeader(http.StatusOK)
			}
		}()
		w = sd
	}
	if r.Method == http.MethodGet && f.failGets.Load() && strings.Count(strings.Trim(r.URL.Path, "/"), "/") >= 1 {
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>`)
		return
	}
	if r.Method == http.MethodHead && f.badHeads.Load() && strings.Count(strings.Trim(r.URL.Path, "/"), "/") >= 1 {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	if r.Method != http.MethodPut || strings.Count(strings.Trim(r.URL.Path, "/"), "/") < 1 {
		f.next.ServeHTTP(w, r)
		return
	}
	f.puts.Add(1)
	if f.noDate.Load() {
		w.Header()["Date"] = nil // net/http then sends none
	}
	f.mu.Lock()
	var kind string
	if len(f.plan) > 0 {
		kind, f.plan = f.plan[0], f.plan[1:]
	}
	f.mu.Unlock()
	switch kind {
	case "drop-response":
		// Apply the write, then lose the response: the connection dies.
		f.next.ServeHTTP(httptest.NewRecorder(), r)
		f.mu.Lock()
		after := f.afterDrop
		f.mu.Unlock()
		if after != nil {
			after()
		}
		if hj, ok := w.(http.Hijacker); ok {
			if c, _, err := hj.Hijack(); err == nil {
				c.Close()
				return
			}
		}
		panic("cannot drop the response")
	case "hold":
		body, _ := io.ReadAll(r.Body)
		r2 := r.Clone(context.Background())
		r2.Body = io.NopCloser(bytes.NewReader(body))
		if f.held != nil {
			f.held <- struct{}{}
		}
		<-f.release
		rec := httptest.NewRecorder()
		f.next.ServeHTTP(rec, r2)
		f.landed <- rec.Code
	case "409":
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusConflict)
		_, _ = io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>ConditionalRequestConflict</Code><Message>A conflicting conditional operation is in progress.</Message></Error>`)
	case "412":
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusPreconditionFailed)
		_, _ = io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>PreconditionFailed</Code><Message>injected</Message></Error>`)
	case "500":
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>injected</Message></Error>`)
	default:
		f.next.ServeHTTP(w, r)
	}
}

// s3env is one S3 server as a test sees it.
type s3env struct {
	c      *s3.Client
	f      *faults // nil where faults cannot be injected (an external server)
	bucket string
}

func newClient(endpoint, region, access, secret string) *s3.Client {
	return s3.New(s3.Options{
		Region:       region,
		BaseEndpoint: aws.String(endpoint),
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider(access, secret, ""),
		HTTPClient:   &http.Client{Transport: &http.Transport{DialContext: (&net.Dialer{}).DialContext}},
	})
}

func createBucket(t testing.TB, c *s3.Client) string {
	t.Helper()
	bucket := "fence-" + strings.ToLower(fencetest.Name("b")[2:])
	if _, err := c.CreateBucket(context.Background(), &s3.CreateBucketInput{Bucket: aws.String(bucket)}); err != nil {
		t.Fatalf("CreateBucket %s: %v", bucket, err)
	}
	return bucket
}

// fakeS3 starts an in-process S3 (gofakes3 with s3mem) behind httptest with a
// fault injector, and creates a bucket.
func fakeS3(t testing.TB) *s3env {
	t.Helper()
	f := &faults{next: gofakes3.New(s3mem.New()).Server()}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	c := newClient(srv.URL, "us-east-1", "key", "secret")
	return &s3env{c: c, f: f, bucket: createBucket(t, c)}
}

// realS3 connects to the real S3-compatible server of the tests (versitygw,
// started for the test, or FENCEKIT_S3_ENDPOINT). A local server is reached
// through the same fault injector, as a reverse proxy.
func realS3(t testing.TB) *s3env {
	t.Helper()
	srv := testenv.RealS3(t)
	if srv.External {
		c := newClient(srv.Endpoint, srv.Region, srv.AccessKey, srv.SecretKey)
		e := &s3env{c: c, bucket: srv.Bucket}
		if e.bucket == "" {
			e.bucket = createBucket(t, c)
		}
		return e
	}
	target, err := url.Parse(srv.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	f := &faults{next: httputil.NewSingleHostReverseProxy(target)}
	proxy := httptest.NewServer(f)
	t.Cleanup(proxy.Close)
	c := newClient(proxy.URL, srv.Region, srv.AccessKey, srv.SecretKey)
	return &s3env{c: c, f: f, bucket: createBucket(t, c)}
}

// servers runs fn on each S3 server: the in-process gofakes3, and a real one.
//
// The two servers' runs are parallel subtests: each case waits on leases and
// S3's whole-second clock far more than it computes, and the package's time
// is the sum of its cases (so fn must not call t.Parallel itself).
func servers(t *testing.T, fn func(t *testing.T, e *s3env)) {
	t.Run("gofakes3", func(t *testing.T) { t.Parallel(); fn(t, fakeS3(t)) })
	t.Run("real", func(t *testing.T) { t.Parallel(); fn(t, realS3(t)) })
}

// faultServers runs fn, with the fault injector, on each S3 server that is
// reached through one: gofakes3, and versitygw when the tests start it. An
// external server (FENCEKIT_S3_ENDPOINT) has no injector, since a proxy would
// change the Host its requests are signed for: fn is not run on it.
func faultServers(t *testing.T, fn func(t *testing.T, e *s3env, f *faults)) {
	// Parallel subtests, as in servers.
	t.Run("gofakes3", func(t *testing.T) { t.Parallel(); e := fakeS3(t); fn(t, e, e.f) })
	if testenv.ExternalS3() {
		// The fault cases would silently not run on the real server: say so,
		// and fail under CI, which must run them on a local one.
		t.Run("real", func(t *testing.T) {
			const msg = "fault cases not run on a real S3 server: FENCEKIT_S3_ENDPOINT names an external one, and a fault proxy in front of it would change the Host its requests are signed for; unset it to run them on versitygw"
			testenv.SkipUnlessCI(t, msg)
		})
		return
	}
	t.Run("real", func(t *testing.T) { t.Parallel(); e := realS3(t); fn(t, e, e.f) })
}

func newWriter(t testing.TB, e *s3env, o *s3fence.WriterOptions) *s3fence.Writer {
	w, err := s3fence.NewWriter(e.c, e.bucket, o)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestWriterConformance(t *testing.T) { servers(t, testWriterConformance) }

func testWriterConformance(t *testing.T, e *s3env) {
	for _, o := range []struct {
		name string
		opts s3fence.WriterOptions
	}{{"head", s3fence.WriterOptions{}}, {"reuse-etag", s3fence.WriterOptions{ReuseETag: true}}} {
		t.Run(o.name, func(t *testing.T) {
			w := newWriter(t, e, &o.opts)
			fencetest.WriterSuite{
				New: func(t *testing.T) fence.FencedWriter { return w },
				BadKeys: []string{strings.Repeat("k", s3fence.MaxKeyBytes+1), "nul\x00byte", "bad utf-8 \xff",
					// Path spellings a server storing objects as files resolves.
					"a//b", "a/./b", "x/../b", "a/b/", "./a", "/a", ".."},
				Writers:    8,
				WritesEach: 15,
				Faulty:     faultyWriter(e, &o.opts),
			}.Run(t)
		})
	}
}

// TestETagReuse: grant 5 rewrites byte-identical content; a writer holding grant
// 4 that read the ETag before must still be rejected. With a plain body the two
// ETags would be equal and If-Match would let the stale write through.
func TestETagReuse(t *testing.T) { servers(t, testETagReuse) }

func testETagReuse(t *testing.T, e *s3env) {
	c := e.c
	ctx := context.Background()
	w := newWriter(t, e, nil)
	if err := w.Write(ctx, "state", []byte("same bytes"), 4); err != nil {
		t.Fatal(err)
	}
	// The stale writer (grant 4) has read the object and its ETag.
	head, err := c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("state")})
	if err != nil {
		t.Fatal(err)
	}
	// Grant 5 rewrites the same bytes.
	if err := w.Write(ctx, "state", []byte("same bytes"), 5); err != nil {
		t.Fatal(err)
	}
	head5, _ := c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("state")})
	if aws.ToString(head.ETag) == aws.ToString(head5.ETag) {
		t.Fatalf("two writes of the same value share the ETag %s", aws.ToString(head.ETag))
	}
	// The stale writer's conditional PUT with the ETag it read must fail.
	_, err = c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("state"),
		Body: bytes.NewReader([]byte("stale")), IfMatch: head.ETag})
	if err == nil {
		t.Fatal("a PUT conditional on the ETag read before grant 5 was accepted")
	}
	// And through the writer: rejected as stale.
	var se *fence.StaleError
	if err := w.Write(ctx, "state", []byte("same bytes"), 4); !errors.As(err, &se) || se.Current != 5 {
		t.Fatalf("grant 4 after grant 5: %v, want StaleError naming 5", err)
	}
}

// TestAmbiguousSuccess: the first PUT is applied but its response is lost; the
// writer reads the object back and recognises its own write.
func TestAmbiguousSuccess(t *testing.T) { faultServers(t, testAmbiguousSuccess) }

func testAmbiguousSuccess(t *testing.T, e *s3env, f *faults) {
	ctx := context.Background()
	w := newWriter(t, e, nil)
	if err := w.Write(ctx, "k", []byte("v1"), 1); err != nil {
		t.Fatal(err)
	}
	f.inject("drop-response")
	before := f.puts.Load()
	if err := w.Write(ctx, "k", []byte("v2"), 2); err != nil {
		t.Fatalf("write whose response was lost: %v", err)
	}
	if n := f.puts.Load() - before; n != 1 {
		t.Errorf("%d PUTs: want 1 (the landed write recognised by its write id, not written again)", n)
	}
	v, tok, err := w.Read(ctx, "k")
	if err != nil || string(v) != "v2" || tok != 2 {
		t.Errorf("Read = %q, %d, %v; want v2, 2", v, tok, err)
	}
}

// TestAmbiguousThenReplaced: A's PUT lands but its response is lost, and a newer
// grant writes token 2 before A reads again. A's write did land, so A must not
// be told ErrStale ("changed nothing"): it gets ErrUnknown.
func TestAmbiguousThenReplaced(t *testing.T) { faultServers(t, testAmbiguousThenReplaced) }

func testAmbiguousThenReplaced(t *testing.T, e *s3env, f *faults) {
	ctx := context.Background()
	a, b := newWriter(t, e, nil), newWriter(t, e, nil)
	f.mu.Lock()
	f.afterDrop = func() {
		if err := b.Write(ctx, "k", []byte("B"), 2); err != nil {
			t.Errorf("the newer grant's write: %v", err)
		}
	}
	f.mu.Unlock()
	f.inject("drop-response")
	err := a.Write(ctx, "k", []byte("A"), 1)
	if !errors.Is(err, fence.ErrUnknown) || errors.Is(err, fence.ErrStale) {
		t.Fatalf("A's landed-then-replaced write: %v; want ErrUnknown and not ErrStale", err)
	}
	v, tok, err := a.Read(ctx, "k")
	if err != nil || string(v) != "B" || tok != 2 {
		t.Errorf("Read = %q, %d, %v; want B, 2", v, tok, err)
	}
}

// TestServerErrorsThenGiveUp: 5xx on every attempt may each have been applied:
// the writer retries, then gives up with ErrUnknown, not a plain failure.
func TestServerErrorsThenGiveUp(t *testing.T) { faultServers(t, testServerErrorsThenGiveUp) }

func testServerErrorsThenGiveUp(t *testing.T, e *s3env, f *faults) {
	ctx := context.Background()
	w := newWriter(t, e, &s3fence.WriterOptions{MaxAttempts: 3})
	f.inject("500", "500", "500")
	err := w.Write(ctx, "k-500", []byte("v"), 1)
	if !errors.Is(err, fence.ErrUnknown) || !errors.Is(err, s3fence.ErrContention) {
		t.Fatalf("500 on every attempt: %v, want ErrUnknown", err)
	}
}

// TestConflictThenSuccess: a 409 ConditionalRequestConflict makes the writer read
// and try again; a 500 is retried by the SDK. Nothing is lost, nothing stale lands.
func TestConflictThenSuccess(t *testing.T) { faultServers(t, testConflictThenSuccess) }

func testConflictThenSuccess(t *testing.T, e *s3env, f *faults) {
	ctx := context.Background()
	w := newWriter(t, e, nil)
	for _, kind := range []string{"409", "500"} {
		f.inject(kind)
		if err := w.Write(ctx, "k-"+kind, []byte("v"), 3); err != nil {
			t.Fatalf("write after an injected %s: %v", kind, err)
		}
		v, tok, err := w.Read(ctx, "k-"+kind)
		if err != nil || string(v) != "v" || tok != 3 {
			t.Errorf("after %s: Read = %q, %d, %v", kind, v, tok, err)
		}
	}
	// 409 on every attempt: the writer gives up with ErrContention.
	w2 := newWriter(t, e, &s3fence.WriterOptions{MaxAttempts: 3})
	f.inject("409", "409", "409")
	if err := w2.Write(ctx, "k-busy", []byte("v"), 1); !errors.Is(err, s3fence.ErrContention) {
		t.Fatalf("409 on every attempt: %v, want ErrContention", err)
	}
	if _, _, err := w2.Read(ctx, "k-busy"); !errors.Is(err, fence.ErrNotFound) {
		t.Errorf("an object appeared after every PUT was refused: %v", err)
	}
}

// TestUnfencedObjects: an object another tool wrote counts as token 0, or is
// refused with RefuseUnfenced.
func TestUnfencedObjects(t *testing.T) { servers(t, testUnfencedObjects) }

func testUnfencedObjects(t *testing.T, e *s3env) {
	c := e.c
	ctx := context.Background()
	if _, err := c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("legacy"),
		Body: strings.NewReader("plain bytes")}); err != nil {
		t.Fatal(err)
	}
	strict := newWriter(t, e, &s3fence.WriterOptions{RefuseUnfenced: true})
	if err := strict.Write(ctx, "legacy", []byte("x"), 1); !errors.Is(err, s3fence.ErrUnfenced) {
		t.Errorf("RefuseUnfenced write over a legacy object: %v", err)
	}
	if _, _, err := strict.Read(ctx, "legacy"); !errors.Is(err, s3fence.ErrUnfenced) {
		t.Errorf("RefuseUnfenced read of a legacy object: %v", err)
	}
	lax := newWriter(t, e, nil)
	v, tok, err := lax.Read(ctx, "legacy")
	if err != nil || string(v) != "plain bytes" || tok != 0 {
		t.Errorf("legacy read: %q, %d, %v", v, tok, err)
	}
	if err := lax.Write(ctx, "legacy", []byte("fenced now"), 1); err != nil {
		t.Fatalf("write over a legacy object: %v", err)
	}
	v, tok, err = lax.Read(ctx, "legacy")
	if err != nil || string(v) != "fenced now" || tok != 1 {
		t.Errorf("after the fenced write: %q, %d, %v", v, tok, err)
	}
}

// TestReuseETagSeesOtherWriters: a writer reusing its last ETag still notices a
// newer writer (the PUT's precondition fails) and is rejected as stale.
func TestReuseETagSeesOtherWriters(t *testing.T) { servers(t, testReuseETagSeesOtherWriters) }

func testReuseETagSeesOtherWriters(t *testing.T, e *s3env) {
	ctx := context.Background()
	a := newWriter(t, e, &s3fence.WriterOptions{ReuseETag: true})
	b := newWriter(t, e, nil)
	if err := a.Write(ctx, "k", []byte("a1"), 1); err != nil {
		t.Fatal(err)
	}
	if err := b.Write(ctx, "k", []byte("b2"), 2); err != nil {
		t.Fatal(err)
	}
	if err := a.Write(ctx, "k", []byte("a1 again"), 1); !errors.Is(err, fence.ErrStale) {
		t.Fatalf("a reusing its ETag after b's newer write: %v, want ErrStale", err)
	}
	v, _, _ := a.Read(ctx, "k")
	if string(v) != "b2" {
		t.Errorf("stored %q, want b2", v)
	}
}

func TestBadOptions(t *testing.T) { servers(t, testBadOptions) }

func testBadOptions(t *testing.T, e *s3env) {
	c := e.c
	if _, err := s3fence.NewWriter(c, "", nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("empty bucket: %v", err)
	}
	if _, err := s3fence.NewWriter(c, "b", &s3fence.WriterOptions{MaxAttempts: -1}); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("negative MaxAttempts: %v", err)
	}
	var nilClient *s3.Client
	if _, err := s3fence.NewWriter(nil, "b", nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("nil api: %v", err)
	}
	if _, err := s3fence.NewWriter(nilClient, "b", nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("nil *s3.Client: %v", err)
	}
	for _, p := range []string{strings.Repeat("p", s3fence.MaxKeyBytes), "bad \xff", "nul\x00"} {
		if _, err := s3fence.NewWriter(c, "b", &s3fence.WriterOptions{Prefix: p}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("prefix %.20q: %v", p, err)
		}
	}
	// The prefix counts towards S3's key limit. The key is in parts of 100
	// bytes: versitygw's posix backend stores each part as a file name, which
	// the file system limits to 255 bytes.
	long := strings.Repeat(strings.Repeat("k", 99)+"/", 10) + strings.Repeat("k", s3fence.MaxKeyBytes-4-1000)
	w := newWriter(t, e, &s3fence.WriterOptions{Prefix: "app/"})
	if err := w.Write(context.Background(), long+"k", []byte("v"), 1); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("a key that fits only without the prefix: %v", err)
	}
	if err := w.Write(context.Background(), long, []byte("v"), 1); err != nil {
		t.Errorf("a key that fits with the prefix: %v", err)
	}
}

// TestConditionalPutSemantics records how the server answers the conditional
// PUTs the writer relies on, and checks that each answer is one the writer
// reads as "changed in between" (412, 409, or NoSuchKey for If-Match on a
// missing key) and that none of them wrote anything. The README's S3 section
// lists the answers of each server.
func TestConditionalPutSemantics(t *testing.T) { servers(t, testConditionalPutSemantics) }

func testConditionalPutSemantics(t *testing.T, e *s3env) {
	ctx := context.Background()
	put := func(key, body string, ifMatch, ifNoneMatch *string) error {
		_, err := e.c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key),
			Body: strings.NewReader(body), IfMatch: ifMatch, IfNoneMatch: ifNoneMatch})
		return err
	}
	describe := func(err error) string {
		var ae smithy.APIError
		var re *awshttp.ResponseError
		code, status := "", 0
		if errors.As(err, &ae) {
			code = ae.ErrorCode()
		}
		if errors.As(err, &re) {
			status = re.HTTPStatusCode()
		}
		return fmt.Sprintf("%d %s", status, code)
	}
	if err := put("exists", "v1", nil, nil); err != nil {
		t.Fatal(err)
	}
	head, err := e.c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("exists")})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		what                 string
		key                  string
		ifMatch, ifNoneMatch *string
		want                 []string // accepted answers: "status code"
	}{
		{"If-Match on a missing key", "missing", aws.String(`"0123456789abcdef0123456789abcdef"`), nil, []string{"404 NoSuchKey", "412 PreconditionFailed"}},
		{"If-Match with another ETag", "exists", aws.String(`"0123456789abcdef0123456789abcdef"`), nil, []string{"412 PreconditionFailed"}},
		{"If-None-Match: * on an existing key", "exists", nil, aws.String("*"), []string{"412 PreconditionFailed"}},
	} {
		err := put(c.key, "should not land", c.ifMatch, c.ifNoneMatch)
		got := describe(err)
		t.Logf("%s: %s", c.what, got)
		ok := false
		for _, w := range c.want {
			ok = ok || got == w
		}
		if err == nil || !ok {
			t.Errorf("%s: answered %q (err %v), want one of %v", c.what, got, err, c.want)
		}
	}
	out, err := e.c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("exists")})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(out.Body)
	out.Body.Close()
	if string(b) != "v1" {
		t.Errorf("a refused conditional PUT changed the object to %q", b)
	}
	if _, err := e.c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("missing")}); err == nil {
		t.Error("a refused If-Match PUT created the missing key")
	}
	if err := put("exists", "v2", head.ETag, nil); err != nil {
		t.Errorf("If-Match with the current ETag: %v", err)
	}
}

// TestHeadBadRequestNotTheKey: a 400 on HEAD says the key is
// refused only when the server takes a HEAD of a short key: S3 answers 400
// with no body to any HEAD signed with an expired session token, and a short
// key refused so is no invalid input (ErrInvalid tells the caller never to
// try again).
func TestHeadBadRequestNotTheKey(t *testing.T) { faultServers(t, testHeadBadRequestNotTheKey) }

func testHeadBadRequestNotTheKey(t *testing.T, e *s3env, f *faults) {
	w := newWriter(t, e, nil)
	f.badHeads.Store(true)
	defer f.badHeads.Store(false)
	err := w.Write(context.Background(), fencetest.Name("k"), []byte("v"), 1)
	if err == nil || errors.Is(err, fence.ErrInvalid) {
		t.Errorf("a short key whose HEAD got 400, as every HEAD did: %v, want an error that is not ErrInvalid", err)
	}
}
