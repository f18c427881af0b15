package redislua_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// TestWriterIdempotencyKeysApart (HAZARDS 4, two names one row): with the
// default prefix, the Writer's key "idem:k" and the idempotency store's key
// "k" must not share a Redis key, or a Begin on "k" wipes the Writer's fence
// and a stale write is accepted.
func TestWriterIdempotencyKeysApart(t *testing.T) {
	ctx := context.Background()
	c := testenv.RedisClient(t)
	w, _ := redislua.NewWriter(c, nil)
	s, _ := redislua.NewIdempotencyStore(c, nil)
	k := fencetest.Name("apart")
	wkey := "idem:" + k
	err := w.Write(ctx, wkey, []byte("new"), 10)
	if errors.Is(err, fence.ErrInvalid) {
		return // refused: the two key spaces cannot meet
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Begin(ctx, k, "fp", "o", time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, wkey, []byte("stale"), 5); !errors.Is(err, fence.ErrStale) {
		v, tok, _ := w.Read(ctx, wkey)
		t.Fatalf("token 5 after token 10 and an idempotency Begin on %q: %v (key holds %q at %d), want ErrStale", k, err, v, tok)
	}
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

// TestRedlockLostReply (HAZARDS 3): a Redlock Release or Renew whose
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

// TestDriftOverTTL (HAZARDS 6 and 8): a ttl that Drift leaves no local
// validity for is refused (ErrInvalid), not granted as a lease that is
// already lost with a nil error while Redis holds the name for the ttl.
func TestDriftOverTTL(t *testing.T) {
	a, err := redislua.NewAcquirer(testenv.RedisClient(t), &redislua.AcquirerOptions{Drift: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	r, err := redislua.NewRedlock([]redislua.Client{testenv.RedisClient(t)}, &redislua.RedlockOptions{Drift: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Run("Acquirer", func(t *testing.T) { fencetest.DriftRefusesShortTTL(t, a, time.Second, "ttl") })
	t.Run("Redlock", func(t *testing.T) { fencetest.DriftRefusesShortTTL(t, r, time.Second, "ttl") })
}

// TestFencedScriptPipeline: Run through a pipeline (the doc allows one)
// must not report a failure for a body that then runs when the pipeline is
// executed.
func TestFencedScriptPipeline(t *testing.T) {
	ctx := context.Background()
	c := testenv.RedisClient(t)
	incr := redislua.NewFencedScript(`return redis.call('INCR', KEYS[1])`)
	tag := fencetest.Name("pipe")
	fenceKey, counter := "{"+tag+"}:fence", "{"+tag+"}:n"
	if _, err := incr.Run(ctx, c, fenceKey, 3, []string{counter}); err != nil { // loads the script
		t.Fatal(err)
	}
	pipe := c.Pipeline()
	_, runErr := incr.Run(ctx, pipe, fenceKey, 3, []string{counter})
	_, execErr := pipe.Exec(ctx)
	n, _ := c.Get(ctx, counter).Int()
	if runErr != nil && n != 1 {
		t.Fatalf("Run through a pipeline: %v, but Exec (%v) ran the body: counter %d, want 1", runErr, execErr, n)
	}
}

// TestRedlockGrantLostReply (HAZARDS 3): a grant whose lock replies were lost
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

// TestRedlockOneServerTwice: two nodes that are one Redis server (two
// clients of one address) must not make a majority of three on their own:
// each node's lock call is its own vote, and a call to one node must not
// adopt the grant another node's call made on the same server.
func TestRedlockOneServerTwice(t *testing.T) {
	srv := testenv.StartRedis(t)
	down := faultnet.Start(t, testenv.StartRedis(t).Addr)
	down.Refuse(true)
	nodes := []redislua.Client{srv.Client(t), srv.Client(t), viaProxy(t, down, -1)}
	r, err := redislua.NewRedlock(nodes, &redislua.RedlockOptions{NodeTimeout: time.Second})
	if err != nil {
		return // refused: fine
	}
	l, err := r.TryAcquire(context.Background(), fencetest.Name("twice"), time.Minute)
	if err == nil {
		l.Release(context.Background())
		t.Fatal("a Redlock of three nodes granted with one Redis server up (nodes 0 and 1 are that one server)")
	}
}

// TestBumpLostReply (HAZARDS 3): a Bump whose reply was lost after Redis
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

// TestAcquireGrantUnheardThenCut (HAZARDS 3): a waiter that is granted the
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

// TestIdempotencyBeginBadLease (HAZARDS 8): a Begin with a lease that is not
// positive is refused with fence.ErrInvalid and claims nothing, as Update refuses a
// negative lease.
func TestIdempotencyBeginBadLease(t *testing.T) {
	ctx := context.Background()
	s, _ := redislua.NewIdempotencyStore(testenv.RedisClient(t), nil)
	for _, lease := range []time.Duration{-time.Second, 0} {
		k := fencetest.Name("badlease")
		_, created, err := s.Begin(ctx, k, "fp", "o", lease)
		if !errors.Is(err, fence.ErrInvalid) {
			t.Fatalf("Begin with lease %v: created %v, %v; want ErrInvalid", lease, created, err)
		}
		if _, err := s.Get(ctx, k); !errors.Is(err, fence.ErrNotFound) {
			t.Fatalf("Begin with lease %v left a record: %v", lease, err)
		}
	}
}
