package redislua_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
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
	for _, m := range retryModes {
		t.Run(m.name, func(t *testing.T) {
			p := faultnet.Start(t, testenv.RedisAddr())
			f(t, p, viaProxy(t, p, m.retries))
		})
	}
}

// retryModes are go-redis's default retries (MaxRetries 0) and none (-1).
var retryModes = []struct {
	name    string
	retries int
}{{"default-retries", 0}, {"no-retries", -1}}

// eachRedlockRetryMode runs f with a Redlock from redlockViaProxies, once
// with go-redis's default retries and once with none.
func eachRedlockRetryMode(t *testing.T, f func(t *testing.T, retries int, r *redislua.Redlock, proxies []*faultnet.Proxy, direct []*redis.Client)) {
	for _, m := range retryModes {
		t.Run(m.name, func(t *testing.T) {
			r, proxies, direct := redlockViaProxies(t, m.retries)
			f(t, m.retries, r, proxies, direct)
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
		w := newWriterOn(t, c, nil)
		rw := newWriterOn(t, direct, nil)
		key := writtenKey(ctx, t, w, "lostw", "v1", 3) // loads the script
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
		s := newStoreOn(t, c, nil)
		rs := newStoreOn(t, direct, nil)
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
	other := newAcquirerOn(t, testenv.RedisClient(t), nil)
	const ttl = time.Minute // an orphan lease would outlive the test
	eachRetryMode(t, func(t *testing.T, p *faultnet.Proxy, c *redis.Client) {
		a := newAcquirerOn(t, c, nil)
		name := fencetest.Name("lostacq")
		warmUp(ctx, t, a, name, ttl, false) // loads the script
		for _, how := range []string{"TryAcquire", "Acquire"} {
			loseNextScript(t, p)
			var l fence.Lease
			var err error
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
	other := newAcquirerOn(t, testenv.RedisClient(t), nil)
	p := faultnet.Start(t, testenv.RedisAddr())
	a := newAcquirerOn(t, viaProxy(t, p, -1), nil)
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
	r := newRedlock(t, nodes, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second})
	return r, proxies, direct
}

// TestRedlockLostReply: a Redlock Release or Renew whose
// replies were lost after every node ran it is nil or fence.ErrUnknown,
// never ErrLost (it was held) nor a bare transport error.
func TestRedlockLostReply(t *testing.T) {
	eachRedlockRetryMode(t, func(t *testing.T, retries int, r *redislua.Redlock, proxies []*faultnet.Proxy, direct []*redis.Client) {
		ctx := context.Background()
		// One lease loads the lock, renew and release scripts on every
		// node, so the lost replies are the scripts' own, not NOSCRIPT.
		warmUp(ctx, t, r, fencetest.Name("rlwarm"), time.Minute, true)
		name := fencetest.Name("rllost")
		l := mustTryAcquire(ctx, t, r, name, time.Minute)
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

// TestRedlockGrantLostReply: a grant whose lock replies were lost
// on a majority of nodes, with the name free, is never ErrHeld (nobody holds
// it), and leaves the name free once it is given up or released.
func TestRedlockGrantLostReply(t *testing.T) {
	eachRedlockRetryMode(t, func(t *testing.T, retries int, r *redislua.Redlock, proxies []*faultnet.Proxy, direct []*redis.Client) {
		ctx := context.Background()
		warmUp(ctx, t, r, fencetest.Name("rlwarm"), time.Minute, false) // loads the lock script
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
		other := newRedlock(t, nodes, nil)
		ol, err := other.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatalf("the name after the grant: %v, want free", err)
		}
		ol.Release(ctx)
	})
}

// TestBumpLostReply: a Bump whose reply was lost after Redis
// raised the counter is fence.ErrUnknown, never ErrInvalid ("already at or
// above") from a resend that found its own change, nor a bare EOF.
func TestBumpLostReply(t *testing.T) {
	ctx := context.Background()
	eachRetryMode(t, func(t *testing.T, p *faultnet.Proxy, c *redis.Client) {
		a := newAcquirerOn(t, c, nil)
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
	holderAcq := newAcquirerOn(t, direct, nil)
	// go-redis bounds a request by ReadTimeout, not by ctx: keep it short.
	c, p := clientVia(t, testenv.RedisAddr(), redis.Options{ReadTimeout: 500 * time.Millisecond})
	a := newAcquirerOn(t, c, nil)
	name := fencetest.Name("unheard")
	h := mustTryAcquire(ctx, t, holderAcq, name, time.Minute)
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

// replyWindow is how long a lost reply keeps its client waiting in the
// recognition tests: the send that recognises an earlier one comes at least
// this long after it, far more than the drift taken off a 1s lease.
const replyWindow = 300 * time.Millisecond

// recognisedTTL is the ttl of the leases in the recognition tests.
const recognisedTTL = time.Second

// outlivesNoKey waits until no node of nodes holds the lease's lock key
// with a value ending in the lease's token, counting as gone once a
// majority of nodes no longer hold it (then another grant can be made), and
// fails if the lease's context is still live at that moment: a holder that
// checks its lease's context before a write must never find it live once
// Redis let the key expire.
func outlivesNoKey(t *testing.T, l fence.Lease, nodes []*redis.Client) {
	t.Helper()
	ctx := context.Background()
	lock := "fence:{" + l.Name() + "}:lock"
	suffix := strconv.FormatUint(uint64(l.Token()), 10)
	deadline := time.Now().Add(l.(interface{ TTL() time.Duration }).TTL() + 30*time.Second)
	for {
		gone := 0
		for _, c := range nodes {
			v, err := c.Get(ctx, lock).Result()
			switch {
			case errors.Is(err, redis.Nil):
				gone++
			case err != nil:
				t.Fatal(err)
			case !strings.HasSuffix(v, ":"+suffix) && !strings.Contains(v, "."):
				gone++ // a single instance's lock of another grant
			}
		}
		if gone > len(nodes)/2 {
			if err := l.Context().Err(); err == nil {
				t.Fatalf("lease %q token %d: its context is live after Redis let its lock key expire (local deadline %v ahead)",
					l.Name(), l.Token(), time.Until(l.(interface{ LocalDeadline() time.Time }).LocalDeadline()))
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("lease %q: the lock key never expired", l.Name())
		}
		time.Sleep(time.Millisecond) // polls Redis for the key
	}
}

// scriptFor matches a script call that carries name and, when op is not
// empty, the lock script's operation op.
func scriptFor(name, op string) func([]byte) bool {
	return func(b []byte) bool {
		return isScript(b) && faultnet.Carries(b, name) && (op == "" || faultnet.Carries(b, op))
	}
}

// allTaken fails t unless every fault armed on proxies was taken.
func allTaken(t *testing.T, proxies ...*faultnet.Proxy) {
	t.Helper()
	for i, p := range proxies {
		if p.Pending() != 0 {
			t.Fatalf("proxy %d: the armed fault was never taken", i)
		}
	}
}

// checkRecognised fails t with what unless the grant (l, err) was
// recognised as the client's own, every fault armed on proxies was taken,
// and l outlives no lock key on nodes.
func checkRecognised(t *testing.T, what string, l fence.Lease, err error, proxies []*faultnet.Proxy, nodes []*redis.Client) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v, want the grant recognised", what, err)
	}
	allTaken(t, proxies...)
	outlivesNoKey(t, l, nodes)
}

// lateCall waits up to 30s for a held call to come back on landed, and
// fails t with what unless it did without an error.
func lateCall(t *testing.T, landed <-chan *redis.Cmd, what string) *redis.Cmd {
	t.Helper()
	select {
	case c := <-landed:
		if c.Err() != nil {
			t.Fatalf("%s: %v", what, c.Err())
		}
		return c
	case <-time.After(30 * time.Second):
		t.Fatalf("%s never came back", what)
	}
	return nil
}

// armFault arms p to lose the reply ("lost") or drop the request
// ("dropped") of the next call that match accepts.
func armFault(p *faultnet.Proxy, fault string, match func([]byte) bool) {
	if fault == "lost" {
		p.LoseReply(match)
	} else {
		p.DropRequest(match)
	}
}

// checkRecognisedRenew grants name for recognisedTTL and renews it a third
// into the lease, as fence.Hold does (a deadline counted from the renewal's
// send would then lie a third of a ttl past the key's expiry), once arm has
// armed the renewal's fault on proxies: the renewal (what) is nil or
// ErrUnknown, every fault is taken, and the lease outlives no lock key on
// nodes.
func checkRecognisedRenew(ctx context.Context, t *testing.T, a fence.Acquirer, name, what string, arm func(name string), proxies []*faultnet.Proxy, nodes []*redis.Client) {
	t.Helper()
	for try := 1; ; try++ {
		n := fmt.Sprintf("%s-%d", name, try)
		l := mustTryAcquire(ctx, t, a, n, recognisedTTL)
		time.Sleep(recognisedTTL / 3)
		arm(n)
		deadline := l.(interface{ LocalDeadline() time.Time }).LocalDeadline()
		err := l.Renew(ctx)
		if errors.Is(err, fence.ErrLost) && time.Now().After(deadline) && try < 3 {
			// The renewal (resent after its lost replies) came back after
			// the lease's local deadline, on a loaded machine: a lost
			// lease is then the right answer, and the scenario did not
			// happen. Run it again on a fresh name.
			t.Logf("%s: answered after the local deadline (%v); again", what, err)
			continue
		}
		if err != nil && !errors.Is(err, fence.ErrUnknown) {
			t.Fatalf("%s: %v, want nil or ErrUnknown", what, err)
		}
		allTaken(t, proxies...)
		outlivesNoKey(t, l, nodes)
		return
	}
}

// TestRecognisedSendCountsFromFirstSend: a grant or renewal whose reply was
// lost after Redis ran it, and that the next send (by go-redis, by the
// acquirer, or a waiter's next poll) recognises as its own, gives a lease
// whose local deadline is no later than Redis's expiry of the lock key: it
// counts from the first send that may have set the key, unless the
// recognising send set the expiry again. A grant handed to a waiter by a
// release whose reply was lost is recognised at the waiter's next poll, and
// a renewal whose request never reached Redis moves no deadline.
func TestRecognisedSendCountsFromFirstSend(t *testing.T) {
	ctx := context.Background()
	direct := testenv.RedisClient(t)
	other := newAcquirerOn(t, direct, nil)
	eachRetryMode(t, func(t *testing.T, p *faultnet.Proxy, c *redis.Client) {
		p.ReplyWindow(replyWindow)
		a := newAcquirerOn(t, c, nil)
		warmUp(ctx, t, a, fencetest.Name("recwarm"), time.Minute, true) // loads the scripts
		t.Run("try", func(t *testing.T) {
			name := fencetest.Name("rectry")
			p.LoseReply(scriptFor(name, "try"))
			l, err := a.TryAcquire(ctx, name, recognisedTTL)
			checkRecognised(t, "TryAcquire whose reply was lost", l, err, []*faultnet.Proxy{p}, []*redis.Client{direct})
		})
		t.Run("wait", func(t *testing.T) {
			// A waiter in line on another name keeps the grant channel
			// subscribed, so that the Acquire below waits in line from its
			// first request: a "wait" that grants the free name.
			keep := fencetest.Name("reckeep")
			kh := mustTryAcquire(ctx, t, other, keep, time.Minute)
			defer kh.Release(ctx)
			kctx, kcancel := context.WithCancel(ctx)
			kdone := make(chan struct{})
			go func() {
				defer close(kdone)
				if l, err := a.Acquire(kctx, keep, time.Minute); err == nil {
					l.Release(ctx)
				}
			}()
			defer func() { kcancel(); <-kdone }()
			waitInLine(t, direct, keep, 1)
			name := fencetest.Name("recwait")
			p.LoseReply(scriptFor(name, "wait"))
			actx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			l, err := a.Acquire(actx, name, recognisedTTL)
			checkRecognised(t, "Acquire whose granting reply was lost", l, err, []*faultnet.Proxy{p}, []*redis.Client{direct})
		})
		t.Run("handoff", func(t *testing.T) {
			// The holder and the waiter share an acquirer: the release
			// hands the lease over in its reply only, which is lost.
			name := fencetest.Name("rechand")
			h := mustTryAcquire(ctx, t, a, name, time.Minute)
			actx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			done := acquireInBackground(actx, a, name, recognisedTTL)
			waitInLine(t, direct, name, 1)
			p.LoseReply(scriptFor(name, "release"))
			if err := h.Release(ctx); err != nil {
				checkUnknown(t, "Release that handed the lease over", err)
			}
			r := <-done
			checkRecognised(t, "the waiter after a release whose reply was lost", r.l, r.err, []*faultnet.Proxy{p}, []*redis.Client{direct})
		})
		for _, fault := range []string{"lost", "dropped"} {
			t.Run("renew-"+fault, func(t *testing.T) {
				checkRecognisedRenew(ctx, t, a, fencetest.Name("recrenew"), "Renew whose request was "+fault, func(name string) {
					// The renewal is the only script on name without the
					// grant channel among its arguments.
					armFault(p, fault, func(b []byte) bool { return scriptFor(name, "")(b) && !faultnet.Carries(b, "fence:grant:") })
				}, []*faultnet.Proxy{p}, []*redis.Client{direct})
			})
		}
	})
}

// TestRedlockRecognisedSendCountsFromFirstSend: a Redlock grant whose lock
// replies were lost on a majority of nodes, which go-redis sends again and
// the nodes recognise as this grant's without setting the expiry again,
// gives a lease whose context ends no later than the majority's keys
// expire: its validity counts from the first send. A renewal whose replies
// were lost, or whose requests never reached a majority, does the same.
func TestRedlockRecognisedSendCountsFromFirstSend(t *testing.T) {
	ctx := context.Background()
	eachRedlockRetryMode(t, func(t *testing.T, retries int, r *redislua.Redlock, proxies []*faultnet.Proxy, direct []*redis.Client) {
		for _, p := range proxies {
			p.ReplyWindow(replyWindow)
		}
		warmUp(ctx, t, r, fencetest.Name("rlrecwarm"), time.Minute, true) // loads the scripts
		if retries == 0 {
			// Without go-redis's resend, the grant has no majority.
			t.Run("grant", func(t *testing.T) {
				name := fencetest.Name("rlrecgrant")
				proxies[0].LoseReply(scriptFor(name, ""))
				proxies[1].LoseReply(scriptFor(name, ""))
				l, err := r.TryAcquire(ctx, name, recognisedTTL)
				checkRecognised(t, "TryAcquire whose lock replies were lost on 2 of 3 nodes", l, err, proxies, direct)
			})
		}
		for _, fault := range []string{"lost", "dropped"} {
			t.Run("renew-"+fault, func(t *testing.T) {
				checkRecognisedRenew(ctx, t, r, fencetest.Name("rlrecrenew"), "Renew whose requests were "+fault+" on 2 of 3 nodes", func(name string) {
					for _, p := range proxies[:2] {
						armFault(p, fault, scriptFor(name, ""))
					}
				}, proxies, direct)
			})
		}
	})
}

// TestCallsKeepTheirContextDeadline: with a go-redis client that
// does not honour context deadlines (ContextTimeoutEnabled off, the default:
// it waits ReadTimeout, 3s, and sends again), a call through a partition
// returns soon after its context's deadline, with an error that says the
// outcome is unknown (a read: the context's error), instead of after the
// client's own timeouts. An acquire that gives up spends up to 1s more
// trying to undo a grant it may have made (leaving the line), and since
// that cannot reach Redis either, its error matches fence.ErrUnknown.
func TestCallsKeepTheirContextDeadline(t *testing.T) {
	ctx := context.Background()
	p, c, a := proxiedAcquirer(t, redis.Options{}) // ContextTimeoutEnabled off
	w := newWriterOn(t, c, nil)
	name := fencetest.Name("deadline")
	l := mustTryAcquire(ctx, t, a, name, time.Minute) // connects and loads the scripts
	if err := w.Write(ctx, name, []byte("v"), l.Token()); err != nil {
		t.Fatal(err)
	}
	if _, _, err := w.Read(ctx, name); err != nil {
		t.Fatal(err)
	}
	is := newStoreOn(t, c, nil)
	if _, err := is.Get(ctx, name); err != nil && !errors.Is(err, fence.ErrNotFound) {
		t.Fatal(err)
	}
	const wait = 200 * time.Millisecond
	tried := fencetest.Name("deadline")
	calls := []struct {
		name  string
		slack time.Duration // allowed past the deadline
		call  func(ctx context.Context) error
		want  error // the error must match this
	}{
		{"TryAcquire", 1500 * time.Millisecond, func(ctx context.Context) error {
			_, err := a.TryAcquire(ctx, tried, time.Minute)
			return err
		}, fence.ErrUnknown},
		{"Acquire", 1500 * time.Millisecond, func(ctx context.Context) error {
			_, err := a.Acquire(ctx, name, time.Minute)
			return err
		}, fence.ErrUnknown},
		{"Renew", 500 * time.Millisecond, l.Renew, fence.ErrUnknown},
		{"Write", 500 * time.Millisecond, func(ctx context.Context) error {
			return w.Write(ctx, name, []byte("w"), l.Token())
		}, fence.ErrUnknown},
		{"Read", 500 * time.Millisecond, func(ctx context.Context) error {
			_, _, err := w.Read(ctx, name)
			return err
		}, context.DeadlineExceeded},
		{"Release", 500 * time.Millisecond, l.Release, fence.ErrUnknown},
		{"IdempotencyStore.Get", 500 * time.Millisecond, func(ctx context.Context) error {
			_, err := is.Get(ctx, name)
			if !errors.Is(err, context.DeadlineExceeded) {
				return fmt.Errorf("%v, want it to match the context's error too", err)
			}
			return err
		}, fence.ErrUnknown},
		{"IdempotencyStore.Begin", 500 * time.Millisecond, func(ctx context.Context) error {
			_, _, err := is.Begin(ctx, name, "fp", "owner", time.Minute)
			return err
		}, fence.ErrUnknown},
	}
	p.Partition()
	healed := false
	defer func() {
		if !healed {
			p.Heal()
		}
	}()
	for _, tc := range calls {
		cctx, cancel := context.WithTimeout(ctx, wait)
		start := time.Now()
		err := tc.call(cctx)
		took := time.Since(start)
		cancel()
		t.Logf("%s through a partition with a %v context: %v after %v", tc.name, wait, err, took.Round(time.Millisecond))
		if err == nil {
			t.Errorf("%s through a partition: nil error", tc.name)
		}
		if tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("%s through a partition: %v, want an error matching %v", tc.name, err, tc.want)
		}
		if took > wait+tc.slack {
			t.Errorf("%s with a %v context returned after %v (allowed %v)", tc.name, wait, took, wait+tc.slack)
		}
	}
	// The TryAcquire that gave up must not hold its name for the
	// minute's ttl once its held requests land: its leave marks its nonce
	// gone (a try landing later is refused) or releases what it granted.
	p.Heal()
	healed = true
	other := newAcquirerOn(t, testenv.RedisClient(t), nil)
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	ol, err := other.Acquire(actx, tried, time.Minute)
	if err != nil {
		t.Fatalf("the name of a TryAcquire that gave up in a partition, after healing: %v, want it free", err)
	}
	_ = ol.Release(ctx)
}

// proxiedAcquirer returns a fault proxy to Redis, a go-redis client with
// options o (its Addr the proxy's) and an acquirer on that client.
func proxiedAcquirer(t *testing.T, o redis.Options) (*faultnet.Proxy, *redis.Client, *redislua.Acquirer) {
	t.Helper()
	p := faultnet.Start(t, testenv.RedisAddr())
	o.Addr = p.Addr()
	c := redis.NewClient(&o)
	t.Cleanup(func() { c.Close() })
	a := newAcquirerOn(t, c, nil)
	return p, c, a
}

// TestAbandonedLockCallLandsLate: a TryAcquire and an Acquire whose context
// ends in a partition that outlasts the client's ReadTimeout return
// fence.ErrUnknown while their lock script calls (on connections opened
// before the partition) are held; their leave, which needs a new connection,
// cannot even be sent before the client gives up. After the partition heals
// the held "try" lands and grants: the name must still be free soon for
// another acquirer, not held for the minute's ttl.
func TestAbandonedLockCallLandsLate(t *testing.T) {
	ctx := context.Background()
	// ContextTimeoutEnabled off; a short ReadTimeout so that the abandoned
	// calls return (and write their results) while the test still runs.
	p, _, a := proxiedAcquirer(t, redis.Options{ReadTimeout: 300 * time.Millisecond, MaxRetries: 1})
	warm := fencetest.Name("late")
	warmUp(ctx, t, a, warm, time.Minute, false) // connects and loads the scripts
	tried, waited := fencetest.Name("late"), fencetest.Name("late")
	other := newAcquirerOn(t, testenv.RedisClient(t), nil)
	held := mustTryAcquire(ctx, t, other, waited, time.Minute)
	p.Partition()
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	_, terr := a.TryAcquire(cctx, tried, time.Minute)
	cancel()
	cctx, cancel = context.WithTimeout(ctx, 100*time.Millisecond)
	_, aerr := a.Acquire(cctx, waited, time.Minute)
	cancel()
	p.Heal()
	t.Logf("through a partition: TryAcquire(%s) %v; Acquire(%s) %v", tried, terr, waited, aerr)
	if terr == nil || aerr == nil {
		t.Fatalf("through a partition: TryAcquire %v, Acquire %v; want errors", terr, aerr)
	}
	if !errors.Is(terr, fence.ErrUnknown) && !errors.Is(terr, fence.ErrHeld) {
		t.Errorf("TryAcquire through a partition: %v", terr)
	}
	// The held calls land now; each of the two names must be free for the
	// other acquirer soon (not after the minute's ttl).
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{tried, waited} {
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		start := time.Now()
		ol, err := other.Acquire(actx, name, time.Minute)
		cancel()
		if err != nil {
			t.Fatalf("%s after the partition healed: %v, want it free", name, err)
		}
		t.Logf("%s free for another acquirer after %v", name, time.Since(start).Round(time.Millisecond))
		_ = ol.Release(ctx)
	}
	// Let the abandoned calls' client timeouts pass, so that any result
	// they write lands while the test runs.
	time.Sleep(time.Second)
}

// TestAcquireEndsWithARequestInFlight: an Acquire whose context ends while
// its request is on a slow link (faultnet latency above the wait), whose
// leave then lands and settles that it was not granted, returns what any
// wait that ran out returns: fence.ErrHeld joined with the context's error,
// not fence.ErrUnknown (the conformance suite's AcquireGivesUpAtDeadline and
// AcquireCancelled failed so on a loaded machine, through Sentinel).
func TestAcquireEndsWithARequestInFlight(t *testing.T) {
	ctx := context.Background()
	p, _, a := proxiedAcquirer(t, redis.Options{ContextTimeoutEnabled: true})
	warm := fencetest.Name("inflight")
	l := mustTryAcquire(ctx, t, a, warm, time.Minute) // connects and loads the scripts
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	holder := newAcquirerOn(t, testenv.RedisClient(t), nil)
	name := fencetest.Name("inflight")
	h := mustTryAcquire(ctx, t, holder, name, time.Minute)
	defer h.Release(ctx)
	p.Latency(100*time.Millisecond, 100*time.Millisecond)
	wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	// The link is slow while the wait runs, and fast again once it ended: the
	// leave (on a new connection: go-redis drops the one whose request timed
	// out) then needs no 200ms round trips for its dial, HELLO and script, which
	// on a loaded machine took longer than the leave's 1s and
	// made the Acquire ErrUnknown. A leave sent before the latency is off
	// still has that 1s.
	res := acquireInBackground(wctx, a, name, time.Minute)
	<-wctx.Done()
	p.Latency(0, 0)
	r := <-res
	got, err := r.l, r.err
	if err == nil {
		_ = got.Release(ctx)
		t.Fatal("granted a held name")
	}
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Acquire whose context ended with its request in flight: %v, want ErrHeld joined with DeadlineExceeded (and not ErrUnknown)", err)
	}
}

// lateClient sends its next script call through a partitioned proxy and
// reports a read timeout at once, as go-redis does when ReadTimeout passes
// while the request is still on its way: the call lands when the proxy heals.
type lateClient struct {
	*redis.Client
	slow   *redis.Client
	armed  atomic.Bool
	landed chan *redis.Cmd
}

func (h *lateClient) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	if h.armed.CompareAndSwap(true, false) {
		go func() { h.landed <- h.slow.EvalSha(context.WithoutCancel(ctx), sha, keys, args...) }()
		cmd := redis.NewCmd(ctx)
		cmd.SetErr(&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded})
		return cmd
	}
	return h.Client.EvalSha(ctx, sha, keys, args...)
}

// TestAcquirerLateTryAfterRelease (a grant landing after its
// sender gave up, on a single instance): a try that timed out on the way is sent again and granted; the
// lease is released; then the first try lands. It must not lock the name for
// a ttl on behalf of a lease that is gone.
func TestAcquirerLateTryAfterRelease(t *testing.T) {
	ctx := context.Background()
	slow, p := clientVia(t, testenv.RedisAddr(), redis.Options{MaxRetries: -1, ReadTimeout: time.Minute})
	c := &lateClient{Client: testenv.RedisClient(t), slow: slow, landed: make(chan *redis.Cmd, 1)}
	a := newAcquirerOn(t, c, nil)
	other := newAcquirerOn(t, testenv.RedisClient(t), nil)
	const ttl = 20 * time.Second
	name := fencetest.Name("latetry")
	if err := slow.Ping(ctx).Err(); err != nil { // the slow connection is open
		t.Fatal(err)
	}
	if l, err := a.TryAcquire(ctx, name, ttl); err != nil { // loads the script
		t.Fatal(err)
	} else if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	p.Partition()
	c.armed.Store(true)
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire whose first try timed out: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	p.Heal()
	landed := lateCall(t, c.landed, "the late try")
	ol, err := other.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("after a released lease's first try landed late (reply %v): %v", landed.Val(), err)
	}
	if err := ol.Release(ctx); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}
