package s3fence_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

// faults wraps the in-process S3 server and injects faults into PutObject
// requests on demand.
type faults struct {
	next http.Handler
	mu   sync.Mutex
	// each entry is consumed by one PUT of an object
	plan []string // "drop-response", "409", "500"
	puts atomic.Int32
	// afterDrop, when set, runs after a dropped response's write was applied
	// and before the connection is closed.
	afterDrop func()
}

func (f *faults) inject(kinds ...string) {
	f.mu.Lock()
	f.plan = append(f.plan, kinds...)
	f.mu.Unlock()
}

func (f *faults) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPut || strings.Count(strings.Trim(r.URL.Path, "/"), "/") < 1 {
		f.next.ServeHTTP(w, r)
		return
	}
	f.puts.Add(1)
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
	case "409":
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusConflict)
		_, _ = io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>ConditionalRequestConflict</Code><Message>A conflicting conditional operation is in progress.</Message></Error>`)
	case "500":
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/xml")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, `<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>injected</Message></Error>`)
	default:
		f.next.ServeHTTP(w, r)
	}
}

// server starts an in-process S3 (gofakes3 with s3mem) behind httptest with a
// fault injector, creates a bucket, and returns a client of it.
func server(t testing.TB) (*s3.Client, *faults) {
	t.Helper()
	f := &faults{next: gofakes3.New(s3mem.New()).Server()}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	c := s3.New(s3.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(srv.URL),
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider("key", "secret", ""),
		HTTPClient:   &http.Client{Transport: &http.Transport{DialContext: (&net.Dialer{}).DialContext, DisableKeepAlives: false}},
	})
	if _, err := c.CreateBucket(context.Background(), &s3.CreateBucketInput{Bucket: aws.String("fence")}); err != nil {
		t.Fatal(err)
	}
	return c, f
}

func newWriter(t testing.TB, c *s3.Client, o *s3fence.Options) *s3fence.Writer {
	w, err := s3fence.New(c, "fence", o)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestWriterConformance(t *testing.T) {
	c, _ := server(t)
	for _, o := range []struct {
		name string
		opts s3fence.Options
	}{{"head", s3fence.Options{}}, {"reuse-etag", s3fence.Options{ReuseETag: true}}} {
		t.Run(o.name, func(t *testing.T) {
			w := newWriter(t, c, &o.opts)
			fencetest.WriterSuite{
				New:        func(t *testing.T) fence.FencedWriter { return w },
				BadKeys:    []string{strings.Repeat("k", s3fence.MaxKeyBytes+1), "nul\x00byte", "bad utf-8 \xff"},
				Writers:    8,
				WritesEach: 15,
			}.Run(t)
		})
	}
}

// TestETagReuse: grant 5 rewrites byte-identical content; a writer holding grant
// 4 that read the ETag before must still be rejected. With a plain body the two
// ETags would be equal and If-Match would let the stale write through.
func TestETagReuse(t *testing.T) {
	c, _ := server(t)
	ctx := context.Background()
	w := newWriter(t, c, nil)
	if err := w.Write(ctx, "state", []byte("same bytes"), 4); err != nil {
		t.Fatal(err)
	}
	// The stale writer (grant 4) has read the object and its ETag.
	head, err := c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("fence"), Key: aws.String("state")})
	if err != nil {
		t.Fatal(err)
	}
	// Grant 5 rewrites the same bytes.
	if err := w.Write(ctx, "state", []byte("same bytes"), 5); err != nil {
		t.Fatal(err)
	}
	head5, _ := c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String("fence"), Key: aws.String("state")})
	if aws.ToString(head.ETag) == aws.ToString(head5.ETag) {
		t.Fatalf("two writes of the same value share the ETag %s", aws.ToString(head.ETag))
	}
	// The stale writer's conditional PUT with the ETag it read must fail.
	_, err = c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("fence"), Key: aws.String("state"),
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
func TestAmbiguousSuccess(t *testing.T) {
	c, f := server(t)
	ctx := context.Background()
	w := newWriter(t, c, nil)
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
func TestAmbiguousThenReplaced(t *testing.T) {
	c, f := server(t)
	ctx := context.Background()
	a, b := newWriter(t, c, nil), newWriter(t, c, nil)
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
func TestServerErrorsThenGiveUp(t *testing.T) {
	c, f := server(t)
	ctx := context.Background()
	w := newWriter(t, c, &s3fence.Options{MaxAttempts: 3})
	f.inject("500", "500", "500")
	err := w.Write(ctx, "k-500", []byte("v"), 1)
	if !errors.Is(err, fence.ErrUnknown) || !errors.Is(err, s3fence.ErrContention) {
		t.Fatalf("500 on every attempt: %v, want ErrUnknown", err)
	}
}

// TestConflictThenSuccess: a 409 ConditionalRequestConflict makes the writer read
// and try again; a 500 is retried by the SDK. Nothing is lost, nothing stale lands.
func TestConflictThenSuccess(t *testing.T) {
	c, f := server(t)
	ctx := context.Background()
	w := newWriter(t, c, nil)
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
	w2 := newWriter(t, c, &s3fence.Options{MaxAttempts: 3})
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
func TestUnfencedObjects(t *testing.T) {
	c, _ := server(t)
	ctx := context.Background()
	if _, err := c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("fence"), Key: aws.String("legacy"),
		Body: strings.NewReader("plain bytes")}); err != nil {
		t.Fatal(err)
	}
	strict := newWriter(t, c, &s3fence.Options{RefuseUnfenced: true})
	if err := strict.Write(ctx, "legacy", []byte("x"), 1); !errors.Is(err, s3fence.ErrUnfenced) {
		t.Errorf("RefuseUnfenced write over a legacy object: %v", err)
	}
	if _, _, err := strict.Read(ctx, "legacy"); !errors.Is(err, s3fence.ErrUnfenced) {
		t.Errorf("RefuseUnfenced read of a legacy object: %v", err)
	}
	lax := newWriter(t, c, nil)
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
func TestReuseETagSeesOtherWriters(t *testing.T) {
	c, _ := server(t)
	ctx := context.Background()
	a := newWriter(t, c, &s3fence.Options{ReuseETag: true})
	b := newWriter(t, c, nil)
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

func TestBadOptions(t *testing.T) {
	c, _ := server(t)
	if _, err := s3fence.New(c, "", nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("empty bucket: %v", err)
	}
	if _, err := s3fence.New(c, "b", &s3fence.Options{MaxAttempts: -1}); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("negative MaxAttempts: %v", err)
	}
	var nilClient *s3.Client
	if _, err := s3fence.New(nil, "b", nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("nil api: %v", err)
	}
	if _, err := s3fence.New(nilClient, "b", nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("nil *s3.Client: %v", err)
	}
	for _, p := range []string{strings.Repeat("p", s3fence.MaxKeyBytes), "bad \xff", "nul\x00"} {
		if _, err := s3fence.New(c, "b", &s3fence.Options{Prefix: p}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("prefix %.20q: %v", p, err)
		}
	}
	// The prefix counts towards S3's key limit.
	w := newWriter(t, c, &s3fence.Options{Prefix: "app/"})
	if err := w.Write(context.Background(), strings.Repeat("k", s3fence.MaxKeyBytes-3), []byte("v"), 1); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("a key that fits only without the prefix: %v", err)
	}
	if err := w.Write(context.Background(), strings.Repeat("k", s3fence.MaxKeyBytes-4), []byte("v"), 1); err != nil {
		t.Errorf("a key that fits with the prefix: %v", err)
	}
}
