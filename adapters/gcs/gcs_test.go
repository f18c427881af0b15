package gcsfence_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"cloud.google.com/go/storage"
	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fsouza/fake-gcs-server/fakestorage"
	"google.golang.org/api/googleapi"
	"google.golang.org/api/option"
)

// faults sits in front of the in-process fake-gcs-server and injects faults
// into uploads on demand.
type faults struct {
	next    http.Handler
	mu      sync.Mutex
	plan    []string // each entry is consumed by one upload: "drop-response", "apply-503", "503", "429"
	uploads atomic.Int32
	reqs    atomic.Int32 // every request
	// afterApply, when set, runs after a "drop-response" or "apply-503"
	// upload was applied and before its answer goes out.
	afterApply func()
	// dateOffset shifts the Date header of every answer, as a proxy with
	// its own clock would.
	dateOffset atomic.Int64
	// msTimes truncates the object timestamps in every JSON answer to
	// milliseconds, as GCS writes them (the fake gives microseconds).
	msTimes atomic.Bool
}

// subMillis matches the digits after a timestamp's milliseconds.
var subMillis = regexp.MustCompile(`("(?:updated|timeCreated|timeStorageClassUpdated)":\s*"[^"]*T[0-9:]+\.[0-9]{3})[0-9]*`)

// serveMillis serves r with the object timestamps of the answer truncated to
// milliseconds.
func (f *faults) serveMillis(w http.ResponseWriter, r *http.Request) {
	rec := httptest.NewRecorder()
	f.next.ServeHTTP(rec, r)
	body := subMillis.ReplaceAll(rec.Body.Bytes(), []byte("$1"))
	for k, v := range rec.Header() {
		if k != "Content-Length" {
			w.Header()[k] = v
		}
	}
	w.WriteHeader(rec.Code)
	_, _ = w.Write(body)
}

// applied runs the upload r on the server, then afterApply.
func (f *faults) applied(r *http.Request) {
	f.next.ServeHTTP(httptest.NewRecorder(), r)
	f.mu.Lock()
	after := f.afterApply
	f.mu.Unlock()
	if after != nil {
		after()
	}
}

func (f *faults) inject(kinds ...string) {
	f.mu.Lock()
	f.plan = append(f.plan, kinds...)
	f.mu.Unlock()
}

func (f *faults) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.reqs.Add(1)
	if off := time.Duration(f.dateOffset.Load()); off != 0 {
		w.Header().Set("Date", time.Now().Add(off).UTC().Format(http.TimeFormat))
	}
	next := f.next.ServeHTTP
	if f.msTimes.Load() {
		next = f.serveMillis
	}
	if r.Method != http.MethodPost || !strings.HasPrefix(r.URL.Path, "/upload/") {
		next(w, r)
		return
	}
	f.uploads.Add(1)
	f.mu.Lock()
	var kind string
	if len(f.plan) > 0 {
		kind, f.plan = f.plan[0], f.plan[1:]
	}
	f.mu.Unlock()
	switch kind {
	case "drop-response":
		// Apply the upload, then lose the answer: the connection dies.
		f.applied(r)
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
	case "apply-503":
		// Apply the upload, then answer 503, as a frontend may.
		f.applied(r)
		http.Error(w, `{"error":{"code":503,"message":"injected"}}`, http.StatusServiceUnavailable)
	case "503", "429":
		code := 503
		if kind == "429" {
			code = 429
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		fmt.Fprintf(w, `{"error":{"code":%d,"message":"injected"}}`, code)
	default:
		next(w, r)
	}
}

// gcsEnv is a bucket on a GCS server, with the fault injector in front of it
// when the server is the in-process fake.
type gcsEnv struct {
	c      *storage.Client
	bucket string
	url    string // the fake's address (through f); "" for real GCS
	f      *faults
}

func (e *gcsEnv) b() *storage.BucketHandle { return e.c.Bucket(e.bucket) }

// newClient returns a client of the fake at base with connections of its own.
func newClient(t testing.TB, base string) *storage.Client {
	c, err := storage.NewClient(context.Background(),
		option.WithEndpoint(base+"/storage/v1/"), option.WithoutAuthentication(),
		option.WithHTTPClient(&http.Client{Transport: &http.Transport{}}), storage.WithJSONReads())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// fakeGCS starts an in-process fake-gcs-server behind httptest with a fault
// injector, reached through the real client, and creates a bucket.
func fakeGCS(t testing.TB) *gcsEnv {
	t.Helper()
	srv, err := fakestorage.NewServerWithOptions(fakestorage.Options{NoListener: true, Scheme: "http"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	f := &faults{next: srv.HTTPHandler()}
	hs := httptest.NewServer(f)
	t.Cleanup(hs.Close)
	bucket := "fence-" + strings.ToLower(fencetest.Name("b")[2:])
	srv.CreateBucketWithOpts(fakestorage.CreateBucketOpts{Name: bucket})
	return &gcsEnv{c: newClient(t, hs.URL), bucket: bucket, url: hs.URL, f: f}
}

// realGCS connects to the GCS bucket named by FENCEKIT_GCS_BUCKET (which must
// exist), with Application Default Credentials, at FENCEKIT_GCS_ENDPOINT
// when set (another GCS-compatible server). Without FENCEKIT_GCS_BUCKET the
// test skips: the in-process fake is the server of CI.
func realGCS(t testing.TB) *gcsEnv {
	t.Helper()
	bucket := os.Getenv("FENCEKIT_GCS_BUCKET")
	if bucket == "" {
		t.Skip("no real GCS: set FENCEKIT_GCS_BUCKET (an existing bucket; credentials from Application Default Credentials, FENCEKIT_GCS_ENDPOINT for another server) to run this on it")
	}
	var opts []option.ClientOption
	if ep := os.Getenv("FENCEKIT_GCS_ENDPOINT"); ep != "" {
		opts = append(opts, option.WithEndpoint(ep))
	}
	c, err := storage.NewClient(context.Background(), append(opts, storage.WithJSONReads())...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &gcsEnv{c: c, bucket: bucket}
}

// servers runs fn on the in-process fake and on real GCS (when configured).
func servers(t *testing.T, fn func(t *testing.T, e *gcsEnv)) {
	t.Run("fake", func(t *testing.T) { fn(t, fakeGCS(t)) })
	t.Run("gcs", func(t *testing.T) { fn(t, realGCS(t)) })
}

func newWriter(t testing.TB, e *gcsEnv, o *gcsfence.WriterOptions) *gcsfence.Writer {
	w, err := gcsfence.NewWriter(e.b(), o)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

var badKeys = []string{strings.Repeat("k", gcsfence.MaxKeyBytes+1), "nul\x00byte", "bad utf-8 \xff", "line\nfeed", "carriage\rreturn", ".", ".."}

func TestWriterConformance(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		for _, o := range []struct {
			name string
			opts gcsfence.WriterOptions
		}{{"read", gcsfence.WriterOptions{}}, {"reuse-generation", gcsfence.WriterOptions{ReuseGeneration: true}}} {
			t.Run(o.name, func(t *testing.T) {
				w := newWriter(t, e, &o.opts)
				fencetest.WriterSuite{
					New:        func(t *testing.T) fence.FencedWriter { return w },
					BadKeys:    badKeys,
					Writers:    8,
					WritesEach: 10,
					Faulty:     faultyWriter(e, &o.opts),
				}.Run(t)
			})
		}
	})
}

func status(err error) int {
	var ge *googleapi.Error
	if errors.As(err, &ge) {
		return ge.Code
	}
	return 0
}
