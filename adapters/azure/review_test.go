package azfence_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/bloberror"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/sas"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
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
	localOnly(t, e, "needs the test's own transport to the server")
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

// storedToken returns the token in name's lock blob's metadata.
func storedToken(t *testing.T, e *azenv, name string) fence.Token {
	t.Helper()
	p, err := e.c.NewBlobClient("fencekit-locks/"+name).GetProperties(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range p.Metadata {
		if strings.EqualFold(k, azfence.MetaToken) && v != nil {
			n, err := strconv.ParseUint(*v, 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return fence.Token(n)
		}
	}
	t.Fatalf("lock blob of %q has no token", name)
	return 0
}

// TestLostTokenWriteReply (HAZARDS 3): the grant's second request, the token
// write (Set Blob Metadata under the lease), lands and its reply is lost. The
// grant must still come back with the token the blob holds (recognised by
// its write id), never one below it or one the next grant will repeat; the
// next grant, by another acquirer, is above it.
func TestLostTokenWriteReply(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	localOnly(t, e, "the fault proxy needs a plain-HTTP server")
	c, p := e.proxied(t)
	a, b := newAcquirer(t, c), newAcquirer(t, e.other(t))
	ctx := context.Background()
	name := fencetest.Name("lostmeta")
	l, err := a.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t0 := l.Token()
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for _, round := range []string{"remembered ETag", "after another acquirer"} {
		p.LoseReply(func(r []byte) bool { return bytes.Contains(r, []byte("comp=metadata")) })
		la, err := a.TryAcquire(ctx, name, 15*time.Second)
		if p.Pending() != 0 {
			t.Fatalf("%s: the token write's reply was not lost (the fault did not fire)", round)
		}
		if err != nil {
			t.Fatalf("%s: TryAcquire with the token write's reply lost: %v", round, err)
		}
		if st := storedToken(t, e, name); la.Token() != st || la.Token() <= t0 {
			t.Fatalf("%s: granted token %d; the blob holds %d, the grant before had %d", round, la.Token(), st, t0)
		}
		expectHeldBy(t, b, name)
		if err := la.Release(ctx); err != nil {
			t.Fatal(err)
		}
		lb, err := b.TryAcquire(ctx, name, 15*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if lb.Token() <= la.Token() {
			t.Fatalf("%s: the next grant has token %d, not above %d", round, lb.Token(), la.Token())
		}
		t0 = lb.Token()
		if err := lb.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

func expectHeldBy(t *testing.T, b *azfence.Acquirer, name string) {
	t.Helper()
	if l, err := b.TryAcquire(context.Background(), name, 15*time.Second); !errors.Is(err, fence.ErrHeld) {
		if err == nil {
			_ = l.Release(context.Background())
		}
		t.Fatalf("another TryAcquire while the name is held: %v, want ErrHeld", err)
	}
}

// crashAfter is an http.RoundTripper that sends requests until one matches,
// sends that one too, throws its answer away and from then on fails every
// request at once: the process died right after sending it.
type crashAfter struct {
	base  http.RoundTripper
	match func(*http.Request) bool

	mu   sync.Mutex
	dead bool
	sent int // matching requests answered by the server before the crash
}

var errCrashed = errors.New("the process has crashed")

func (c *crashAfter) RoundTrip(r *http.Request) (*http.Response, error) {
	c.mu.Lock()
	dead := c.dead
	c.mu.Unlock()
	if dead {
		return nil, errCrashed
	}
	resp, err := c.base.RoundTrip(r)
	if err != nil || !c.match(r) {
		return resp, err
	}
	resp.Body.Close()
	c.mu.Lock()
	c.dead = true
	c.sent++
	c.mu.Unlock()
	return nil, errCrashed
}

// TestCrashBetweenLeaseAndTokenWrite (HAZARDS 3): a grant's holder dies
// right after its token write reached Azure (the lease is taken, the token
// advanced, nobody was told). The name is blocked until Azure's lease
// expires (at most 15 s for a short ttl) and no longer; the next grant's
// token is above the one the dead holder wrote and above every earlier grant.
func TestCrashBetweenLeaseAndTokenWrite(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	localOnly(t, e, "needs the test's own transport to the server")
	crash := &crashAfter{base: &http.Transport{}, match: func(r *http.Request) bool { return r.URL.Query().Get("comp") == "metadata" }}
	ctx := context.Background()
	name := fencetest.Name("crash")
	b := newAcquirer(t, e.other(t))
	l, err := b.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t0 := l.Token()
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	a := newAcquirer(t, newClientVia(t, e.srv, e.srv.ServiceURL, e.container, crash))
	tctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = a.TryAcquire(tctx, name, 15*time.Second)
	cancel()
	if err == nil || crash.sent != 1 {
		t.Fatalf("TryAcquire through a process that dies after its token write: %v (token writes sent: %d)", err, crash.sent)
	}
	dead := storedToken(t, e, name)
	if dead <= t0 {
		t.Fatalf("the dead holder's token write did not land: the blob holds %d, the grant before had %d", dead, t0)
	}
	start := time.Now()
	actx, cancel := context.WithTimeout(ctx, 25*time.Second)
	defer cancel()
	lb, err := b.Acquire(actx, name, 15*time.Second)
	if err != nil {
		t.Fatalf("the name after its holder died between the lease and the token write: %v after %v", err, time.Since(start))
	}
	defer lb.Release(ctx)
	t.Logf("granted after %v with token %d (dead holder wrote %d, the grant before had %d)", time.Since(start), lb.Token(), dead, t0)
	if lb.Token() <= dead {
		t.Fatalf("the next grant has token %d, not above the dead holder's %d", lb.Token(), dead)
	}
}

// TestNoSASSignatureInErrors (HAZARDS 10): a container client made from a
// SAS URL carries the signature in every request's query; a request that
// gets no answer (a refused connection, a reset, a timeout) comes back from
// net/http as a *url.Error holding the whole URL. No error the Writer, the
// Acquirer or a lease returns may contain the signature.
func TestNoSASSignatureInErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	localOnly(t, e, "the fault proxy needs a plain-HTTP server")
	sasURL, err := e.c.GetSASURL(sas.ContainerPermissions{Read: true, Add: true, Create: true, Write: true, Delete: true, Tag: true},
		time.Now().Add(time.Hour), nil)
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(sasURL)
	if err != nil {
		t.Fatal(err)
	}
	sig := u.Query().Get("sig")
	if sig == "" {
		t.Fatalf("no signature in the SAS URL %s", sasURL)
	}
	p := faultnet.Start(t, e.srv.Host)
	u.Host = p.Addr()
	c, err := container.NewClientWithNoCredential(u.String(), &container.ClientOptions{ClientOptions: azcore.ClientOptions{
		Retry: policy.RetryOptions{MaxRetries: 1, RetryDelay: 10 * time.Millisecond, TryTimeout: 5 * time.Second},
	}})
	if err != nil {
		t.Fatal(err)
	}
	w, a := newWriter(t, c, nil), newAcquirer(t, c)
	ctx := context.Background()
	name := fencetest.Name("sas")
	if err := w.Write(ctx, name, []byte("v"), 1); err != nil {
		t.Fatalf("a write through the SAS client: %v", err)
	}
	l, err := a.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatalf("a grant through the SAS client: %v", err)
	}
	p.Refuse(true)
	p.CutAll()
	check := func(what string, err error) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s with every connection refused: no error", what)
		}
		if msg := err.Error(); strings.Contains(msg, sig) || strings.Contains(msg, url.QueryEscape(sig)) {
			t.Errorf("%s: the error holds the SAS signature: %v", what, err)
		} else {
			t.Logf("%s: %v", what, err)
		}
	}
	tctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	check("Write", w.Write(tctx, name, []byte("w"), 2))
	check("Delete", w.Delete(tctx, name, 2))
	_, _, err = w.Read(tctx, name)
	check("Read", err)
	_, err = a.TryAcquire(tctx, name+"-other", 15*time.Second)
	check("TryAcquire", err)
	check("Renew", l.Renew(tctx))
	check("Release", l.Release(tctx))
}

// TestTombstoneDeletedByHand (HAZARDS 1, 7): what Delete's doc says about a
// tombstone deleted by other means: the fence goes with it, and a write with
// a lower token than the tombstone's is accepted afterwards. While the
// tombstone is there, the same write is refused.
func TestTombstoneDeletedByHand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := newWriter(t, e.c, nil)
	ctx := context.Background()
	key := fencetest.Name("tomb")
	if err := w.Write(ctx, key, []byte("v"), 5); err != nil {
		t.Fatal(err)
	}
	if err := w.Delete(ctx, key, 7); err != nil {
		t.Fatal(err)
	}
	var se *fence.StaleError
	if err := w.Write(ctx, key, []byte("stale"), 6); !errors.As(err, &se) || se.Current != 7 {
		t.Fatalf("a write below the tombstone's token: %v, want *StaleError holding 7", err)
	}
	if _, err := e.c.NewBlobClient(key).Delete(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("stale"), 6); err != nil {
		t.Fatalf("after the tombstone was deleted by hand, Delete's doc says any token is accepted: %v", err)
	}
}

// TestMetadataEditedByHand (HAZARDS 1): an operator sets a fenced blob's
// metadata (Set Blob Metadata replaces all of it: the portal's or the CLI's
// metadata update), and the token in metadata is gone while the body still
// holds the envelope with its token (Read returns it). A write with a lower
// token must still be refused: the fence is not lost with the metadata.
func TestMetadataEditedByHand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := newWriter(t, e.c, nil)
	ctx := context.Background()
	for _, del := range []bool{false, true} {
		key := fencetest.Name("meta")
		v5 := "v5" + strings.Repeat(".", 300) // longer than the header read
		if err := w.Write(ctx, key, []byte(v5), 5); err != nil {
			t.Fatal(err)
		}
		if del {
			if err := w.Delete(ctx, key, 5); err != nil {
				t.Fatal(err)
			}
		}
		note := "by hand"
		if _, err := e.c.NewBlobClient(key).SetMetadata(ctx, map[string]*string{"note": &note}, nil); err != nil {
			t.Fatal(err)
		}
		if v, tok, err := w.Read(ctx, key); !del && (err != nil || tok != 5 || string(v) != v5) {
			t.Fatalf("Read after the metadata was replaced: %q, %d, %v; want v5 at token 5", v, tok, err)
		}
		var se *fence.StaleError
		if err := w.Write(ctx, key, []byte("stale"), 3); !errors.As(err, &se) || se.Current != 5 {
			t.Errorf("deleted %v: a write with token 3 after the metadata of the blob at token 5 was replaced: %v, want *StaleError holding 5", del, err)
		}
		if err := w.Write(ctx, key, []byte("v6"), 6); err != nil {
			t.Errorf("deleted %v: a write with token 6 after: %v", del, err)
		}
		if v, tok, err := w.Read(ctx, key); err != nil || tok != 6 || string(v) != "v6" {
			t.Errorf("deleted %v: Read = %q, %d, %v; want v6 at token 6", del, v, tok, err)
		}
	}
}

// TestShortTTLPastDeadline (HAZARDS 5, 6): a 1 s ttl is held on a 15 s
// Azure lease. Once the holder's context is done (at its ttl), nobody else
// has been granted the name yet (Azure still holds it: ErrHeld), a Renew
// sends nothing and reports ErrLost, and the holder's Release still frees
// the name at once instead of leaving it blocked for the rest of Azure's
// lease; the next grant's token is larger and fences the old holder out.
func TestShortTTLPastDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	a, b := newAcquirer(t, e.c), newAcquirer(t, e.other(t))
	w := newWriter(t, e.c, nil)
	ctx := context.Background()
	name := fencetest.Name("short")
	la, err := a.TryAcquire(ctx, name, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	granted := time.Now()
	<-la.Context().Done()
	if d := time.Since(granted); d > 5*time.Second {
		t.Fatalf("a 1 s lease's context ended only after %v", d)
	}
	expectHeldBy(t, b, name)
	if err := la.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew past the local deadline: %v, want ErrLost", err)
	}
	expectHeldBy(t, b, name)
	if err := la.Release(ctx); err != nil && !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Release past the local deadline: %v", err)
	}
	lb, err := b.TryAcquire(ctx, name, time.Second)
	if err != nil {
		t.Fatalf("TryAcquire right after the old holder's Release, %v after its grant: %v (the name stays blocked for Azure's 15 s lease)", time.Since(granted), err)
	}
	defer lb.Release(ctx)
	if lb.Token() <= la.Token() {
		t.Fatalf("next grant's token %d, not above %d", lb.Token(), la.Token())
	}
	if err := w.Write(ctx, name, []byte("new"), lb.Token()); err != nil {
		t.Fatal(err)
	}
	var se *fence.StaleError
	if err := w.Write(ctx, name, []byte("old"), la.Token()); !errors.As(err, &se) {
		t.Errorf("the old holder's write after the new holder's: %v, want *StaleError", err)
	}
}

// TestMissingContainer (bad input): a client of a container that does not
// exist. Every call must say so (Azure's ContainerNotFound in the chain),
// not answer that the key was not found (Read) or that the blob kept changing
// (Write, Delete, TryAcquire, after a burst of requests).
func TestMissingContainer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := newClient(t, e.srv, e.srv.ServiceURL, "no-such-"+strings.ToLower(strings.ReplaceAll(fencetest.Name("c"), "_", "-")))
	w, a := newWriter(t, c, nil), newAcquirer(t, c)
	ctx := context.Background()
	check := func(what string, err error) {
		t.Helper()
		switch {
		case err == nil:
			t.Errorf("%s in a missing container: no error", what)
		case errors.Is(err, fence.ErrNotFound) || errors.Is(err, azfence.ErrContention) || !bloberror.HasCode(err, bloberror.ContainerNotFound):
			t.Errorf("%s in a missing container: %v, want Azure's ContainerNotFound", what, err)
		default:
			t.Logf("%s: %v", what, err)
		}
	}
	check("Write", w.Write(ctx, "k", []byte("v"), 1))
	check("Delete", w.Delete(ctx, "k", 1))
	_, _, err := w.Read(ctx, "k")
	check("Read", err)
	_, err = a.TryAcquire(ctx, "n", 15*time.Second)
	check("TryAcquire", err)
}
