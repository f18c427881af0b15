package redislua_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
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
	w, err := redislua.NewWriter(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("deadline")
	l := mustTryAcquire(ctx, t, a, name, time.Minute) // connects and loads the scripts
	if err := w.Write(ctx, name, []byte("v"), l.Token()); err != nil {
		t.Fatal(err)
	}
	if _, _, err := w.Read(ctx, name); err != nil {
		t.Fatal(err)
	}
	is, err := redislua.NewIdempotencyStore(c, nil)
	if err != nil {
		t.Fatal(err)
	}
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
	p := faultnet.Start(t, testenv.RedisAddr())
	slow := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: -1, ReadTimeout: time.Minute})
	t.Cleanup(func() { slow.Close() })
	c := &lateClient{Client: testenv.RedisClient(t), slow: slow, landed: make(chan *redis.Cmd, 1)}
	a, _ := redislua.NewAcquirer(c, nil)
	other, _ := redislua.NewAcquirer(testenv.RedisClient(t), nil)
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
	var landed *redis.Cmd
	select {
	case landed = <-c.landed:
	case <-time.After(30 * time.Second):
		t.Fatal("the late try never landed")
	}
	if landed.Err() != nil {
		t.Fatalf("late try: %v", landed.Err())
	}
	ol, err := other.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("after a released lease's first try landed late (reply %v): %v", landed.Val(), err)
	}
	if err := ol.Release(ctx); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}
