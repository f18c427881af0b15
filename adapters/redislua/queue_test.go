package redislua_test

import (
	"bufio"
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
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
	a, _ := redislua.NewAcquirer(c, nil)
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
	a, _ := redislua.NewAcquirer(c, nil)
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
	holder, _ := redislua.NewAcquirer(c, nil)
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
		a, _ := redislua.NewAcquirer(c, nil)
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
	holder, _ := redislua.NewAcquirer(c, nil)
	waiter, _ := redislua.NewAcquirer(c, nil)
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
	holder, _ := redislua.NewAcquirer(c, opts)
	waiter, _ := redislua.NewAcquirer(c, opts)
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
