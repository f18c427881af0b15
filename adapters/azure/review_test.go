package azfence_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// lateAcquire is an http.RoundTripper in front of the server that holds back
// the first Lease Blob acquire it sees: the caller's call ends only when its
// context does, and the request itself is sent to the server later, when the
// test says so (a request stuck in the network that lands after its sender
// gave up). It counts the answers to release requests that pass through.
type lateAcquire struct {
	base http.RoundTripper

	mu       sync.Mutex
	armed    bool
	held     *http.Request
	releases int
	released chan struct{} // a release answered
}

func (l *lateAcquire) RoundTrip(r *http.Request) (*http.Response, error) {
	action := leaseAction(r)
	l.mu.Lock()
	if l.armed && action == "acquire" {
		l.armed = false
		l.held = r.Clone(context.WithoutCancel(r.Context()))
		l.mu.Unlock()
		<-r.Context().Done()
		return nil, r.Context().Err()
	}
	l.mu.Unlock()
	resp, err := l.base.RoundTrip(r)
	if action == "release" && err == nil {
		l.mu.Lock()
		l.releases++
		l.mu.Unlock()
		select {
		case l.released <- struct{}{}:
		default:
		}
	}
	return resp, err
}

// leaseAction returns the x-ms-lease-action of r ("" for none): azcore sets
// its headers with lower-case keys, which Header.Get does not find.
func leaseAction(r *http.Request) string {
	for k, v := range r.Header {
		if len(v) > 0 && http.CanonicalHeaderKey(k) == "X-Ms-Lease-Action" {
			return v[0]
		}
	}
	return ""
}

// send sends the held acquire now and returns its HTTP status.
func (l *lateAcquire) send(t *testing.T) int {
	l.mu.Lock()
	r := l.held
	l.mu.Unlock()
	if r == nil {
		t.Fatal("no acquire was held back")
	}
	resp, err := l.base.RoundTrip(r)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestAbandonedGrantLandingLate (HAZARDS 6): a TryAcquire whose acquire
// request is still on its way when the caller's context ends gives up, and
// its grant is released in the background "until the release is confirmed or
// the lease has certainly expired". When that acquire lands only after the
// background release has been refused a few times (there was no lease yet),
// the name must still not stay blocked for Azure's 15 s lease: another
// acquirer is granted it well before.
func TestAbandonedGrantLandingLate(t *testing.T) {
	e := newEnv(t)
	if e.srv.External {
		t.Skip("needs the test's own transport to the server")
	}
	late := &lateAcquire{base: &http.Transport{}, released: make(chan struct{}, 100)}
	a := newAcquirer(t, newClientVia(t, e.srv, e.srv.ServiceURL, e.container, late))
	b := newAcquirer(t, e.other(t))
	name := fencetest.Name("late")
	ctx := context.Background()
	l, err := a.TryAcquire(ctx, name, 15*time.Second) // the lock blob exists from here on
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	late.mu.Lock()
	late.armed, late.releases = true, 0
	late.mu.Unlock()
	for len(late.released) > 0 {
		<-late.released // the Release above
	}
	tctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = a.TryAcquire(tctx, name, 15*time.Second)
	cancel()
	if err == nil {
		t.Fatal("TryAcquire with its acquire held back until its context ended: granted")
	}
	t.Logf("TryAcquire gave up: %v", err)
	// The background release is refused while there is no lease: wait for
	// more refusals than it used to take before giving up (4).
	for i := 0; i < 5; i++ {
		select {
		case <-late.released:
		case <-time.After(3 * time.Second):
			late.mu.Lock()
			n := late.releases
			late.mu.Unlock()
			t.Logf("the background release stopped after %d answers", n)
			i = 5
		}
	}
	if s := late.send(t); s != http.StatusCreated {
		t.Fatalf("the late acquire: HTTP %d, want 201 (the race did not happen)", s)
	}
	t.Log("the late acquire landed: Azure holds a lease nobody uses")
	start := time.Now()
	actx, cancel := context.WithTimeout(ctx, 8*time.Second)
	defer cancel()
	lb, err := b.Acquire(actx, name, 15*time.Second)
	if err != nil {
		t.Fatalf("another acquirer after the abandoned grant's late acquire landed: %v after %v; the name stays blocked for Azure's lease", err, time.Since(start))
	}
	t.Logf("granted after %v", time.Since(start))
	if err := lb.Release(ctx); err != nil && !errors.Is(err, fence.ErrLost) {
		t.Error(err)
	}
}

// TestOptionsRefusedAtConstruction (HAZARDS 8): an Owner that cannot go into
// an HTTP header as Azure signs it (a line break, a control character,
// non-ASCII, spaces at either end) and a Prefix with a "." or ".." path
// segment made every later call fail (net/http's invalid header value, 403
// AuthorizationFailure from the server, or ErrInvalid for every name): the
// constructors must refuse them with fence.ErrInvalid instead. The same
// options, accepted, must work.
func TestOptionsRefusedAtConstruction(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	for _, o := range []*azfence.AcquirerOptions{{Owner: "a\nb"}, {Owner: "a\x01b"}, {Owner: "Zo\u00eb"}, {Owner: " pad"}, {Owner: "pad "},
		{Prefix: "x/./"}, {Prefix: "../"}, {Prefix: "x/../y/"}} {
		a, err := azfence.NewAcquirer(e.c, o)
		if errors.Is(err, fence.ErrInvalid) {
			continue
		}
		if err != nil {
			t.Errorf("NewAcquirer(%#v): %v, want ErrInvalid", *o, err)
			continue
		}
		l, err := a.TryAcquire(ctx, fencetest.Name("opt"), 15*time.Second)
		if err == nil {
			_ = l.Release(ctx)
		}
		t.Errorf("NewAcquirer(%#v) accepted the options; TryAcquire then: %v", *o, err)
	}
	for _, o := range []*azfence.Options{{Prefix: "x/./"}, {Prefix: "../"}, {Prefix: "x/../y/"}} {
		w, err := azfence.New(e.c, o)
		if errors.Is(err, fence.ErrInvalid) {
			continue
		}
		if err != nil {
			t.Errorf("New(%#v): %v, want ErrInvalid", *o, err)
			continue
		}
		t.Errorf("New(%#v) accepted the options; Write then: %v", *o, w.Write(ctx, fencetest.Name("opt"), []byte("v"), 1))
	}
	// Near misses that Azure stores as given are accepted and work.
	for _, o := range []*azfence.AcquirerOptions{{Owner: "host-1/42 (worker a)"}, {Prefix: "x/.y/"}, {Prefix: "x/."}, {Prefix: "..x/"}} {
		a, err := azfence.NewAcquirer(e.c, o)
		if err != nil {
			t.Errorf("NewAcquirer(%#v): %v", *o, err)
			continue
		}
		l, err := a.TryAcquire(ctx, fencetest.Name("opt"), 15*time.Second)
		if err != nil {
			t.Errorf("NewAcquirer(%#v), then TryAcquire: %v", *o, err)
			continue
		}
		if err := l.Release(ctx); err != nil {
			t.Error(err)
		}
	}
	for _, o := range []*azfence.Options{{Prefix: "x/."}, {Prefix: "x/.y/"}} {
		w := newWriter(t, e.c, o)
		if err := w.Write(ctx, fencetest.Name("opt"), []byte("v"), 1); err != nil {
			t.Errorf("New(%#v), then Write: %v", *o, err)
		}
	}
}
