package gcsfence_test

// The in-process waiter line of the GCS acquirer (its waiters queue on a
// wakeup.Line and the head tries first when a release pokes it): the cases
// the object-store adapters share (internal/linetest), against
// fake-gcs-server.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/linetest"
	"github.com/fsouza/fake-gcs-server/fakestorage"
)

// lineLen is gcsfence.LineLen for the shared cases.
func lineLen(a fence.Acquirer, name string) int {
	return gcsfence.LineLen(a.(*gcsfence.Acquirer), name)
}

// acquirerOf returns the factory of acquirers on e's bucket (the zero
// options: newAcquirer's).
func acquirerOf(e *gcsEnv) linetest.NewAcquirer {
	return linetest.Factory(func(t *testing.T) *gcsfence.Acquirer { return newAcquirer(t, e) },
		func(o linetest.Options) (*gcsfence.Acquirer, error) {
			return gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{MaxAttempts: o.MaxAttempts, Backoff: o.Backoff})
		})
}

// lockUploads sits in front of the fake and acts on the uploads whose body
// names one lock object (not the clock object): while armed, the first fail
// of them answer 503 without being applied, and the next is held until a
// value arrives on release; its status then goes to landed.
type lockUploads struct {
	next    http.Handler
	mu      sync.Mutex
	object  string
	skip    int // uploads let through before fail and hold apply
	fail    int
	hold    bool
	held    chan struct{}
	release chan struct{}
	landed  chan int
}

func (h *lockUploads) arm(object string, fail int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.object, h.fail, h.hold = object, fail, true
	h.held, h.release, h.landed = make(chan struct{}, 1), make(chan struct{}), make(chan int, 1)
}

func (h *lockUploads) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || !strings.HasPrefix(r.URL.Path, "/upload/") {
		h.next.ServeHTTP(w, r)
		return
	}
	body, _ := io.ReadAll(r.Body)
	r.Body = io.NopCloser(bytes.NewReader(body))
	h.mu.Lock()
	mine := h.object != "" && (bytes.Contains(body, []byte(h.object)) || strings.Contains(r.URL.RawQuery, h.object))
	var fail, hold bool
	if mine && h.skip > 0 {
		h.skip--
		mine = false
	}
	if mine && h.fail > 0 {
		h.fail--
		fail = true
	} else if mine && h.hold {
		h.hold = false
		hold = true
	}
	held, release, landed := h.held, h.release, h.landed
	h.mu.Unlock()
	switch {
	case fail:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprint(w, `{"error":{"code":503,"message":"injected"}}`)
	case hold:
		held <- struct{}{}
		<-release
		r2 := r.Clone(context.Background())
		r2.Body = io.NopCloser(bytes.NewReader(body))
		rec := httptest.NewRecorder()
		h.next.ServeHTTP(rec, r2)
		landed <- rec.Code
	default:
		h.next.ServeHTTP(w, r)
	}
}

// heldGCS is the in-process fake behind a lockUploads.
func heldGCS(t *testing.T) (*gcsEnv, *lockUploads) {
	t.Helper()
	srv, err := fakestorage.NewServerWithOptions(fakestorage.Options{NoListener: true, Scheme: "http"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	h := &lockUploads{next: srv.HTTPHandler()}
	hs := httptest.NewServer(h)
	t.Cleanup(hs.Close)
	bucket := "fence-" + strings.ToLower(fencetest.Name("b")[2:])
	srv.CreateBucketWithOpts(fakestorage.CreateBucketOpts{Name: bucket})
	return &gcsEnv{c: newClient(t, hs.URL), bucket: bucket, url: hs.URL}, h
}

// armed is a linetest hook on h: on name's lock, the first fail uploads
// after skip answer 503, and the next is held until land.
func armed(h *lockUploads, skip, fail int) func(string) (<-chan struct{}, func() int) {
	return func(name string) (<-chan struct{}, func() int) {
		h.arm(name, fail)
		h.mu.Lock()
		h.skip = skip
		h.mu.Unlock()
		return h.held, func() int { h.release <- struct{}{}; return <-h.landed }
	}
}

func TestWaitingLineReleaseLaterPokesHead(t *testing.T) {
	e, h := heldGCS(t)
	a := newAcquirer(t, e)
	inspected := func(ctx context.Context, name string) string {
		info, err := a.Inspect(ctx, name)
		return fmt.Sprintf("lock now: held %v, %v", info.Held, err)
	}
	// Release's two uploads answer 503; the background one is held.
	linetest.ReleaseLaterPokesHead(t, acquirerOf(e), lineLen, time.Minute, armed(h, 0, 2), "503s", inspected)
}

// TestWaitingLineStuckHead: the stuck head gives up at its deadline while
// its upload still hangs.
func TestWaitingLineStuckHead(t *testing.T) {
	e, h := heldGCS(t)
	// The release passes; the head's grant upload is held.
	linetest.StuckHead(t, acquirerOf(e), lineLen, time.Minute, armed(h, 1, 0), "grant upload", 8*time.Second, false)
}

func TestWaitingLineNoLeaks(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		linetest.NoLeaks(t, acquirerOf(e), lineLen, time.Minute, time.Minute, 5*time.Second)
	})
}

// TestWaitingLineTwoAcquirers: MaxAttempts 1.
func TestWaitingLineTwoAcquirers(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		if e.url == "" {
			t.Skip("the fake only: 48 grants on one object take minutes on GCS")
		}
		own := func(t *testing.T, o linetest.Options) fence.Acquirer {
			return acquirerOf(&gcsEnv{c: newClient(t, e.url), bucket: e.bucket, url: e.url})(t, o)
		}
		linetest.TwoAcquirers(t, own, lineLen, 10*time.Second, 1)
	})
}

func TestWaitingLineCauseStillMatches(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		linetest.CauseStillMatches(t, acquirerOf(e), time.Minute)
	})
}
