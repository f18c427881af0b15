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

// redlockViaProxies returns a Redlock on three fresh Redis servers, each
// reached through its own fault proxy.
func redlockViaProxies(t *testing.T, retries int) (*redislua.Redlock, []*faultnet.Proxy, []*redis.Client) {
	var (
		nodes   []redislua.Client
		proxies []*faultnet.Proxy
		direct  []*redis.Client
	)
	for i := 0; i < 3; i++ {
		srv := testenv.StartRedis(t)
		p := faultnet.Start(t, srv.Addr)
		proxies = append(proxies, p)
		nodes = append(nodes, viaProxy(t, p, retries))
		direct = append(direct, srv.Client(t))
	}
	r, err := redislua.NewRedlock(nodes, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return r, proxies, direct
}

// TestRedlockLostReply: a Redlock Release or Renew whose
// replies were lost after every node ran it is nil or fence.ErrUnknown,
// never ErrLost (it was held) nor a bare transport error.
func TestRedlockLostReply(t *testing.T) {
	for _, m := range []struct {
		name    string
		retries int
	}{{"default-retries", 0}, {"no-retries", -1}} {
		t.Run(m.name, func(t *testing.T) {
			r, proxies, direct := redlockViaProxies(t, m.retries)
			ctx := context.Background()
			// One lease loads the lock, renew and release scripts on every
			// node, so the lost replies are the scripts' own, not NOSCRIPT.
			warm, err := r.TryAcquire(ctx, fencetest.Name("rlwarm"), time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if err := warm.Renew(ctx); err != nil {
				t.Fatal(err)
			}
			if err := warm.Release(ctx); err != nil {
				t.Fatal(err)
			}
			name := fencetest.Name("rllost")
			l, err := r.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range proxies {
				loseNextScript(t, p)
			}
			if err := l.Renew(ctx); err != nil && !errors.Is(err, fence.ErrUnknown) {
				t.Errorf("Renew whose replies were lost on every node: %v, want nil or ErrUnknown", err)
			}
			for _, p := range proxies {
				loseNextScript(t, p)
			}
			if err := l.Release(ctx); err != nil {
				checkUnknown(t, "Redlock Release", err)
			}
			for i, p := range proxies {
				if p.Pending() != 0 {
					t.Fatalf("node %d: a lost reply was never taken", i)
				}
				if n, err := direct[i].Exists(ctx, "fence:{"+name+"}:lock").Result(); err != nil || n != 0 {
					t.Fatalf("node %d after the release: lock exists %d, %v", i, n, err)
				}
			}
		})
	}
}

// TestRedlockGrantLostReply: a grant whose lock replies were lost
// on a majority of nodes, with the name free, is never ErrHeld (nobody holds
// it), and leaves the name free once it is given up or released.
func TestRedlockGrantLostReply(t *testing.T) {
	for _, m := range []struct {
		name    string
		retries int
	}{{"default-retries", 0}, {"no-retries", -1}} {
		t.Run(m.name, func(t *testing.T) {
			r, proxies, direct := redlockViaProxies(t, m.retries)
			ctx := context.Background()
			warm, err := r.TryAcquire(ctx, fencetest.Name("rlwarm"), time.Minute) // loads the lock script
			if err != nil {
				t.Fatal(err)
			}
			if err := warm.Release(ctx); err != nil {
				t.Fatal(err)
			}
			name := fencetest.Name("rlgrant")
			loseNextScript(t, proxies[0])
			loseNextScript(t, proxies[1])
			l, err := r.TryAcquire(ctx, name, time.Minute)
			if errors.Is(err, fence.ErrHeld) {
				t.Fatalf("TryAcquire of a free name whose lock replies were lost on 2 of 3 nodes: %v, want a lease, ErrUnknown or ErrNoQuorum", err)
			}
			if err == nil {
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if proxies[0].Pending()+proxies[1].Pending() != 0 {
				t.Fatal("a lost reply was never taken")
			}
			var nodes []redislua.Client
			for _, c := range direct {
				nodes = append(nodes, c)
			}
			other, _ := redislua.NewRedlock(nodes, nil)
			ol, err := other.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatalf("the name after the grant: %v, want free", err)
			}
			ol.Release(ctx)
		})
	}
}

// TestBumpLostReply: a Bump whose reply was lost after Redis
// raised the counter is fence.ErrUnknown, never ErrInvalid ("already at or
// above") from a resend that found its own change, nor a bare EOF.
func TestBumpLostReply(t *testing.T) {
	ctx := context.Background()
	eachRetryMode(t, func(t *testing.T, p *faultnet.Proxy, c *redis.Client) {
		a, _ := redislua.NewAcquirer(c, nil)
		name := fencetest.Name("lostbump")
		if err := a.Bump(ctx, name, 10); err != nil { // loads the script
			t.Fatal(err)
		}
		loseNextScript(t, p)
		checkUnknown(t, "Bump", a.Bump(ctx, name, 20))
		if p.Pending() != 0 {
			t.Fatal("the lost reply was never taken")
		}
		info, err := a.Inspect(ctx, name)
		if err != nil || info.Counter != 20 {
			t.Fatalf("counter after the lost Bump: %+v, %v; want 20", info, err)
		}
	})
}

// TestAcquireGrantUnheardThenCut: a waiter that is granted the
// lease while the network to Redis is partitioned, and whose leave cannot
// reach Redis when its ctx ends, may hold the lease: its error must match
// fence.ErrUnknown, not report the name as held by another holder alone.
func TestAcquireGrantUnheardThenCut(t *testing.T) {
	ctx := context.Background()
	direct := testenv.RedisClient(t)
	holderAcq, _ := redislua.NewAcquirer(direct, nil)
	p := faultnet.Start(t, testenv.RedisAddr())
	// go-redis bounds a request by ReadTimeout, not by ctx: keep it short.
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), ReadTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { c.Close() })
	a, _ := redislua.NewAcquirer(c, nil)
	name := fencetest.Name("unheard")
	h, err := holderAcq.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	actx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		l, err := a.Acquire(actx, name, time.Minute)
		if l != nil {
			l.Release(ctx)
		}
		done <- err
	}()
	line := "fence:{" + name + "}:line"
	for direct.LLen(ctx, line).Val() == 0 {
		time.Sleep(time.Millisecond) // polls Redis for the waiter's place
	}
	p.Partition()
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var aerr error
	select {
	case aerr = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Acquire did not return")
	}
	held := direct.Exists(ctx, "fence:{"+name+"}:lock").Val() == 1
	p.Heal()
	if held && !errors.Is(aerr, fence.ErrUnknown) {
		t.Fatalf("Acquire that may hold the lease (granted while partitioned, leave unanswered): %v, want an error matching fence.ErrUnknown", aerr)
	}
}
