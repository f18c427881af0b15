package redislua_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// The lost-reply tests put a faultnet proxy between a client and the real
// Redis and lose the reply of one script call after Redis ran it. They run
// with go-redis's default retries (it sends a command again after a network
// error) and with none.

// viaProxy returns a client that reaches the test Redis through p.
func viaProxy(t *testing.T, p *faultnet.Proxy, retries int) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: retries, ReadTimeout: 10 * time.Second})
	t.Cleanup(func() { c.Close() })
	return c
}

func isScript(b []byte) bool { return bytes.Contains(bytes.ToLower(b), []byte("evalsha")) }

// eachRetryMode runs f with a proxy to the test Redis and a client through
// it, once with go-redis's default retries and once with none.
func eachRetryMode(t *testing.T, f func(t *testing.T, p *faultnet.Proxy, c *redis.Client)) {
	for _, m := range []struct {
		name    string
		retries int
	}{{"default-retries", 0}, {"no-retries", -1}} {
		t.Run(m.name, func(t *testing.T) {
			p := faultnet.Start(t, testenv.RedisAddr())
			f(t, p, viaProxy(t, p, m.retries))
		})
	}
}

// loseNextScript arms p to lose the reply of the next script call.
func loseNextScript(t *testing.T, p *faultnet.Proxy) {
	t.Helper()
	p.LoseReply(isScript)
}

// checkUnknown fails unless err matches fence.ErrUnknown and is no bare
// transport error.
func checkUnknown(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("%s whose reply was lost: %v, want an error matching fence.ErrUnknown", what, err)
	}
	if errors.Is(err, fence.ErrStale) || errors.Is(err, fence.ErrLost) {
		t.Fatalf("%s whose reply was lost: %v also reports a definite outcome", what, err)
	}
}

func TestWriterLostReply(t *testing.T) {
	direct := testenv.RedisClient(t)
	ctx := context.Background()
	eachRetryMode(t, func(t *testing.T, p *faultnet.Proxy, c *redis.Client) {
		w, _ := redislua.NewWriter(c, nil)
		rw, _ := redislua.NewWriter(direct, nil)
		key := fencetest.Name("lostw")
		if err := w.Write(ctx, key, []byte("v1"), 3); err != nil { // loads the script
			t.Fatal(err)
		}
		loseNextScript(t, p)
		checkUnknown(t, "Write", w.Write(ctx, key, []byte("v2"), 4))
		if v, tok, err := rw.Read(ctx, key); err != nil || string(v) != "v2" || tok != 4 {
			t.Fatalf("after the lost write: %q token %d, %v; want v2 at 4 (Redis ran it)", v, tok, err)
		}
		loseNextScript(t, p)
		checkUnknown(t, "Delete", w.Delete(ctx, key, 5))
		if _, _, err := rw.Read(ctx, key); !errors.Is(err, fence.ErrNotFound) {
			t.Fatalf("after the lost delete: %v, want ErrNotFound", err)
		}
		if err := rw.Write(ctx, key, []byte("old"), 4); !errors.Is(err, fence.ErrStale) {
			t.Fatalf("token 4 after the lost delete at 5: %v, want ErrStale (the fence is at 5)", err)
		}
		if p.Pending() != 0 {
			t.Fatal("a lost reply was never taken")
		}
	})
}

// TestFencedScriptLostReply: a body with INCR whose reply is lost runs at
// most once per Run call; go-redis used to send it again, and the counter
// went up twice under one token.
func TestFencedScriptLostReply(t *testing.T) {
	direct := testenv.RedisClient(t)
	ctx := context.Background()
	incr := redislua.NewFencedScript(`return redis.call('INCR', KEYS[1])`)
	eachRetryMode(t, func(t *testing.T, p *faultnet.Proxy, c *redis.Client) {
		tag := fencetest.Name("lostscript")
		fenceKey, counter := "{"+tag+"}:fence", "{"+tag+"}:n"
		if _, err := incr.Run(ctx, c, fenceKey, 7, []string{counter}); err != nil { // loads the script
			t.Fatal(err)
		}
		loseNextScript(t, p)
		_, err := incr.Run(ctx, c, fenceKey, 7, []string{counter})
		if n, err := direct.Get(ctx, counter).Int(); err != nil || n != 2 {
			t.Fatalf("counter after two Run calls (one reply lost): %d, %v; want 2 (each call's body at most once)", n, err)
		}
		checkUnknown(t, "FencedScript.Run", err)
		if tok, err := direct.Get(ctx, fenceKey).Result(); err != nil || tok != "7" {
			t.Fatalf("fence after the lost run: %q, %v; want 7", tok, err)
		}
	})
}

func TestIdempotencyLostReply(t *testing.T) {
	direct := testenv.RedisClient(t)
	ctx := context.Background()
	eachRetryMode(t, func(t *testing.T, p *faultnet.Proxy, c *redis.Client) {
		s, _ := redislua.NewIdempotencyStore(c, nil)
		rs, _ := redislua.NewIdempotencyStore(direct, nil)
		if _, _, err := s.Begin(ctx, fencetest.Name("warm"), "fp", "o", time.Second); err != nil { // loads the script
			t.Fatal(err)
		}
		key := fencetest.Name("lostidem")
		loseNextScript(t, p)
		_, _, err := s.Begin(ctx, key, "fp", "me", time.Minute)
		checkUnknown(t, "Begin", err)
		rec, err := rs.Get(ctx, key)
		if err != nil || rec.State != idempotency.Claimed || rec.Owner != "me" {
			t.Fatalf("after the lost Begin: %+v, %v; want claimed by me", rec, err)
		}
		// The first Update loads its script.
		armed, err := s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		loseNextScript(t, p)
		_, err = s.Update(ctx, key, idempotency.Armed, armed.Fence, idempotency.Change{State: idempotency.Completed, Fence: armed.Fence, Owner: "me", Result: []byte("r"), Retention: time.Minute})
		checkUnknown(t, "Update", err)
		if rec, err := rs.Get(ctx, key); err != nil || rec.State != idempotency.Completed || string(rec.Result) != "r" {
			t.Fatalf("after the lost Update: %+v, %v; want completed with r", rec, err)
		}
	})
}

// TestAcquirerLostReply loses the reply of a grant (TryAcquire, Acquire), a
// renewal and a release. A grant whose reply was lost is adopted (asked
// again with its nonce) or released: never an orphan lease that blocks the
// name for its ttl, never a bare transport error.
func TestAcquirerLostReply(t *testing.T) {
	ctx := context.Background()
	other, _ := redislua.NewAcquirer(testenv.RedisClient(t), nil)
	const ttl = time.Minute // an orphan lease would outlive the test
	eachRetryMode(t, func(t *testing.T, p *faultnet.Proxy, c *redis.Client) {
		a, _ := redislua.NewAcquirer(c, nil)
		name := fencetest.Name("lostacq")
		warm, err := a.TryAcquire(ctx, name, ttl) // loads the script
		if err != nil {
			t.Fatal(err)
		}
		if err := warm.Release(ctx); err != nil {
			t.Fatal(err)
		}
		for _, how := range []string{"TryAcquire", "Acquire"} {
			loseNextScript(t, p)
			var l fence.Lease
			if how == "TryAcquire" {
				l, err = a.TryAcquire(ctx, name, ttl)
			} else {
				actx, cancel := context.WithTimeout(ctx, 20*time.Second)
				l, err = a.Acquire(actx, name, ttl)
				cancel()
			}
			if err != nil {
				t.Fatalf("%s whose reply was lost: %v, want the grant adopted", how, err)
			}
			if p.Pending() != 0 {
				t.Fatalf("%s: the lost reply was never taken", how)
			}
			if _, err := other.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
				t.Fatalf("%s: another acquirer while the adopted lease is held: %v, want ErrHeld", how, err)
			}
			loseNextScript(t, p)
			if err := l.Renew(ctx); err != nil && !errors.Is(err, fence.ErrUnknown) {
				t.Fatalf("%s: Renew whose reply was lost: %v, want nil or ErrUnknown", how, err)
			}
			loseNextScript(t, p)
			if err := l.Release(ctx); err != nil {
				checkUnknown(t, how+": Release", err)
			}
			ol, err := other.TryAcquire(ctx, name, ttl)
			if err != nil {
				t.Fatalf("%s: the name after a Release whose reply was lost: %v, want free", how, err)
			}
			if err := ol.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// TestAcquirerGrantUnreachable: when every try of a grant loses its reply
// the grant is given up, and one that was made is released, not left to
// block the name for its ttl.
func TestAcquirerGrantUnreachable(t *testing.T) {
	ctx := context.Background()
	other, _ := redislua.NewAcquirer(testenv.RedisClient(t), nil)
	p := faultnet.Start(t, testenv.RedisAddr())
	a, _ := redislua.NewAcquirer(viaProxy(t, p, -1), nil)
	name := fencetest.Name("unreach")
	if l, err := a.TryAcquire(ctx, name, time.Minute); err != nil { // loads the script
		t.Fatal(err)
	} else if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// Lose the try and every try again; the "leave" that undoes the grant
	// gets through.
	for i := 0; i < 4; i++ {
		p.LoseReply(func(b []byte) bool { return isScript(b) && !bytes.Contains(b, []byte("leave")) })
	}
	_, err := a.TryAcquire(ctx, name, time.Minute)
	if err == nil || errors.Is(err, fence.ErrUnknown) || errors.Is(err, io.EOF) || !strings.Contains(err.Error(), "not granted") {
		t.Fatalf("TryAcquire with every reply lost: %v, want a definite 'not granted'", err)
	}
	if p.Pending() != 0 {
		t.Fatalf("%d lost replies never taken", p.Pending())
	}
	l, err := other.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatalf("the name after a grant whose replies were all lost: %v, want free", err)
	}
	l.Release(ctx)
}
