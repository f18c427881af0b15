package azfence_test

// Late grants: a grant Azure confirms only after its local deadline is given
// back (abandon); TryAcquire answers ErrLost, a waiting Acquire counts it as a
// held name and tries again until its ctx ends (ErrHeld + the ctx's error,
// never ErrLost). Also an abandoned grant's request that lands after its
// sender gave up, and a short ttl held past its local deadline.

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/lease"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/linetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// lateDelay delays every chunk each way through the proxy: a 1s grant
// (AcquireLease, then the token's write, two round trips) is confirmed at
// least 1.6s after it was sent, past its local deadline.
const lateDelay = 400 * time.Millisecond

// leased reports whether Azure holds a lease on name's lock blob, read
// through c (not through the test's proxy).
func leased(t *testing.T, c *container.Client, name string) bool {
	t.Helper()
	p, err := c.NewBlobClient("fencekit-locks/"+name).GetProperties(context.Background(), nil)
	if err != nil {
		t.Fatalf("reading %q's lock blob: %v", name, err)
	}
	return p.LeaseState != nil && *p.LeaseState == lease.StateTypeLeased
}

// waitLeased polls name's lock blob through c until its lease state is want,
// or fails the test after bound.
func waitLeased(t *testing.T, c *container.Client, name string, want bool, bound time.Duration, what string) {
	t.Helper()
	for end := time.Now().Add(bound); leased(t, c, name) != want; {
		if time.Now().After(end) {
			t.Fatalf("%s: the lock blob's lease state did not become leased=%v within %v", what, want, bound)
		}
		time.Sleep(20 * time.Millisecond) // polling Azure, not synchronisation
	}
}

// grantAndRelease makes name's lock blob and its first token through c, so
// that a later grant is one AcquireLease and one token write.
func grantAndRelease(t *testing.T, c *container.Client, name string) fence.Token {
	t.Helper()
	// A lease of 10s, not the shortest: on a loaded machine a lease of
	// MinAcquirerTTL can pass its local deadline before its Release.
	l, err := newAcquirer(t, c).TryAcquire(context.Background(), name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	return l.Token()
}

// TestLateGrantsAcquireGivesUpAsAWait: through a proxy that delays every
// chunk 400ms each way, every grant of a 1s lease is confirmed past its local
// deadline. TryAcquire gives the grant back and answers ErrLost; a waiting
// Acquire keeps trying and, at its deadline, gives up as any wait does:
// ErrHeld joined with DeadlineExceeded, never ErrLost (fence.Acquirer's
// contract). With the delay gone the name is free well within Azure's 15s
// lease: the late grants were given back.
func TestLateGrantsAcquireGivesUpAsAWait(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	localOnly(t, e, "needs the fault proxy in front of the Azurite this test run started")
	c, p := e.proxied(t)
	a := newAcquirer(t, c)
	ctx := context.Background()
	name := fencetest.Name("late-wait")
	grantAndRelease(t, e.c, name)
	p.Latency(lateDelay, lateDelay)

	if l, err := a.TryAcquire(ctx, name, azfence.MinAcquirerTTL); !errors.Is(err, fence.ErrLost) || errors.Is(err, fence.ErrHeld) {
		if err == nil {
			t.Fatalf("TryAcquire with every grant late granted token %d (its context: %v)", l.Token(), context.Cause(l.Context()))
		}
		t.Fatalf("TryAcquire of a free name, every grant late: %v, want ErrLost (and not ErrHeld)", err)
	}
	deadline := time.Now().Add(8 * time.Second)
	actx, cancel := context.WithDeadline(ctx, deadline)
	l, err := a.Acquire(actx, name, azfence.MinAcquirerTTL)
	cancel()
	if err == nil {
		t.Fatalf("Acquire with every grant late granted token %d (its context: %v)", l.Token(), context.Cause(l.Context()))
	}
	t.Logf("Acquire: %v (%v after its deadline)", err, time.Since(deadline))
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, fence.ErrLost) {
		t.Errorf("Acquire with every grant late: %v, want ErrHeld joined with DeadlineExceeded (and not ErrLost)", err)
	}

	p.Latency(0, 0)
	b := newAcquirer(t, e.other(t))
	for end := time.Now().Add(5 * time.Second); ; {
		l, err := b.TryAcquire(ctx, name, 15*time.Second)
		if err == nil {
			_ = l.Release(ctx)
			break
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatal(err)
		}
		if time.Now().After(end) {
			t.Fatalf("the name is still held 5s after the late grants (Azure's lease is 15s): they were not given back")
		}
		time.Sleep(50 * time.Millisecond) // polling Azure, not synchronisation
	}
}

// TestLateGrantThenAcquireGranted: a waiting Acquire whose grant comes back
// late (every chunk delayed 400ms each way) gives it back and tries again;
// once the network is fast again it is granted, within its context, a live
// lease with a larger token. The test sees the late grant happen on Azure
// (the blob leased, then released by the give-back) before it removes the
// delay, so an Acquire that answered the late grant's ErrLost would already
// have returned.
func TestLateGrantThenAcquireGranted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	localOnly(t, e, "needs the fault proxy in front of the Azurite this test run started")
	c, p := e.proxied(t)
	a := newAcquirer(t, c)
	ctx := context.Background()
	name := fencetest.Name("late-then-granted")
	first := grantAndRelease(t, e.c, name)
	p.Latency(lateDelay, lateDelay)

	type result struct {
		l   fence.Lease
		err error
	}
	done := make(chan result, 1)
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	go func() {
		l, err := a.Acquire(actx, name, azfence.MinAcquirerTTL)
		done <- result{l, err}
	}()
	waitLeased(t, e.c, name, true, 10*time.Second, "the late grant")
	waitLeased(t, e.c, name, false, 10*time.Second, "the late grant's give-back")
	p.Latency(0, 0)

	r := <-done
	if r.err != nil {
		t.Fatalf("Acquire after a late grant, with the network fast again: %v, want a grant", r.err)
	}
	defer r.l.Release(ctx)
	if err := r.l.Context().Err(); err != nil {
		t.Fatalf("Acquire returned a lease whose context is done: %v", context.Cause(r.l.Context()))
	}
	if r.l.Token() <= first {
		t.Fatalf("token %d after a late grant, not above the earlier grant's %d", r.l.Token(), first)
	}
	expectHeldBy(t, newAcquirer(t, e.other(t)), name)
}

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

// send sends the held acquire now and returns its HTTP status.
func (l *lateAcquire) send(t *testing.T) int {
	l.mu.Lock()
	r := l.held
	l.mu.Unlock()
	return sendHeldAcquire(t, l.base, r)
}

// sendHeldAcquire sends r, an acquire held back, through rt and returns its
// HTTP status.
func sendHeldAcquire(t *testing.T, rt http.RoundTripper, r *http.Request) int {
	t.Helper()
	if r == nil {
		t.Fatal("no acquire was held back")
	}
	resp, err := rt.RoundTrip(r)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestAbandonedGrantLandingLate: a TryAcquire whose acquire
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

// TestShortTTLPastDeadline: a 1 s ttl is held on a 15 s
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

// lateBlobRT is a transport in front of the server for one lock blob: it counts
// the Lease Blob acquires and the confirmed releases, can delay the answer of
// each metadata write (the write lands; its confirmation is slow, as on a
// slow link), can hold back the first acquire (it gets no answer and is sent
// to the server only when the test says so: a request stuck in the network),
// and calls onRelease as a release is sent.
type lateBlobRT struct {
	next http.RoundTripper
	blob string // "/fencekit-locks/<name>"

	acquires   atomic.Int64
	releasesOK atomic.Int64
	releases   atomic.Int64 // release requests seen
	loseNext   atomic.Int64 // the next n releases are sent, their answers lost
	released   chan struct{}
	slowWrite  atomic.Int64 // ns added to each metadata write's answer

	mu        sync.Mutex
	holdFirst time.Duration // >0: hold the first acquire back, fail it after this network time
	held      *http.Request
	onRelease func()
	// afterRelease, when set, runs once after the next confirmed release,
	// before its answer reaches the caller (abandon pokes the line only
	// after that).
	afterRelease func()
}

func newLateBlobRT(name string) *lateBlobRT {
	return &lateBlobRT{next: &http.Transport{}, blob: "/fencekit-locks/" + name, released: make(chan struct{}, 1024)}
}

func (h *lateBlobRT) RoundTrip(r *http.Request) (*http.Response, error) {
	if !strings.HasSuffix(r.URL.Path, h.blob) {
		return h.next.RoundTrip(r)
	}
	action := strings.ToLower(leaseAction(r))
	switch {
	case action == "acquire":
		h.acquires.Add(1)
		h.mu.Lock()
		d := h.holdFirst
		if d > 0 {
			h.holdFirst = 0
			h.held = r.Clone(context.WithoutCancel(r.Context()))
		}
		h.mu.Unlock()
		if d > 0 {
			// The request is on its way (not yet at the server); its
			// sender hears nothing for d (network time, not
			// synchronisation), then gives up on it.
			select {
			case <-time.After(d):
			case <-r.Context().Done():
			}
			return nil, errors.New("injected: no answer from the network")
		}
	case action == "release":
		h.mu.Lock()
		f := h.onRelease
		h.mu.Unlock()
		if f != nil {
			f()
		}
		h.releases.Add(1)
		resp, err := h.next.RoundTrip(r)
		if err == nil && h.loseNext.Add(-1) >= 0 {
			resp.Body.Close()
			return nil, errors.New("injected: the release's answer was lost")
		}
		if err == nil && resp.StatusCode/100 == 2 {
			h.releasesOK.Add(1)
			h.mu.Lock()
			f := h.afterRelease
			h.afterRelease = nil
			h.mu.Unlock()
			if f != nil {
				f()
			}
			select {
			case h.released <- struct{}{}:
			default:
			}
		}
		return resp, err
	case r.Method == http.MethodPut && r.URL.Query().Get("comp") == "metadata":
		resp, err := h.next.RoundTrip(r)
		if d := time.Duration(h.slowWrite.Load()); d > 0 && err == nil {
			// A slow link: the answer arrives d later.
			select {
			case <-time.After(d):
			case <-r.Context().Done():
				resp.Body.Close()
				return nil, r.Context().Err()
			}
		}
		return resp, err
	}
	return h.next.RoundTrip(r)
}

// sendHeld sends the held-back acquire now and returns its HTTP status.
func (h *lateBlobRT) sendHeld(t *testing.T) int {
	t.Helper()
	h.mu.Lock()
	r := h.held
	h.mu.Unlock()
	return sendHeldAcquire(t, h.next, r)
}

func lateBlobAcquirer(t *testing.T, e *azenv, h *lateBlobRT, o *azfence.AcquirerOptions) *azfence.Acquirer {
	t.Helper()
	a, err := azfence.NewAcquirer(newClientVia(t, e.srv, e.srv.ServiceURL, e.container, h), o)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// waitGrant Acquires name through b within d, or fails the test.
func waitGrant(t *testing.T, b *azfence.Acquirer, name string, ttl, d time.Duration, what string) fence.Lease {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	start := time.Now()
	l, err := b.Acquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("%s: another acquirer's Acquire after %v: %v (Azure holds every lease for 15s)", what, time.Since(start), err)
	}
	return l
}

// everyGrantLate makes a fresh name from prefix, granted and released once
// (its token is first), and an acquirer through a lateBlobRT on it whose
// Drift (MinAcquirerTTL - 20µs) confirms every grant of a MinAcquirerTTL
// lease past its local deadline.
func everyGrantLate(t *testing.T, e *azenv, prefix string) (name string, first fence.Token, h *lateBlobRT, a *azfence.Acquirer) {
	t.Helper()
	name = fencetest.Name(prefix)
	first = grantAndRelease(t, e.c, name)
	h = newLateBlobRT(name)
	a = lateBlobAcquirer(t, e, h, &azfence.AcquirerOptions{Drift: azfence.MinAcquirerTTL - 20*time.Microsecond})
	return name, first, h, a
}

// skipIfGrantedInTime releases l and skips the test (outside CI) when the
// Acquire that returned l and err was granted: the 20µs margin was enough
// on this machine, so the late grant the test is about did not happen.
func skipIfGrantedInTime(t *testing.T, l fence.Lease, err error) {
	t.Helper()
	if err == nil {
		_ = l.Release(context.Background())
		testenv.SkipUnlessCI(t, "a grant within 20µs: the margin was enough on this machine, and the late grant this test is about did not happen")
	}
}

// TestLateGrantAcquireDoesNotSpin: with Drift = ttl - 20µs every grant is
// confirmed past its local deadline, even on a fast link (the NATS adapter's
// TestLateGrantAcquireDoesNotSpin, on Azure). A waiting Acquire treats
// each as a held name; it must wait as for a held name (its Backoff: 50ms to
// 1s by default), not fire Lease Blob acquires back to back, woken at once by
// each give-back's poke. A held name's wait sends ~8 acquires in 2s.
func TestLateGrantAcquireDoesNotSpin(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name, _, h, a := everyGrantLate(t, e, "revlate-spin")
	ctx := context.Background()
	actx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	l, err := a.Acquire(actx, name, azfence.MinAcquirerTTL)
	skipIfGrantedInTime(t, l, err)
	n, rel := h.acquires.Load(), h.releasesOK.Load()
	t.Logf("Acquire: %v; %d Lease Blob acquires and %d confirmed give-backs in its 2s wait", err, n, rel)
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, fence.ErrLost) {
		t.Errorf("Acquire: %v, want ErrHeld and DeadlineExceeded, not ErrLost", err)
	}
	if n > 40 {
		t.Errorf("a waiting Acquire with every grant late sent %d Lease Blob acquires (and %d give-backs) in 2s: it spins (each give-back's poke starts the next late grant at once; no pause between late tries)", n, rel)
	}
	waitLeased(t, e.c, name, false, 5*time.Second, "after the late grants' give-backs")
}

// TestLateGrantGhostAcquireAfterGiveBack: TryAcquire's first Lease Blob acquire
// gets no answer for 1.2s (it is still in the network), so TryAcquire sends
// it again with the same lease ID, is granted, and confirms the grant past
// its 1s local deadline: ErrLost, and abandon gives the grant back. The first
// acquire then lands (Azure grants the same ID again: the blob was free).
// abandon's doc: it "tries until a release is confirmed ... or the lease's
// duration plus 5 s has passed ... An acquire delayed in the network for
// longer than that can still hold the name until its lease expires": an
// acquire delayed by about 2s must not keep the name from everyone for
// Azure's 15s lease. Another acquirer must be granted the name
// well before.
func TestLateGrantGhostAcquireAfterGiveBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := fencetest.Name("revlate-ghost")
	first := grantAndRelease(t, e.c, name)
	h := newLateBlobRT(name)
	h.holdFirst = 1200 * time.Millisecond
	a := lateBlobAcquirer(t, e, h, nil)
	ctx := context.Background()
	l, err := a.TryAcquire(ctx, name, azfence.MinAcquirerTTL)
	if err == nil {
		t.Fatalf("TryAcquire confirmed 1.2s after its first send granted token %d", l.Token())
	}
	t.Logf("TryAcquire: %v", err)
	if !errors.Is(err, fence.ErrLost) || errors.Is(err, fence.ErrHeld) {
		t.Fatalf("TryAcquire confirmed past its deadline: %v, want ErrLost", err)
	}
	select {
	case <-h.released:
	case <-time.After(10 * time.Second):
		t.Fatal("the late grant was not given back within 10s")
	}
	code := h.sendHeld(t)
	t.Logf("the held-back first acquire landed after the give-back: HTTP %d", code)
	start := time.Now()
	b := newAcquirer(t, e.other(t))
	l = waitGrant(t, b, name, 15*time.Second, 6*time.Second, "a late grant's first acquire landing 2s late")
	defer l.Release(ctx)
	t.Logf("granted to another acquirer %v after the late acquire landed, token %d", time.Since(start), l.Token())
	if l.Token() <= first {
		t.Errorf("token %d not above the earlier grant's %d", l.Token(), first)
	}
}

// TestLateGrantCtxEndsDuringGiveBack: every grant late (Drift = ttl - 20µs);
// the waiting Acquire's ctx is cancelled by the transport exactly as the
// first late grant's give-back (abandon's release) is sent. Acquire must
// give up as a wait does (ErrHeld and context.Canceled, never ErrLost), and
// nothing may stay held: the blob is free within a few seconds and another
// acquirer is granted it.
func TestLateGrantCtxEndsDuringGiveBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name, first, h, a := everyGrantLate(t, e, "revlate-ctx")
	ctx := context.Background()
	actx, cancel := context.WithCancel(ctx)
	defer cancel()
	h.onRelease = cancel
	l, err := a.Acquire(actx, name, azfence.MinAcquirerTTL)
	skipIfGrantedInTime(t, l, err)
	t.Logf("Acquire: %v", err)
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) || errors.Is(err, fence.ErrLost) {
		t.Errorf("Acquire cancelled during a late grant's give-back: %v, want ErrHeld and context.Canceled, not ErrLost", err)
	}
	waitLeased(t, e.c, name, false, 5*time.Second, "after the cancelled Acquire")
	b := newAcquirer(t, e.other(t))
	l2, err := b.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatalf("another acquirer after the cancelled Acquire: %v", err)
	}
	defer l2.Release(ctx)
	if l2.Token() <= first+1 {
		t.Errorf("token %d after a late grant (which wrote %d): not above it", l2.Token(), first+1)
	}
}

// TestLateGrantSeveralWaiters: three waiting Acquire calls in one Acquirer's
// line, every grant late (Drift = ttl - 20µs). None may be granted, none may
// answer ErrLost (each: ErrHeld and DeadlineExceeded), and after they give
// up nothing stays held: the blob is free and another acquirer is granted it.
func TestLateGrantSeveralWaiters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const ttl = azfence.MinAcquirerTTL
	name, _, h, a := everyGrantLate(t, e, "revlate-line")
	ctx := context.Background()
	actx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	var chans []<-chan linetest.Acquired
	for i := 0; i < 3; i++ {
		chans = append(chans, linetest.Go(actx, a, name, ttl))
		linetest.WaitLine(t, lineLen, a, name, i+1)
	}
	for i, ch := range chans {
		r := linetest.Within(t, ch, 10*time.Second, "a waiter with every grant late")
		if r.Err == nil {
			_ = r.Lease.Release(ctx)
			t.Errorf("waiter %d granted token %d with every grant late (its context: %v)", i, r.Lease.Token(), context.Cause(r.Lease.Context()))
			continue
		}
		if !errors.Is(r.Err, fence.ErrHeld) || !errors.Is(r.Err, context.DeadlineExceeded) || errors.Is(r.Err, fence.ErrLost) {
			t.Errorf("waiter %d: %v, want ErrHeld and DeadlineExceeded, not ErrLost", i, r.Err)
		}
	}
	t.Logf("%d acquires, %d give-backs", h.acquires.Load(), h.releasesOK.Load())
	if n := azfence.LineLen(a, name); n != 0 {
		t.Errorf("%d waiters left in the line", n)
	}
	waitLeased(t, e.c, name, false, 5*time.Second, "after the waiters gave up")
	l := waitGrant(t, newAcquirer(t, e.other(t)), name, 15*time.Second, 3*time.Second, "after late waiters")
	_ = l.Release(ctx)
}

// TestLateGrantThenOtherTakes: a waiting Acquire on a slow link (each token
// write confirmed 1.1s late: every grant late) gives its grants back; each
// holds nothing (README: "holds nothing"), so another Acquirer on its own,
// fast client must be able to take the name between them (one
// slow participant must not keep a lock from the others) within 10s. Then,
// with the link fast again, the first Acquire must not be granted while the
// other holds the name; it is granted after the other's release, with a
// larger token.
func TestLateGrantThenOtherTakes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := fencetest.Name("revlate-other")
	first := grantAndRelease(t, e.c, name)
	h := newLateBlobRT(name)
	h.slowWrite.Store(int64(1100 * time.Millisecond))
	a := lateBlobAcquirer(t, e, h, nil)
	ctx := context.Background()
	actx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	got := linetest.Go(actx, a, name, azfence.MinAcquirerTTL)
	select {
	case <-h.released:
	case r := <-got:
		t.Fatalf("Acquire returned before any late grant was given back: %v", r.Err)
	case <-time.After(10 * time.Second):
		t.Fatal("no late grant given back within 10s")
	}
	b := newAcquirer(t, e.other(t))
	bl := waitGrant(t, b, name, 15*time.Second, 10*time.Second, "between late grants")
	h.slowWrite.Store(0)
	// The other holds the name: the first Acquire must still wait.
	l := waitsWhileOtherHolds(t, got, bl, 1500*time.Millisecond)
	if !(first < bl.Token() && bl.Token() < l.Token()) {
		t.Errorf("tokens: first %d, the other's %d, the waiter's %d: not growing", first, bl.Token(), l.Token())
	}
	expectHeldBy(t, newAcquirer(t, e.other(t)), name)
}

// waitsWhileOtherHolds checks that the waiting Acquire behind got is neither
// granted nor gives up for quiet while another acquirer holds bl, then
// releases bl and checks that the waiter is granted a live lease within 10s,
// not before the release began. It returns that lease, released at cleanup.
func waitsWhileOtherHolds(t *testing.T, got <-chan linetest.Acquired, bl fence.Lease, quiet time.Duration) fence.Lease {
	t.Helper()
	ctx := context.Background()
	select {
	case r := <-got:
		if r.Err == nil {
			t.Fatalf("Acquire granted token %d while another acquirer holds token %d", r.Lease.Token(), bl.Token())
		}
		t.Fatalf("Acquire gave up while the other holds the name, its ctx live: %v", r.Err)
	case <-time.After(quiet): // observing that nothing comes
	}
	// The name is free at Azure during the Release call, before its answer
	// is back: a grant may come back before Release does (seen on
	// a loaded machine), but not before the call began.
	released := time.Now()
	if err := bl.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := linetest.Within(t, got, 10*time.Second, "Acquire after the other's release")
	if r.Err != nil {
		t.Fatalf("Acquire after the other's release: %v", r.Err)
	}
	t.Cleanup(func() { r.Lease.Release(context.Background()) })
	if r.At.Before(released) {
		t.Errorf("Acquire granted before the other's release began")
	}
	if err := r.Lease.Context().Err(); err != nil {
		t.Errorf("Acquire returned a lease whose context is done: %v", context.Cause(r.Lease.Context()))
	}
	return r.Lease
}

// TestLateGrantThenOtherHoldsThenGranted: a waiting Acquire on a slow link
// (each token write confirmed 1.1s late) gets a late grant; right after its
// give-back is confirmed (before abandon's poke), another Acquirer on its own
// client takes the name, and the link becomes fast. The waiter must not be
// granted, nor give up, while the other holds the name; once the other
// releases, it is granted a live lease with a token above the other's, which
// is above the late grant's.
func TestLateGrantThenOtherHoldsThenGranted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := fencetest.Name("revlate-holds")
	first := grantAndRelease(t, e.c, name)
	h := newLateBlobRT(name)
	h.slowWrite.Store(int64(1100 * time.Millisecond))
	ctx := context.Background()
	b := newAcquirer(t, e.other(t))
	type taken struct {
		l   fence.Lease
		err error
	}
	took := make(chan taken, 1)
	var hook func()
	hook = func() {
		n := h.acquires.Load()
		l, err := b.TryAcquire(ctx, name, 15*time.Second)
		t.Logf("after a give-back: the waiter had sent %d acquires before the other's TryAcquire, %d after it: %v", n, h.acquires.Load(), err)
		if errors.Is(err, fence.ErrHeld) {
			// The waiter's own next (late) grant came first, on its
			// backoff: try again after its give-back.
			h.mu.Lock()
			h.afterRelease = hook
			h.mu.Unlock()
			return
		}
		h.slowWrite.Store(0)
		took <- taken{l, err}
	}
	h.afterRelease = hook
	a := lateBlobAcquirer(t, e, h, nil)
	actx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	got := linetest.Go(actx, a, name, azfence.MinAcquirerTTL)
	var bl fence.Lease
	select {
	case tk := <-took:
		if tk.err != nil {
			t.Fatalf("another acquirer right after the late grant's give-back: %v", tk.err)
		}
		bl = tk.l
	case r := <-got:
		t.Fatalf("Acquire returned before any late grant was given back: %v", r.Err)
	case <-time.After(15 * time.Second):
		t.Fatal("no late grant given back within 15s")
	}
	l := waitsWhileOtherHolds(t, got, bl, 2*time.Second)
	if !(first+1 < bl.Token() && bl.Token() < l.Token()) {
		t.Errorf("tokens: first %d, late grant %d, the other's %d, the waiter's %d: not growing", first, first+1, bl.Token(), l.Token())
	}
	expectHeldBy(t, newAcquirer(t, e.other(t)), name)
}

// TestLateGrantGiveBackReplyLost: a waiting Acquire on a slow link (each token
// write confirmed 1.1s late) gets a late grant whose give-back (abandon's
// release) lands but whose answer is lost, twice: abandon keeps sending
// releases that Azure refuses (the lease is gone) and does not poke the line.
// Once the link is fast the waiter must be granted within its backoff (not
// after abandon's 20s nor Azure's 15s), hold a live lease that abandon's
// leftover releases do not end, and not have spun meanwhile.
func TestLateGrantGiveBackReplyLost(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := fencetest.Name("revlate-lostrel")
	first := grantAndRelease(t, e.c, name)
	h := newLateBlobRT(name)
	h.slowWrite.Store(int64(1100 * time.Millisecond))
	h.loseNext.Store(2)
	a := lateBlobAcquirer(t, e, h, nil)
	ctx := context.Background()
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	got := linetest.Go(actx, a, name, azfence.MinAcquirerTTL)
	// The first late grant's release landed with its answer lost: Azure
	// no longer holds a lease on the blob.
	for end := time.Now().Add(10 * time.Second); h.releases.Load() == 0 || leased(t, e.c, name); {
		if time.Now().After(end) {
			t.Fatal("no late grant given back within 10s")
		}
		time.Sleep(5 * time.Millisecond) // polling, not synchronisation
	}
	h.slowWrite.Store(0)
	fast := time.Now()
	r := linetest.Within(t, got, 5*time.Second, "a waiter after its late grant's give-back lost its answer")
	if r.Err != nil {
		t.Fatalf("Acquire: %v", r.Err)
	}
	defer r.Lease.Release(ctx)
	t.Logf("granted %v after the link became fast; %d acquires, %d releases sent", r.At.Sub(fast), h.acquires.Load(), h.releases.Load())
	if r.Lease.Token() <= first {
		t.Errorf("token %d not above %d", r.Lease.Token(), first)
	}
	if d := r.At.Sub(fast); d > 3*time.Second {
		t.Errorf("granted %v after the name was free: the waiter waited for abandon or Azure's lease", d)
	}
	// abandon may still send releases of the late grant's lease ID for
	// seconds: the new lease must survive them.
	select {
	case <-r.Lease.Context().Done():
		t.Fatalf("the granted lease ended: %v", context.Cause(r.Lease.Context()))
	case <-time.After(500 * time.Millisecond): // observing that it stays live
	}
	if err := r.Lease.Renew(ctx); err != nil {
		t.Fatalf("Renew of the granted lease: %v", err)
	}
	expectHeldBy(t, newAcquirer(t, e.other(t)), name)
}
