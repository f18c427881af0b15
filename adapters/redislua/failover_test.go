package redislua_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// replicated starts a primary and a replica of it, and waits until they are in sync.
func replicated(t *testing.T) (primary, replica *testenv.RedisServer) {
	primary = testenv.StartRedis(t, "--repl-diskless-sync-delay", "0")
	replica = testenv.StartRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	rc := replica.Client(t)
	deadline := time.Now().Add(10 * time.Second)
	for {
		info, _ := rc.Info(context.Background(), "replication").Result()
		if strings.Contains(info, "master_link_status:up") {
			// The replica is linked; wait until the primary counts its
			// acknowledgements too (WAIT sees it), or the first WAIT can miss it.
			waitReplicated(t, primary.Client(t))
			return primary, replica
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica did not sync:\n%s", info)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// cutFromPrimary points the replica c at a port nobody listens on: it stops
// hearing from its primary (SIGSTOP would not do, since the kernel still
// buffers the stream for it).
func cutFromPrimary(ctx context.Context, t *testing.T, c *redis.Client) {
	t.Helper()
	if err := c.Do(ctx, "REPLICAOF", "127.0.0.1", "1").Err(); err != nil {
		t.Fatal(err)
	}
}

// checkUnreplicatedGrant checks the outcome of a grant (what) that the
// replica cannot acknowledge: ErrNotReplicated when the acquirers wait for
// replicas (mode "wait-replicas"), a grant otherwise.
func checkUnreplicatedGrant(t *testing.T, mode, what string, err error) {
	t.Helper()
	if mode == "wait-replicas" {
		if !errors.Is(err, redislua.ErrNotReplicated) {
			t.Fatalf("%s: %v, want ErrNotReplicated", what, err)
		}
	} else if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// waitReplicated waits until the replica has everything the primary wrote.
func waitReplicated(t *testing.T, pc *redis.Client) {
	if n, err := pc.Do(context.Background(), "WAIT", 1, 5000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT: %d, %v", n, err)
	}
}

// TestFailoverLosesCounter acknowledges a grant on a primary whose replica is
// paused, kills the primary, promotes the replica and grants again, with each
// durability option. It shows what the package documentation says: without an
// option (CounterTokens) the token is reused; WaitReplicas refuses the grant
// that could be lost; the default clock floor keeps tokens growing.
func TestFailoverLosesCounter(t *testing.T) {
	// "none" is CounterTokens (the clock floor off), "wait-replicas" adds
	// WaitReplicas to it, "token-floor" is the default.
	for _, mode := range []string{"none", "wait-replicas", "token-floor"} {
		t.Run(mode, func(t *testing.T) {
			ctx := context.Background()
			opts := redislua.AcquirerOptions{}
			switch mode {
			case "wait-replicas":
				// Generous: on a loaded machine (CI runs packages side by
				// side on 2 cores) a replica's acknowledgement took over 500ms.
				opts.WaitReplicas, opts.WaitTimeout = 1, 2*time.Second
			}
			opts.CounterTokens = mode != "token-floor"
			primary, replica := replicated(t)
			pc := redis.NewClient(&redis.Options{Addr: primary.Addr, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: 4 * time.Second})
			t.Cleanup(func() { pc.Close() })
			a := newAcquirerOn(t, pc, &opts)
			if mode == "wait-replicas" {
				long := opts
				long.WaitTimeout = 5 * time.Second // the test client reads with a 4s timeout
				if _, err := redislua.NewAcquirer(pc, &long); !errors.Is(err, fence.ErrInvalid) {
					t.Errorf("WaitTimeout above the client's ReadTimeout: %v, want ErrInvalid", err)
				}
			}
			handedOut := []fence.Token{}
			l1 := mustTryAcquire(ctx, t, a, "job", time.Minute)
			handedOut = append(handedOut, l1.Token())
			if err := l1.Release(ctx); err != nil {
				t.Fatal(err)
			}
			waitReplicated(t, pc)

			// The replica stops hearing from the primary (it is pointed at a dead
			// port: SIGSTOP would not do, since the kernel still buffers the
			// stream for it); the primary grants again.
			rc := replica.Client(t)
			cutFromPrimary(ctx, t, rc)
			l2, err := a.TryAcquire(ctx, "job", time.Minute)
			checkUnreplicatedGrant(t, mode, "grant while the replica cannot acknowledge", err)
			if mode != "wait-replicas" {
				handedOut = append(handedOut, l2.Token())
			}
			primary.Kill()
			if err := rc.Do(ctx, "REPLICAOF", "NO", "ONE").Err(); err != nil {
				t.Fatal(err)
			}
			opts.WaitReplicas = 0 // the promoted node has no replica left
			a2 := newAcquirerOn(t, rc, &opts)
			// The lost grant's lock key is gone too: the new primary grants at once.
			l3 := mustTryAcquire(ctx, t, a2, "job", time.Minute)
			maxOut := handedOut[len(handedOut)-1]
			t.Logf("%s: tokens handed out before the failover %v, after it %d", mode, handedOut, l3.Token())
			switch mode {
			case "none":
				if l3.Token() > maxOut {
					t.Errorf("without an option the counter was expected to go back: token %d after %v", l3.Token(), handedOut)
				}
			default:
				if l3.Token() <= maxOut {
					t.Errorf("token %d after the failover is not larger than %d, handed out before it", l3.Token(), maxOut)
				}
			}
		})
	}
}

// TestRestartWhileHeld restarts Redis (empty) while Hold runs: the watchdog's
// renewal finds the lease gone, the work is cancelled with ErrLost, and with
// the token floor the next grant's token is still larger.
func TestRestartWhileHeld(t *testing.T) {
	for _, floor := range []bool{true, false} {
		t.Run(fmt.Sprintf("floor=%v", floor), func(t *testing.T) {
			s := testenv.StartRedis(t)
			c := s.Client(t)
			a := newAcquirerOn(t, c, &redislua.AcquirerOptions{CounterTokens: !floor})
			ctx := context.Background()
			var (
				token fence.Token
				cause error
			)
			err := fence.Hold(ctx, a, "job", 600*time.Millisecond, func(ctx context.Context, l fence.Lease) error {
				token = l.Token()
				s.Restart(t)
				select {
				case <-ctx.Done():
					cause = context.Cause(ctx)
					return nil
				case <-time.After(5 * time.Second):
					return errors.New("work was not cancelled")
				}
			})
			if !errors.Is(cause, fence.ErrLost) || !errors.Is(err, fence.ErrLost) {
				t.Fatalf("Hold across a restart: cause %v, returned %v; want ErrLost", cause, err)
			}
			l := mustTryAcquire(ctx, t, a, "job", time.Second)
			defer l.Release(ctx)
			if floor && l.Token() <= token {
				t.Errorf("with the floor, token %d after the restart is not above %d", l.Token(), token)
			}
			if !floor && l.Token() != 1 {
				t.Errorf("without the floor the restarted counter starts over: token %d, want 1", l.Token())
			}
		})
	}
}

// grants records every token handed out, in the order the grants returned.
type grants struct {
	mu     sync.Mutex
	tokens []fence.Token
}

func (g *grants) add(t fence.Token) {
	g.mu.Lock()
	g.tokens = append(g.tokens, t)
	g.mu.Unlock()
}

func (g *grants) max() fence.Token {
	g.mu.Lock()
	defer g.mu.Unlock()
	var m fence.Token
	for _, t := range g.tokens {
		m = max(m, t)
	}
	return m
}

// reused counts the grants from index from on whose token was not above every
// earlier one, and describes the first.
func (g *grants) reused(from int) (n int, first string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var m fence.Token
	for i, t := range g.tokens {
		if i >= from && t <= m {
			if n == 0 {
				first = fmt.Sprintf("grant %d: token %d after %d", i, t, m)
			}
			n++
		}
		m = max(m, t)
	}
	return n, first
}

func (g *grants) len() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.tokens)
}

// TestSentinelFailover runs a primary, a replica and three sentinels, with
// grants going on through a redis.NewFailoverClient. Two failovers happen under
// that load: one forced with SENTINEL FAILOVER, then one where the primary
// acknowledges a grant its replica never gets and is killed (SIGKILL). Every
// grant writes its token to a fenced writer on another Redis, the protected
// resource. With the clock floor (the default) or WaitReplicas no token is
// handed out twice and the resource never accepts a write from a reused
// token; with CounterTokens and no WaitReplicas the
// killed primary's last grant is handed out again, as the package
// documentation says.
func TestSentinelFailover(t *testing.T) {
	t.Parallel() // servers of its own
	// "none" is CounterTokens (the clock floor off), "wait-replicas" adds
	// WaitReplicas to it, "token-floor" is the default.
	for _, mode := range []string{"none", "wait-replicas", "token-floor"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel() // servers of its own
			ctx := context.Background()
			opts := redislua.AcquirerOptions{DisableNotify: true, Backoff: fence.Backoff{Min: time.Millisecond, Max: 20 * time.Millisecond}}
			switch mode {
			case "wait-replicas":
				opts.WaitReplicas, opts.WaitTimeout = 1, 800*time.Millisecond // below the client's 1s ReadTimeout
			}
			opts.CounterTokens = mode != "token-floor"
			primary := testenv.StartRedis(t, "--repl-diskless-sync-delay", "0")
			replica := testenv.StartRedis(t, "--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
			waitPrimaryReplicated(t, primary)
			nodes := map[string]*testenv.RedisServer{primary.Addr: primary, replica.Addr: replica}
			sent := testenv.StartSentinels(t, primary, 3, 1)
			fc := sent.FailoverClient(t)
			a := newAcquirerOn(t, fc, &opts)
			// The protected resource lives elsewhere and survives the failovers.
			w := newWriterOn(t, testenv.RedisClient(t), nil)
			key := fencetest.Name("sentinel")
			g := &grants{}
			var staleRefused int
			grant := func(ctx context.Context) error {
				// A grant whose release was lost in a failover holds the lock for
				// its ttl: wait for it.
				l, err := a.Acquire(ctx, "job", time.Second)
				if err != nil {
					return err
				}
				g.add(l.Token())
				err = w.Write(ctx, key, []byte(fmt.Sprint(l.Token())), l.Token())
				if errors.Is(err, fence.ErrStale) {
					staleRefused++
				} else if err != nil {
					return err
				}
				return l.Release(ctx)
			}

			// Load: grants one after another until stopped; errors while the
			// primary changes are expected. wait returns once the load has
			// made k more grants (the event the scenes wait for, not a
			// duration), and fails the test when none comes within 30s.
			load := func() (wait func(k int), stop func() int) {
				done := make(chan struct{})
				finished := make(chan int)
				var n atomic.Int64
				granted := make(chan struct{}, 1)
				go func() {
					for {
						select {
						case <-done:
							finished <- int(n.Load())
							return
						default:
						}
						cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
						if grant(cctx) == nil {
							n.Add(1)
							select {
							case granted <- struct{}{}:
							default:
							}
						}
						cancel()
					}
				}()
				wait = func(k int) {
					t.Helper()
					want := n.Load() + int64(k)
					timeout := time.After(30 * time.Second)
					for n.Load() < want {
						select {
						case <-granted:
						case <-timeout:
							t.Fatalf("%d of %d grants within 30s", n.Load()-want+int64(k), k)
						}
					}
				}
				return wait, func() int { close(done); return <-finished }
			}

			// 1. A forced failover under load.
			wait, stop := load()
			wait(3)
			old := sent.Primary(t)
			if err := sent.Nodes[0].Client(t).Do(ctx, "SENTINEL", "FAILOVER", testenv.SentinelMaster).Err(); err != nil {
				t.Fatalf("SENTINEL FAILOVER: %v", err)
			}
			now := sent.WaitPrimary(t, old)
			wait(3) // grants continue on the new primary
			n := stop()
			r1, first1 := g.reused(0)
			t.Logf("%s: forced failover %s -> %s: %d grants, %d of them with a token handed out before (%s)", mode, old, now, n, r1, first1)
			if n == 0 {
				t.Fatal("no grant succeeded around the forced failover")
			}

			// 2. The replica (the old primary) stops hearing from the primary, the
			// primary grants once more, and is killed.
			oldNode, newNode := nodes[old], nodes[now]
			// Sentinel turns the old primary into a replica of the new one when
			// it next looks at it; do it now rather than wait.
			if err := oldNode.Client(t).Do(ctx, "REPLICAOF", "127.0.0.1", fmt.Sprint(newNode.Port)).Err(); err != nil {
				t.Fatal(err)
			}
			waitPrimaryReplicated(t, newNode)
			cutFromPrimary(ctx, t, oldNode.Client(t))
			cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			err := grant(cctx)
			cancel()
			checkUnreplicatedGrant(t, mode, "a grant before the kill, which the replica cannot acknowledge", err)
			before, killedAt := g.max(), g.len()
			newNode.Kill()
			third := sent.WaitPrimary(t, now)
			if third != old {
				t.Fatalf("the sentinels promoted %s, want %s", third, old)
			}
			// The promoted node has no replica left to wait for.
			opts.WaitReplicas = 0
			if a, err = redislua.NewAcquirer(fc, &opts); err != nil {
				t.Fatal(err)
			}
			wait, stop = load()
			wait(3)
			n = stop()
			if n == 0 {
				t.Fatal("no grant succeeded after the primary was killed")
			}
			r2, first2 := g.reused(killedAt)
			t.Logf("%s: primary killed: max token before %d, %d grants after, %d of them with a token handed out before (%s); stale writes refused by the resource in all: %d",
				mode, before, n, r2, first2, staleRefused)
			switch mode {
			case "none":
				if r2 == 0 {
					t.Error("with CounterTokens and no WaitReplicas the killed primary's last token was expected to be handed out again")
				}
			default:
				if r1+r2 > 0 {
					t.Errorf("tokens handed out again: %d at the forced failover (%s), %d after the kill (%s)", r1, first1, r2, first2)
				}
				if staleRefused > 0 {
					t.Errorf("%d writes refused as stale: a token came back", staleRefused)
				}
			}
		})
	}
}

// waitPrimaryReplicated waits until the primary's replica has everything.
func waitPrimaryReplicated(t *testing.T, primary *testenv.RedisServer) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: primary.Addr})
	defer c.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		n, err := c.Do(context.Background(), "WAIT", 1, 1000).Int()
		if err == nil && n == 1 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the new primary's replica did not catch up: %d, %v", n, err)
		}
	}
}

// TestSentinelSuites runs the acquirer, writer and idempotency suites through
// Redis Sentinel: a primary, its replica and three sentinels, every client a
// redis.NewFailoverClient that finds the primary by asking the sentinels.
// The acquirer runs with WaitReplicas, the option meant for a replicated
// deployment (its path is the default's plus a WAIT; the defaults run on the
// plain server in TestAcquirerConformance); its second acquirer (NewOther)
// has a failover client of its own. Each suite must leave keys on the primary
// the sentinels name, so it ran through Sentinel and not on another server.
func TestSentinelSuites(t *testing.T) {
	t.Parallel() // servers of its own
	primary := testenv.StartRedis(t, "--repl-diskless-sync-delay", "0")
	replica := testenv.StartRedis(t, "--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	waitPrimaryReplicated(t, primary)
	sent := testenv.StartSentinels(t, primary, 3, 1)
	if got := sent.Primary(t); got != primary.Addr {
		t.Fatalf("the sentinels name %s the primary, want %s", got, primary.Addr)
	}
	fc := sent.FailoverClient(t)
	ctx := context.Background()
	pc := primary.Client(t)
	// onPrimary runs a suite and fails when the primary ran none of its
	// writes (the number of keys is no measure: earlier suites' keys expire
	// meanwhile).
	onPrimary := func(name string, suite func(t *testing.T)) {
		t.Run(name, func(t *testing.T) {
			before, err := scriptCalls(ctx, pc)
			if err != nil {
				t.Fatal(err)
			}
			suite(t)
			if after, err := scriptCalls(ctx, pc); err != nil || after <= before {
				t.Errorf("the %s suite ran no script on the Sentinel primary %s (%d script calls before, %d after, %v)", name, primary.Addr, before, after, err)
			}
		})
	}
	opts := redislua.AcquirerOptions{WaitReplicas: 1, WaitTimeout: 800 * time.Millisecond} // below the client's 1s ReadTimeout
	onPrimary("acquirer", func(t *testing.T) {
		a := newAcquirerOn(t, fc, &opts)
		fencetest.AcquirerSuite{Parallel: true, New: func(t *testing.T) fence.Acquirer { return a }, MaxTTL: redislua.MaxTTL, ShortTTL: shortTTL, BadNames: []string{"a{b}", "x}"},
			NewOther:    func(t *testing.T) fence.Acquirer { return newAcquirerOn(t, sent.FailoverClient(t), &opts) },
			DeleteState: deleteNameKeys(pc), // on the primary, which replicates the DEL
		}.Run(t)
	})
	onPrimary("writer", func(t *testing.T) {
		w := newWriterOn(t, fc, nil)
		fencetest.WriterSuite{New: func(t *testing.T) fence.FencedWriter { return w }, BadKeys: []string{"a{b}", "x}"}}.Run(t)
	})
	onPrimary("idempotency", func(t *testing.T) {
		s := newStoreOn(t, fc, &redislua.IdempotencyOptions{ReleasedRetention: 500 * time.Millisecond})
		idempotencytest.Suite{New: func(t *testing.T) idempotency.Store { return s }, SelfExpiring: true, BadKeys: []string{"a{b}"}}.Run(t)
	})
	if got := sent.Primary(t); got != primary.Addr {
		t.Fatalf("the primary changed during the suites: %s, want %s", got, primary.Addr)
	}
	waitPrimaryReplicated(t, primary)
	if n, err := replica.Client(t).DBSize(ctx).Result(); err != nil || n == 0 {
		t.Errorf("the replica holds %d keys (%v) after the suites", n, err)
	}
}

// scriptCalls is how many scripts (EVAL, EVALSHA) c's server has run, from
// INFO commandstats: fencekit's writes are scripts, and Sentinel's own
// traffic (PING, INFO, PUBLISH) runs none.
func scriptCalls(ctx context.Context, c *redis.Client) (int64, error) {
	info, err := c.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, err
	}
	var n int64
	for _, line := range strings.Split(info, "\n") {
		for _, cmd := range []string{"cmdstat_eval:", "cmdstat_evalsha:"} {
			rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd)
			if !ok {
				continue
			}
			calls, _, _ := strings.Cut(strings.TrimPrefix(rest, "calls="), ",")
			v, err := strconv.ParseInt(calls, 10, 64)
			if err != nil {
				return 0, fmt.Errorf("commandstats %q: %w", line, err)
			}
			n += v
		}
	}
	return n, nil
}
