package azfence_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

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

// TestLostTokenWriteReply: the grant's second request, the token
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

// TestCrashBetweenLeaseAndTokenWrite: a grant's holder dies
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

var errCrashed = errors.New("the process has crashed")
