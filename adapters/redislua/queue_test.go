package redislua_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// child is a waiter in another process.
type child struct {
	cmd     *exec.Cmd
	granted chan uint64 // its token, once granted
	at      chan time.Time
	id      chan string // its acquirer's id
}

func startChild(t *testing.T, name string, hold time.Duration) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "FENCEKIT_CHILD=queue", "FENCEKIT_CHILD_NAME="+name, "FENCEKIT_QUEUE_HOLD="+hold.String())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, granted: make(chan uint64, 1), at: make(chan time.Time, 1), id: make(chan string, 1)}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if id, ok := strings.CutPrefix(sc.Text(), "acquirer "); ok {
				c.id <- id
			}
			if tok, ok := strings.CutPrefix(sc.Text(), "granted "); ok {
				n, _ := strconv.ParseUint(tok, 10, 64)
				c.at <- time.Now()
				c.granted <- n
			}
		}
	}()
	return c
}

// waitInLine waits until name's line holds n waiters.
func waitInLine(t *testing.T, c *redis.Client, name string, n int64) {
	t.Helper()
	key := redislua.DefaultPrefix + "{" + name + "}:line"
	deadline := time.Now().Add(20 * time.Second)
	for {
		got, err := c.LLen(context.Background(), key).Result()
		if err == nil && got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("line of %q holds %d waiters (%v), want %d", name, got, err, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestQueueOrderAcrossProcesses: waiters in three processes, queued one after
// another, are granted the lease in that order, with growing tokens, each on
// the previous holder's release.
func TestQueueOrderAcrossProcesses(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, nil)
	ctx := context.Background()
	name := fencetest.Name("xorder")
	h := mustTryAcquire(ctx, t, a, name, time.Minute)
	var kids []*child
	for i := 0; i < 3; i++ {
		kids = append(kids, startChild(t, name, 30*time.Millisecond))
		waitInLine(t, c, name, int64(i+1))
	}
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	last := uint64(h.Token())
	for i, k := range kids {
		select {
		case tok := <-k.granted:
			if tok <= last {
				t.Fatalf("waiter %d got token %d, not above the previous grant's %d", i, tok, last)
			}
			last = tok
		case <-time.After(20 * time.Second):
			t.Fatalf("waiter %d (queued %d of 3) never got the lease", i, i+1)
		}
	}
	for i, k := range kids {
		if err := k.cmd.Wait(); err != nil {
			t.Errorf("waiter %d: %v", i, err)
		}
	}
}

// TestQueueSkipsKilledWaiter: a queued waiter killed with SIGKILL is skipped at
// the next release (its acquirer no longer listens), so the waiter behind it
// gets the lease at once, from the release itself, instead of after the dead
// waiter's 30s ttl or its place's expiry: the token the release script
// granted is the live waiter's.
func TestQueueSkipsKilledWaiter(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, nil)
	ctx := context.Background()
	name := fencetest.Name("xkilled")
	h := mustTryAcquire(ctx, t, a, name, time.Minute)
	dead := startChild(t, name, 0)
	waitInLine(t, c, name, 1)
	live := startChild(t, name, 0)
	waitInLine(t, c, name, 2)
	deadID := <-dead.id
	if err := dead.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = dead.cmd.Wait()
	// Redis drops the dead process's subscription once the kernel has
	// closed its connections.
	waitSubscribers(t, c, redislua.DefaultPrefix+"grant:"+deadID, 0)
	released := time.Now()
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	byRelease, err := c.Get(ctx, redislua.DefaultPrefix+"{"+name+"}:token").Uint64()
	if err != nil {
		t.Fatal(err)
	}
	select {
	case tok := <-live.granted:
		at := <-live.at
		if tok <= uint64(h.Token()) {
			t.Fatalf("token %d not above %d", tok, h.Token())
		}
		t.Logf("the waiter behind the killed one got token %d %v after the release", tok, at.Sub(released).Round(time.Millisecond))
		if tok != byRelease {
			t.Errorf("the live waiter got token %d, not the release's grant %d: the release did not hand it over", tok, byRelease)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the waiter behind the killed one never got the lease")
	}
}

// TestQueueExpiredHolder: a holder that never releases expires while waiters
// of two acquirers queue; they get the lease in line order, and the expired
// holder's late Release reports the loss without disturbing them.
func TestQueueExpiredHolder(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	name := fencetest.Name("xexpired")
	holder := newAcquirerOn(t, c, nil)
	// The lease covers the two waiters joining the line (each an event, seen
	// in Redis), with room for a loaded machine; it is checked below.
	h := mustTryAcquire(ctx, t, holder, name, 2*time.Second)
	type got struct {
		i   int
		l   fence.Lease
		err error
	}
	res := make(chan got, 2)
	for i := 0; i < 2; i++ {
		a := newAcquirerOn(t, c, nil)
		go func() {
			l, err := a.Acquire(ctx, name, 5*time.Second)
			res <- got{i, l, err}
			if err == nil {
				time.Sleep(50 * time.Millisecond)
				_ = l.Release(ctx)
			}
		}()
		waitInLine(t, c, name, int64(i+1))
	}
	if h.Context().Err() != nil {
		t.Fatal("the holder's lease ended before both waiters were in line: nothing was shown")
	}
	first := <-res
	if first.err != nil || first.i != 0 {
		t.Fatalf("first grant after the expiry went to waiter %d (%v), want waiter 0", first.i, first.err)
	}
	if first.l.Token() <= h.Token() {
		t.Fatalf("token %d not above the expired holder's %d", first.l.Token(), h.Token())
	}
	if err := h.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("the expired holder's Release: %v, want ErrLost", err)
	}
	second := <-res
	if second.err != nil || second.l.Token() <= first.l.Token() {
		t.Fatalf("second waiter: token %v, %v; want above %d", second.l, second.err, first.l.Token())
	}
}

// TestQueueCancelAtGrant: a waiter of another acquirer gives up at about the
// moment a release grants it the lease. Whichever wins, the lock ends free or
// held by a lease someone has: never held by nobody. The race must happen: a
// round where the release granted the waiter (the counter moved past the
// holder's token) and the waiter gave up anyway.
func TestQueueCancelAtGrant(t *testing.T) {
	c := testenv.RedisClient(t)
	holder := newAcquirerOn(t, c, nil)
	waiter := newAcquirerOn(t, c, nil)
	ctx := context.Background()
	name := fencetest.Name("xcancel")
	var took, givenUp int
	const rounds = 30
	for i := 0; i < rounds; i++ {
		h, err := holder.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan fence.Lease, 1)
		go func() {
			l, err := waiter.Acquire(wctx, name, time.Minute)
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("round %d: waiter: %v", i, err)
			}
			done <- l
		}()
		waitInLine(t, c, name, 1)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i%5) * 100 * time.Microsecond)
			cancel()
		}()
		if err := h.Release(ctx); err != nil {
			t.Fatalf("round %d: Release: %v", i, err)
		}
		wg.Wait()
		l := <-done
		if l != nil {
			took++
			if err := l.Release(ctx); err != nil {
				t.Fatalf("round %d: the waiter's lease: %v", i, err)
			}
		} else if counterOf(t, c, name) > uint64(h.Token()) {
			givenUp++ // granted by the release, given up by the waiter
		}
		if lockHeld(t, c, name) {
			t.Fatalf("round %d: the lock is held after the waiter gave up (waiter got a lease: %v)", i, l != nil)
		}
		if n, err := c.LLen(ctx, redislua.DefaultPrefix+"{"+name+"}:line").Result(); err != nil || n != 0 {
			t.Fatalf("round %d: %d waiters left in line (%v)", i, n, err)
		}
	}
	t.Logf("of %d rounds, the waiter took the lease in %d, gave up a grant in %d, gave up before any grant in the others", rounds, took, givenUp)
	if givenUp == 0 {
		t.Fatalf("in %d rounds the release never granted a waiter that was giving up: the race was not tested", rounds)
	}
}

// TestQueuedWaiterPollPace: a waiter in line polls every half to whole
// Backoff.Max, read with fence.Backoff's defaults: with only Min set (Max
// then 100ms), half a second of waiting costs a few polls, not a busy loop.
func TestQueuedWaiterPollPace(t *testing.T) {
	srv := testenv.StartRedis(t)
	c := srv.Client(t)
	opts := &redislua.AcquirerOptions{Backoff: fence.Backoff{Min: time.Millisecond}}
	holder := newAcquirerOn(t, c, opts)
	waiter := newAcquirerOn(t, c, opts)
	ctx := context.Background()
	name := fencetest.Name("pace")
	if _, err := holder.TryAcquire(ctx, name, time.Minute); err != nil {
		t.Fatal(err)
	}
	calls := func() int64 {
		info, err := c.Info(ctx, "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(info, "\n") {
			if rest, ok := strings.CutPrefix(line, "cmdstat_evalsha:calls="); ok {
				n, _ := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
				return n
			}
		}
		return 0
	}
	before := calls()
	wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	if _, err := waiter.Acquire(wctx, name, time.Minute); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("Acquire of a held lock: %v, want ErrHeld", err)
	}
	// The first attempt, its place in line, 5 to 10 polls, leaving.
	if n := calls() - before; n > 15 {
		t.Errorf("%d scripts in 500ms of waiting, want at most 15", n)
	}
}

// TestTokensSurviveCounterDelete: holder A has a token and
// stalls; the name's counter and lock are deleted (a DEL, FLUSHALL, eviction);
// the next grant's token must still be above A's, so the fenced writer
// refuses A's late write. Without the clock floor the counter restarted at 1.
func TestTokensSurviveCounterDelete(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	a := newAcquirerOn(t, c, nil)
	w := newWriterOn(t, c, nil)
	name, key := fencetest.Name("del"), fencetest.Name("delkey")
	for i := 0; i < 3; i++ { // a few grants before the holder that stalls
		l := mustTryAcquire(ctx, t, a, name, time.Minute)
		l.Release(ctx)
	}
	stalled := mustTryAcquire(ctx, t, a, name, time.Minute)
	lock := redislua.DefaultPrefix + "{" + name + "}"
	if err := c.Del(ctx, lock+":token", lock+":lock").Err(); err != nil {
		t.Fatal(err)
	}
	b := mustTryAcquire(ctx, t, a, name, time.Minute)
	defer b.Release(ctx)
	checkStaleRefused(t, w, key, b.Token(), stalled.Token(), "after the counter was deleted")
}

// checkStaleRefused checks that a newer grant's token is above a stalled
// holder's, that the newer holder's write lands, and that the stalled
// holder's late write is refused and changes nothing.
func checkStaleRefused(t *testing.T, w *redislua.Writer, key string, newer, stalled fence.Token, when string) {
	t.Helper()
	ctx := context.Background()
	if newer <= stalled {
		t.Fatalf("token %d %s, not above the stalled holder's %d", newer, when, stalled)
	}
	if err := w.Write(ctx, key, []byte("second holder"), newer); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("paused holder"), stalled); !errors.Is(err, fence.ErrStale) {
		t.Fatalf("the paused holder's write %s: %v, want ErrStale", when, err)
	}
	if v, _, err := w.Read(ctx, key); err != nil || string(v) != "second holder" {
		t.Errorf("stored %q, %v", v, err)
	}
}

// acquireAsync runs a.Acquire in the background and delivers its outcome.
func acquireAsync(ctx context.Context, a fence.Acquirer, name string) <-chan fence.Lease {
	ch := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, time.Minute)
		if err != nil {
			l = nil
		}
		ch <- l
	}()
	return ch
}

// first waits for the lease of want and checks that other is still waiting.
func first(t *testing.T, what string, want, other <-chan fence.Lease) fence.Lease {
	t.Helper()
	select {
	case l := <-want:
		if l == nil {
			t.Fatalf("%s: Acquire failed", what)
		}
		return l
	case l := <-other:
		t.Fatalf("%s: the wrong waiter was granted first (%v)", what, l != nil)
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: never granted", what)
	}
	return nil
}

// TestLineOutlivesItsExpiry: the line's list expires a while
// after the last poll of any waiter, not after the last newcomer: a long
// waiter keeps its place however long nobody new comes. Before, a waiter
// that had waited longer than the list's life was served after every later
// newcomer.
func TestLineOutlivesItsExpiry(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const life = time.Second
	a1 := newAcquirerOn(t, c, nil)
	a2 := newAcquirerOn(t, c, nil)
	redislua.SetLineLife(a1, life)
	redislua.SetLineLife(a2, life)
	name := fencetest.Name("linelife")
	h := mustTryAcquire(ctx, t, a1, name, time.Minute)
	w1 := acquireAsync(ctx, a1, name)
	waitInLine(t, c, name, 1)
	// Three lives of the list pass with nobody new; the old waiter polls.
	end := time.Now().Add(3 * life)
	line := redislua.DefaultPrefix + "{" + name + "}:line"
	for time.Now().Before(end) {
		n, err := c.LLen(ctx, line).Result()
		if err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Fatalf("the line holds %d waiters while the old waiter waits, want 1", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	w2 := acquireAsync(ctx, a2, name)
	waitInLine(t, c, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l := first(t, "after the line's life passed", w1, w2)
	l.Release(ctx)
	first(t, "the newcomer", w2, nil).Release(ctx)
}

// TestUnheardWaiterKeepsPlace: the first waiter's acquirer cannot
// hear a grant (its pub/sub connection is down and reconnecting). The grant
// goes to the next waiter, but the first keeps its place at the head of the
// line: the next grant is its, not a later newcomer's. Before, it was dropped
// and queued again at the back on its next poll.
func TestUnheardWaiterKeepsPlace(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := faultnet.Start(t, testenv.RedisAddr())
	// Polls every 0.5-1s and a place that lives 5s: the waiter keeps its
	// entry through the outage.
	a1 := newAcquirerOn(t, viaProxy(t, p, 0), &redislua.AcquirerOptions{Backoff: fence.Backoff{Min: 20 * time.Millisecond, Max: time.Second}})
	a2 := newAcquirerOn(t, c, nil)
	name := fencetest.Name("unheard")
	h := mustTryAcquire(ctx, t, a2, name, time.Minute)
	w1 := acquireAsync(ctx, a1, name)
	waitInLine(t, c, name, 1)
	channel := redislua.DefaultPrefix + "grant:" + redislua.AcquirerID(a1)
	p.Refuse(true)
	p.CutAll()
	waitSubscribers(t, c, channel, 0)
	w2 := acquireAsync(ctx, a2, name)
	waitInLine(t, c, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l2 := first(t, "while the first waiter cannot hear", w2, w1)
	w3 := acquireAsync(ctx, a2, name)
	waitInLine(t, c, name, 2) // the unheard waiter and the newcomer
	p.Refuse(false)
	waitSubscribers(t, c, channel, 1)
	if err := l2.Release(ctx); err != nil {
		t.Fatal(err)
	}
	first(t, "the unheard waiter, back", w1, w3).Release(ctx)
	first(t, "the newcomer", w3, nil).Release(ctx)
}

// waitSubscribers waits until channel has n subscribers.
func waitSubscribers(t *testing.T, c *redis.Client, channel string, n int64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		got, err := c.PubSubNumSub(context.Background(), channel).Result()
		if err == nil && got[channel] == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("channel %s has %d subscribers (%v), want %d", channel, got[channel], err, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRingRefused: a redis.Ring routes the grant channel and the lock key
// (and the idempotency notifications and records) to different shards.
func TestRingRefused(t *testing.T) {
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": testenv.RedisAddr()}})
	defer ring.Close()
	if _, err := redislua.NewAcquirer(ring, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("NewAcquirer on a Ring: %v, want ErrInvalid", err)
	}
	if _, err := redislua.NewIdempotencyStore(ring, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("NewIdempotencyStore on a Ring: %v, want ErrInvalid", err)
	}
}

// TestRenewInDriftMarginDoesNotExtendKey: the suite's
// LateRenewHoldsNothing, with a Drift of 100ms (the default is 1% of the
// ttl plus 2ms), so that the Renew after the local deadline leaves while
// the key still lives on Redis. It returns ErrLost and does not hold the
// lock on Redis for another ttl: another acquirer gets it when the first
// grant expires.
func TestRenewInDriftMarginDoesNotExtendKey(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	a := newAcquirerOn(t, c, &redislua.AcquirerOptions{Drift: 100 * time.Millisecond})
	other := newAcquirerOn(t, c, nil)
	name := fencetest.Name("latrenew")
	const ttl = 3 * time.Second
	l := mustTryAcquire(ctx, t, a, name, ttl)
	<-l.Context().Done() // the local deadline: at most ttl - drift after the grant
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Renew after the local deadline: %v, want ErrLost", err)
	}
	// The grant expires on Redis within the drift; a renewal would have held
	// it for another 3s.
	actx, cancel := context.WithTimeout(ctx, ttl/2)
	defer cancel()
	ol, err := other.Acquire(actx, name, time.Second)
	if err != nil {
		t.Fatalf("another acquirer after a Renew past the local deadline: %v", err)
	}
	ol.Release(ctx)
}

// counterOf reads name's token counter: a grant sets it to the token it
// handed out.
func counterOf(t *testing.T, c *redis.Client, name string) uint64 {
	t.Helper()
	n, err := c.Get(context.Background(), redislua.DefaultPrefix+"{"+name+"}:token").Uint64()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// lockHeld reports whether name's lock key exists.
func lockHeld(t *testing.T, c *redis.Client, name string) bool {
	t.Helper()
	n, err := c.Exists(context.Background(), redislua.DefaultPrefix+"{"+name+"}:lock").Result()
	if err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// TestHandoffToLocalWaiter: a Release hands the lease to the Acquire waiting in
// the same process, with a larger token, and the old lease is over. The
// release script itself makes the grant: right after Release the lock is held
// and the counter is at the waiter's token, before the waiter asked again.
func TestHandoffToLocalWaiter(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, nil)
	ctx := context.Background()
	name := fencetest.Name("handoff")
	h := mustTryAcquire(ctx, t, a, name, time.Minute)
	got := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, 30*time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	waitInLine(t, c, name, 1)
	if err := h.Release(ctx); err != nil {
		t.Fatalf("Release with a waiter: %v", err)
	}
	held, byRelease := lockHeld(t, c, name), counterOf(t, c, name)
	w := <-got
	if w == nil {
		t.FailNow()
	}
	if w.Token() <= h.Token() {
		t.Errorf("handed-over token %d not above %d", w.Token(), h.Token())
	}
	if !held || uint64(w.Token()) != byRelease {
		t.Errorf("right after Release: lock held %v, counter %d; the waiter got %d: not handed over by the release", held, byRelease, w.Token())
	}
	if h.Context().Err() == nil {
		t.Error("the releasing holder's context is not done")
	}
	if err := h.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("old holder's Renew after the hand-over: %v, want ErrLost", err)
	}
	// The new holder holds it on Redis, with its own ttl.
	other := newAcquirerOn(t, c, nil)
	if _, err := other.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("another acquirer after the hand-over: %v, want ErrHeld", err)
	}
	if pttl, _ := c.PTTL(ctx, "fence:{"+name+"}:lock").Result(); pttl > 30*time.Second || pttl < 25*time.Second {
		t.Errorf("handed-over lock expires in %v, want the waiter's 30s", pttl)
	}
	if err := w.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestHandoffExpiredHolder: a holder whose lease expired cannot hand it over;
// its Release reports the loss and the waiter gets the lease by itself.
func TestHandoffExpiredHolder(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, nil)
	ctx := context.Background()
	name := fencetest.Name("expired")
	h := mustTryAcquire(ctx, t, a, name, 100*time.Millisecond)
	got := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	time.Sleep(150 * time.Millisecond) // h expired; the waiter may already have the lease
	if err := h.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("expired holder's Release: %v, want ErrLost", err)
	}
	select {
	case w := <-got:
		if w == nil {
			t.FailNow()
		}
		if w.Token() <= h.Token() {
			t.Errorf("token %d not above %d", w.Token(), h.Token())
		}
		_ = w.Release(ctx)
	case <-time.After(5 * time.Second):
		t.Fatal("the waiter never got the lease")
	}
}

// TestHandoffToGivenUpWaiter: a waiter whose context ends while the lease is
// being handed to it releases what it was handed; the lock does not stay held.
// The race must happen: a round where the release granted the waiter (the
// counter moved past the holder's token) and the waiter still gave up.
func TestHandoffToGivenUpWaiter(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, nil)
	ctx := context.Background()
	name := fencetest.Name("givenup")
	raced := 0
	const rounds = 40
	for i := 0; i < rounds; i++ {
		h, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			l, err := a.Acquire(wctx, name, time.Minute)
			if err == nil {
				err = l.Release(ctx)
			}
			done <- err
		}()
		waitInLine(t, c, name, 1)
		// Cancel and release at about the same moment, in varying order.
		if i%2 == 0 {
			cancel()
		}
		relErr := h.Release(ctx)
		cancel()
		werr := <-done
		if werr != nil && !errors.Is(werr, context.Canceled) {
			t.Fatalf("round %d: waiter: %v", i, werr)
		}
		if relErr != nil {
			t.Fatalf("round %d: Release: %v", i, relErr)
		}
		if werr != nil && counterOf(t, c, name) > uint64(h.Token()) {
			raced++ // handed to the waiter, which gave up anyway
		}
		// Whatever happened, the lock is free now.
		if lockHeld(t, c, name) {
			t.Fatalf("round %d: the lock is still held after the waiter gave up", i)
		}
	}
	t.Logf("the release granted a waiter that gave up in %d of %d rounds", raced, rounds)
	if raced == 0 {
		t.Fatalf("in %d rounds the release never granted a waiter that was giving up: the race was not tested", rounds)
	}
}

// TestHandoffFairAcrossAcquirers: waiters of one acquirer keep the lease
// busy, yet a waiter of another acquirer (another process) that joins the line
// gets it after exactly one grant to each waiter ahead of it, though those
// waiters queue again at once: the line is FIFO across processes.
func TestHandoffFairAcrossAcquirers(t *testing.T) {
	c := testenv.RedisClient(t)
	local := newAcquirerOn(t, c, nil)
	remote := newAcquirerOn(t, c, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	name := fencetest.Name("fair")
	const workers = 4
	var (
		wg    sync.WaitGroup
		total atomic.Int64
	)
	// A blocker holds the lock until every local waiter and the remote one
	// are in line, so the remote waiter always queues.
	blocker := mustTryAcquire(ctx, t, local, name, time.Minute)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				l, err := local.Acquire(ctx, name, 10*time.Second)
				if err != nil {
					return
				}
				total.Add(1)
				time.Sleep(time.Millisecond)
				_ = l.Release(context.Background())
			}
		}()
	}
	waitInLine(t, c, name, workers)
	got := make(chan error, 1)
	var grantsAtGrant int64
	go func() {
		rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
		defer rcancel()
		l, err := remote.Acquire(rctx, name, 10*time.Second)
		if err == nil {
			grantsAtGrant = total.Load()
			_ = l.Release(context.Background())
		}
		got <- err
	}()
	// The remote waiter's entry is in line behind the local ones.
	waitInLine(t, c, name, workers+1)
	entries := redislua.DefaultPrefix + "{" + name + "}:w:*"
	id := redislua.AcquirerID(remote) + " "
	keys, err := c.Keys(ctx, entries).Result()
	if err != nil {
		t.Fatal(err)
	}
	queued := false
	for _, k := range keys {
		v, err := c.Get(ctx, k).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			t.Fatal(err)
		}
		queued = queued || strings.HasPrefix(v, id)
	}
	if !queued {
		t.Fatal("the other acquirer's waiter is not in line")
	}
	grantsAtJoin := total.Load() // 0: the blocker still holds the lock
	if err := blocker.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("the other acquirer's waiter never got in: %v", err)
	}
	n := grantsAtGrant - grantsAtJoin
	t.Logf("the other acquirer's waiter got the lease after %d local grants", n)
	if n != workers {
		t.Errorf("%d local grants after the remote waiter joined the line, want %d (one per waiter ahead, in line order)", n, workers)
	}
	cancel()
	wg.Wait()
}

// TestWaiterKeepsItsPlaceWithAHugeBackoffMax: NewAcquirer
// accepts Backoff{Max: 1<<61} (fence.Backoff.Validate: every field up to
// math.MaxInt64 is valid). A waiter in line polls at least every ttl/4, and
// its place must outlive its last poll ("by five times Max, at least 1s").
// Five times Max overflows int64: the place lived 1s, and a waiter with an 8s
// ttl, polling every 2s, lost its place between polls (a later waiter got
// ahead of it).
func TestWaiterKeepsItsPlaceWithAHugeBackoffMax(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	holder := newAcquirerOn(t, c, nil)
	waiter, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{Backoff: fence.Backoff{Max: 1 << 61}})
	if err != nil {
		t.Fatalf("NewAcquirer with Backoff.Max 1<<61: %v", err)
	}
	name := fencetest.Name("hugemax")
	held := mustTryAcquire(ctx, t, holder, name, time.Minute)
	defer func() { _ = held.Release(ctx) }()

	const ttl = 8 * time.Second // the waiter polls every ttl/4 = 2s
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	got := make(chan error, 1)
	go func() {
		l, err := waiter.Acquire(wctx, name, ttl)
		if err == nil {
			_ = l.Release(ctx)
		}
		got <- err
	}()
	defer func() { cancel(); <-got }()

	pattern := redislua.DefaultPrefix + "{" + name + "}:w:*"
	entries := func() int {
		keys, err := c.Keys(ctx, pattern).Result()
		if err != nil {
			t.Fatal(err)
		}
		return len(keys)
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for entries() == 0 {
		select {
		case err := <-got:
			t.Fatalf("Acquire ended before its waiter joined the line: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("the waiter never joined the line")
		case <-tick.C:
		}
	}
	joined := time.Now()
	// Two poll rounds: the place must be there all along.
	for time.Since(joined) < ttl/2 {
		if entries() == 0 {
			t.Fatalf("the waiter's place in line expired %v after it joined, while it was still waiting (it polls every %v)", time.Since(joined), ttl/4)
		}
		<-tick.C
	}
}

// TestHeadSpinOneWaiterInOrder: waiters of three acquirers with HeadSpin (as
// three processes would be), three of each in a row, queued one after
// another behind a holder, are granted the lease in line order; waiters told
// they were next spun; and never did two waiters of one acquirer spin at
// once (the one told it is next overlaps the one before it, which is taking
// its grant, when both are of one acquirer).
func TestHeadSpinOneWaiterInOrder(t *testing.T) {
	c := testenv.RedisClient(t)
	var (
		mu       sync.Mutex
		spinning = map[*redislua.Acquirer]int{}
		most     = 0
		spins    = 0
	)
	redislua.ObserveSpins(t, func(a *redislua.Acquirer, d int) {
		mu.Lock()
		defer mu.Unlock()
		spinning[a] += d
		if d > 0 {
			spins++
		}
		most = max(most, spinning[a])
	})
	var acqs []*redislua.Acquirer
	for i := 0; i < 3; i++ {
		a := newAcquirerOn(t, c, &redislua.AcquirerOptions{HeadSpin: 20 * time.Millisecond})
		acqs = append(acqs, a)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := fencetest.Name("headspin")
	holder, err := acqs[0].TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 9
	order := make(chan int, waiters)
	errs := make(chan error, waiters)
	for i := 0; i < waiters; i++ {
		go func() {
			l, err := acqs[i/3].Acquire(ctx, name, 10*time.Second)
			if err != nil {
				errs <- err
				return
			}
			order <- i
			// The workload's hold, so the next waiter spins a while.
			time.Sleep(time.Millisecond)
			errs <- l.Release(ctx)
		}()
		waitInLine(t, c, name, int64(i+1))
	}
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < waiters; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	close(order)
	want := 0
	for got := range order {
		if got != want {
			t.Errorf("waiter %d granted in place %d: not in line order", got, want)
		}
		want++
	}
	mu.Lock()
	defer mu.Unlock()
	// Under load a waiter may get its grant before the notice that it is
	// next, and then does not spin; most do.
	if spins < 1 || spins > waiters-1 {
		t.Errorf("%d waiters spun, want 1 to %d (each but the first may be told it is next)", spins, waiters-1)
	}
	if most != 1 {
		t.Errorf("up to %d waiters of one acquirer spun at once, want 1", most)
	}
}

// TestHeadSpinOptions: HeadSpin may not be negative nor above 100ms.
func TestHeadSpinOptions(t *testing.T) {
	c := testenv.RedisClient(t)
	for _, d := range []time.Duration{-time.Nanosecond, 100*time.Millisecond + 1} {
		if _, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{HeadSpin: d}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("HeadSpin %v: %v, want ErrInvalid", d, err)
		}
	}
	if _, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{HeadSpin: 100 * time.Millisecond}); err != nil {
		t.Errorf("HeadSpin 100ms: %v", err)
	}
}

// TestHeadSpinCtxEndsTheSpin: a waiter that is spinning (told it is next)
// when its ctx is cancelled gives up: a grant that reaches it afterwards,
// while the spin would still run, is not handed out as a lease (ctx bounds
// the wait, fence.Acquirer), and Acquire returns ErrHeld and the ctx error.
func TestHeadSpinCtxEndsTheSpin(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, &redislua.AcquirerOptions{HeadSpin: 100 * time.Millisecond})
	b := newAcquirerOn(t, c, &redislua.AcquirerOptions{HeadSpin: 100 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := fencetest.Name("spinctx")
	h0 := mustTryAcquire(ctx, t, a, name, time.Minute)
	// X, first in line, of a: its grant tells W (of b, second) it is next.
	xGot := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, time.Minute)
		if err != nil {
			t.Error(err)
		}
		xGot <- l
	}()
	waitInLine(t, c, name, 1)
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	spinning := make(chan struct{}, 1)
	redislua.ObserveSpins(t, func(acq *redislua.Acquirer, d int) {
		if acq == b && d > 0 {
			select {
			case spinning <- struct{}{}:
			default:
			}
			wcancel() // W's caller gives up while W spins
		}
	})
	wres := acquireInBackground(wctx, b, name, time.Minute)
	waitInLine(t, c, name, 2)
	if err := h0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	x := <-xGot
	if x == nil {
		t.Fatal("X was not granted")
	}
	// The spin's signal comes before the cancel, so W's answer may also be
	// ready when this select runs (it picks either): an answer counts as
	// "without spinning" only when no spin was signalled.
	var early *acquired
	select {
	case <-spinning:
	case r := <-wres:
		select {
		case <-spinning:
			early = &r
		default:
			t.Fatalf("W returned (%v, %v) without spinning: it was not told it is next", r.l, r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("W never spun")
	}
	// W's ctx is cancelled; this release grants W by pub/sub.
	if err := x.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var r acquired
	if early != nil {
		r = *early
	} else {
		r = <-wres
	}
	if r.err == nil {
		_ = r.l.Release(ctx)
		t.Fatalf("Acquire returned a lease (token %d) granted after its ctx was cancelled, while it spun", r.l.Token())
	}
	if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
		t.Fatalf("Acquire: %v, want ErrHeld and context.Canceled", r.err)
	}
	// The grant W did not take went on: the name is free again, not held for
	// the ttl.
	l, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatalf("after W gave up: %v (W's grant was not released)", err)
	}
	_ = l.Release(ctx)
}

// TestHeadSpinStopsForLongHolds: a waiter told it is next whose grant then
// takes longer than HeadSpin (the holder before it works 60ms, HeadSpin is
// 20ms) spins at most once: the doc promises no spin "while that time is
// above HeadSpin". The waiter polls every 5-10ms, so its grant comes in a
// later poll round than its notice.
func TestHeadSpinStopsForLongHolds(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, &redislua.AcquirerOptions{HeadSpin: 20 * time.Millisecond})
	b, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{HeadSpin: 20 * time.Millisecond,
		Backoff: fence.Backoff{Min: time.Millisecond, Max: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	var spins atomic.Int64
	redislua.ObserveSpins(t, func(acq *redislua.Acquirer, d int) {
		if acq == b && d > 0 {
			spins.Add(1)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	name := fencetest.Name("spinlong")
	const rounds = 4
	for r := 0; r < rounds; r++ {
		h0 := mustTryAcquire(ctx, t, a, name, time.Minute)
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			l, err := a.Acquire(ctx, name, time.Minute)
			if err != nil {
				t.Error(err)
				return
			}
			time.Sleep(60 * time.Millisecond) // the work under the lease
			if err := l.Release(ctx); err != nil {
				t.Error(err)
			}
		}()
		waitInLine(t, c, name, 1)
		go func() {
			defer wg.Done()
			l, err := b.Acquire(ctx, name, time.Minute)
			if err != nil {
				t.Error(err)
				return
			}
			if err := l.Release(ctx); err != nil {
				t.Error(err)
			}
		}()
		waitInLine(t, c, name, 2)
		if err := h0.Release(ctx); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
	}
	if n := spins.Load(); n > 1 {
		t.Errorf("the waiter spun in %d of %d rounds, each waiting 60ms from its notice to its grant (HeadSpin 20ms): want at most 1", n, rounds)
	}
}

// TestHeadSpinMixedLine: waiters of acquirers with and without HeadSpin,
// and one whose process died while it was next in line, share one name: they
// are granted in line order, one at a time, with growing tokens, and the dead
// one (told it is next, then skipped) stalls nobody for a ttl.
func TestHeadSpinMixedLine(t *testing.T) {
	c := testenv.RedisClient(t)
	opts := []*redislua.AcquirerOptions{
		{HeadSpin: 100 * time.Millisecond},
		nil,
		{HeadSpin: time.Millisecond},
		{Backoff: fence.Backoff{Min: time.Millisecond, Max: 5 * time.Millisecond}},
		{HeadSpin: 50 * time.Millisecond, Backoff: fence.Backoff{Min: time.Millisecond, Max: 5 * time.Millisecond}},
	}
	var acqs []*redislua.Acquirer
	for _, o := range opts {
		a := newAcquirerOn(t, c, o)
		acqs = append(acqs, a)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := fencetest.Name("spinmixed")
	const ttl = 20 * time.Second
	start := time.Now()
	holder, err := acqs[0].TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	// The dead waiter: second in line (told it is next when the first is
	// granted), on a client that closes, as a process that died.
	dc := testenv.RedisClient(t)
	dead := newAcquirerOn(t, dc, &redislua.AcquirerOptions{HeadSpin: 100 * time.Millisecond})
	const waiters = 10
	var (
		inside atomic.Int64
		mu     sync.Mutex
		order  []int
		tokens []fence.Token
	)
	errs := make(chan error, waiters+1)
	var deadDone chan struct{}
	dctx, dcancel := context.WithCancel(ctx)
	defer dcancel()
	queued := int64(0)
	for i := 0; i < waiters; i++ {
		if i == 1 {
			deadDone = make(chan struct{})
			go func() {
				defer close(deadDone)
				_, _ = dead.Acquire(dctx, name, ttl)
			}()
			queued++
			waitInLine(t, c, name, queued)
		}
		go func() {
			l, err := acqs[i%len(acqs)].Acquire(ctx, name, ttl)
			if err != nil {
				errs <- err
				return
			}
			if n := inside.Add(1); n != 1 {
				t.Errorf("%d holders at once", n)
			}
			mu.Lock()
			order = append(order, i)
			tokens = append(tokens, l.Token())
			mu.Unlock()
			time.Sleep(2 * time.Millisecond) // the work under the lease
			inside.Add(-1)
			errs <- l.Release(ctx)
		}()
		queued++
		waitInLine(t, c, name, queued)
	}
	// The dead waiter's process dies: its subscription is gone, its entry
	// stays until it expires.
	_ = dc.Close()
	dcancel()
	<-deadDone
	if n, err := c.LLen(ctx, redislua.DefaultPrefix+"{"+name+"}:line").Result(); err != nil || n != queued {
		t.Fatalf("line holds %d (%v), want %d: the dead waiter must still be in it", n, err, queued)
	}
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < waiters; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if took := time.Since(start); took > ttl/2 {
		t.Errorf("the line took %v: someone waited for a ttl (%v)", took, ttl)
	}
	mu.Lock()
	defer mu.Unlock()
	for k, i := range order {
		if i != k {
			t.Errorf("waiter %d granted in place %d: %v, not line order", i, k, order)
			break
		}
	}
	for k := 1; k < len(tokens); k++ {
		if tokens[k] <= tokens[k-1] {
			t.Errorf("token %d after %d", tokens[k], tokens[k-1])
		}
	}
	if tokens[0] <= holder.Token() {
		t.Errorf("first waiter's token %d is not above the holder's %d", tokens[0], holder.Token())
	}
}

// headSpinLine returns a context that ends 30s later, a client of the test
// Redis, and three acquirers with HeadSpin spin: one on a client that
// reaches Redis through the proxy p (ReadTimeout 500ms), then two on the
// direct client.
func headSpinLine(t *testing.T, spin time.Duration) (ctx context.Context, direct *redis.Client, p *faultnet.Proxy, proxied, a, b *redislua.Acquirer) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	pc, p := clientVia(t, testenv.RedisAddr(), redis.Options{ReadTimeout: 500 * time.Millisecond})
	direct = testenv.RedisClient(t)
	opts := &redislua.AcquirerOptions{HeadSpin: spin}
	return ctx, direct, p, newAcquirerOn(t, pc, opts), newAcquirerOn(t, direct, opts), newAcquirerOn(t, direct, opts)
}

// workerDone is how the lineWorkers waiter at index i ended.
type workerDone struct {
	i   int
	err error
}

// lineWorkers queues a waiter on each of acqs in turn, behind the ahead
// waiters already in line and each other: each takes the lease, sends its
// index on granted, works under it for 5ms and releases it. done gets each
// waiter's end (the error of its Acquire or its Release).
func lineWorkers(ctx context.Context, t *testing.T, direct *redis.Client, name string, ttl time.Duration, ahead int, acqs ...*redislua.Acquirer) (granted <-chan int, done <-chan workerDone) {
	t.Helper()
	g, d := make(chan int, len(acqs)), make(chan workerDone, len(acqs))
	for i, acq := range acqs {
		go func() {
			l, err := acq.Acquire(ctx, name, ttl)
			if err == nil {
				g <- i
				time.Sleep(5 * time.Millisecond) // the work under the lease
				err = l.Release(ctx)
			}
			d <- workerDone{i, err}
		}()
		waitInLine(t, direct, name, int64(ahead+i+1))
	}
	return g, d
}

// TestHeadSpinLostReleaseReply: the release whose script
// grants the next waiter and tells the one after it that it is next loses its
// reply. The release reports nil or fence.ErrUnknown (never "not the
// holder"), and the line goes on in order: the first waiter is granted, the
// second (told it is next) after it, neither after a ttl.
func TestHeadSpinLostReleaseReply(t *testing.T) {
	ctx, direct, p, ha, a, b := headSpinLine(t, 50*time.Millisecond)
	name := fencetest.Name("spinlost")
	const ttl = 20 * time.Second
	h0 := mustTryAcquire(ctx, t, ha, name, ttl)
	got, done := lineWorkers(ctx, t, direct, name, ttl, 0, a, b)
	start := time.Now()
	p.LoseReply(func(req []byte) bool { return bytes.Contains(req, []byte("release")) })
	if err := h0.Release(ctx); err != nil && !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("release whose reply was lost: %v, want nil or ErrUnknown", err)
	}
	if p.Pending() != 0 {
		t.Fatal("the release's reply was not lost")
	}
	for i := 0; i < 2; i++ {
		if r := <-done; r.err != nil {
			t.Fatal(r.err)
		}
	}
	if took := time.Since(start); took > ttl/2 {
		t.Errorf("the line took %v after the release: a ttl (%v)", took, ttl)
	}
	if first, second := <-got, <-got; first != 0 || second != 1 {
		t.Errorf("granted %d then %d, want 0 then 1", first, second)
	}
}

// TestHeadSpinCutWhileSpinning: the connections of a waiter's
// process are cut while it spins (told it is next); the release then finds
// nobody listening for it. Nobody waits for a ttl: the waiter behind it is
// granted, and the cut waiter is granted after its process reconnects.
func TestHeadSpinCutWhileSpinning(t *testing.T) {
	ctx, direct, p, w, a, c := headSpinLine(t, 100*time.Millisecond)
	name := fencetest.Name("spincut")
	const ttl = 20 * time.Second
	h0 := mustTryAcquire(ctx, t, a, name, ttl)
	cut := make(chan struct{})
	var once sync.Once
	redislua.ObserveSpins(t, func(acq *redislua.Acquirer, d int) {
		if acq == w && d > 0 {
			once.Do(func() { p.CutAll(); close(cut) })
		}
	})
	xGot := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, ttl)
		if err != nil {
			t.Error(err)
		}
		xGot <- l
	}()
	waitInLine(t, direct, name, 1)
	_, res := lineWorkers(ctx, t, direct, name, ttl, 1, w, c)
	if err := h0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	x := <-xGot
	if x == nil {
		t.FailNow()
	}
	select {
	case <-cut:
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter told it is next never spun")
	}
	start := time.Now()
	if err := x.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		r := <-res
		if r.err != nil {
			t.Fatalf("%s: %v", []string{"cut", "behind"}[r.i], r.err)
		}
	}
	if took := time.Since(start); took > ttl/2 {
		t.Errorf("the line took %v after the release: a ttl (%v)", took, ttl)
	}
}
