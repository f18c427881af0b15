package redislua_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"runtime"
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

// quietLogger drops go-redis's log lines: the node-loss tests kill servers on
// purpose, and every failed dial would be logged.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

// fiveNodes starts five Redis servers with the extra arguments and returns
// them with a client of each.
func fiveNodes(t *testing.T, extra ...string) ([]*testenv.RedisServer, []redislua.Client) {
	servers := make([]*testenv.RedisServer, 5)
	clients := make([]redislua.Client, 5)
	for i := range servers {
		servers[i] = testenv.StartRedis(t, extra...)
		clients[i] = servers[i].Client(t)
	}
	return servers, clients
}

// fiveNodeRedlock starts five Redis servers with the extra arguments and
// returns them with a Redlock over a client of each, built with opts.
func fiveNodeRedlock(t *testing.T, opts *redislua.RedlockOptions, extra ...string) ([]*testenv.RedisServer, *redislua.Redlock) {
	t.Helper()
	servers, clients := fiveNodes(t, extra...)
	return servers, newRedlock(t, clients, opts)
}

// proxiedNodes returns a client of each of servers that reaches it only
// through a proxy of its own, and the proxies.
func proxiedNodes(t *testing.T, servers []*testenv.RedisServer) ([]redislua.Client, []*faultnet.Proxy) {
	clients := make([]redislua.Client, len(servers))
	proxies := make([]*faultnet.Proxy, len(servers))
	for i, s := range servers {
		clients[i], proxies[i] = clientVia(t, s.Addr, redis.Options{})
	}
	return clients, proxies
}

// pauseNodes pauses the given nodes (SIGSTOP), and resumes them when t ends
// if the test has not.
func pauseNodes(t *testing.T, servers []*testenv.RedisServer, nodes ...int) {
	t.Helper()
	for _, i := range nodes {
		if err := servers[i].Stop(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, i := range nodes {
			_ = servers[i].Continue()
		}
	})
}

// resumeNodes resumes nodes that pauseNodes paused.
func resumeNodes(t *testing.T, servers []*testenv.RedisServer, nodes ...int) {
	t.Helper()
	for _, i := range nodes {
		if err := servers[i].Continue(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestRedlockConformance(t *testing.T) {
	servers, clients := fiveNodes(t)
	// A node gets 2s to answer (the default, a quarter of the ttl and at
	// most 200ms, is too short under -race on a loaded 2-CPU machine; 500ms
	// was too short in a run of the test command beside two busy loops,
	// where 3 of 5 nodes missed it, and 1s in another, where all 5 did), so
	// the shortest lease is 4s.
	opts := &redislua.RedlockOptions{NodeTimeout: 2 * time.Second}
	r := newRedlock(t, clients, opts)
	fencetest.AcquirerSuite{
		New: func(t *testing.T) fence.Acquirer { return r },
		// Another process: a Redlock on clients of its own to the same nodes.
		NewOther: func(t *testing.T) fence.Acquirer {
			return newRedlock(t, nodeClients(t, servers), opts)
		},
		// A Redlock on clients of its own, each node behind a proxy of its
		// own; the suite loses the reply of the first node's next request
		// (one proxy is all it arms), the others answer.
		Faulty: func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
			own, proxies := proxiedNodes(t, servers)
			return newRedlock(t, own, opts), proxies[0]
		},
		ShortTTL: 4 * time.Second,
		// Contenders split the votes and retry: keep the contention test to a
		// size that finishes in seconds under -race on two cores.
		Workers: 8, Increments: 10,
		MaxTTL:   redislua.MaxTTL,
		BadNames: []string{"a{b}", "x}"},
		// The counter set on every node (TokensExhausted: the counters near
		// 2^53 beside the nodes' clocks in microseconds).
		SetCounter: func(t *testing.T, name string, tok fence.Token) {
			for _, s := range servers {
				key := redislua.DefaultPrefix + "{" + name + "}:token"
				if err := s.Client(t).Set(context.Background(), key, uint64(tok), 0).Err(); err != nil {
					t.Fatal(err)
				}
			}
		},
		// The name's keys deleted on every node.
		DeleteState: func(t *testing.T, name string) {
			own := make([]*redis.Client, len(servers))
			for i, s := range servers {
				own[i] = s.Client(t)
			}
			deleteNameKeys(own...)(t, name)
		},
	}.Run(t)
}

// TestRedlockNodeLoss: with 2 of 5 nodes killed it still grants, with tokens
// that keep growing; with 3 killed TryAcquire refuses with ErrNoQuorum, and
// Acquire waits until its context ends and then says so too.
func TestRedlockNodeLoss(t *testing.T) {
	servers, clients := fiveNodes(t)
	// 500ms per node: the default 200ms is too short under -race on a loaded
	// 2-CPU machine ("0 of 5 nodes granted" once in 20 runs).
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond})
	ctx := context.Background()
	var last fence.Token
	grant := func(stage string) error {
		l, err := r.TryAcquire(ctx, "job", 2*time.Second)
		if err != nil {
			return err
		}
		if l.Token() <= last {
			t.Errorf("%s: token %d not above %d", stage, l.Token(), last)
		}
		last = l.Token()
		return l.Release(ctx)
	}
	for i := 0; i < 3; i++ {
		if err := grant("all nodes up"); err != nil {
			t.Fatal(err)
		}
	}
	// Kill the two nodes that took part in every grant so far; the others
	// must carry the counter on.
	servers[0].Kill()
	servers[1].Kill()
	for i := 0; i < 3; i++ {
		if err := grant("2 of 5 killed"); err != nil {
			t.Fatalf("with 2 of 5 nodes killed: %v", err)
		}
	}
	// A holder's lease survives on the three nodes left; a second holder is refused.
	l := mustTryAcquire(ctx, t, r, "job", 2*time.Second)
	if _, err := r.TryAcquire(ctx, "job", time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("second holder with 3 of 5 nodes up: %v, want ErrHeld", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	servers[2].Kill()
	_, err := r.TryAcquire(ctx, "job", time.Second)
	if !errors.Is(err, redislua.ErrNoQuorum) || errors.Is(err, fence.ErrHeld) {
		t.Fatalf("with 3 of 5 nodes killed: %v, want ErrNoQuorum", err)
	}
	// Acquire waits for a majority within its context, and says why it
	// found none when it gives up.
	wctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = r.Acquire(wctx, "job", time.Second)
	if !errors.Is(err, redislua.ErrNoQuorum) || !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Acquire with 3 of 5 nodes killed: %v, want ErrHeld, DeadlineExceeded and ErrNoQuorum", err)
	}
	if waited := time.Since(start); waited < 1500*time.Millisecond {
		t.Fatalf("Acquire with 3 of 5 nodes killed gave up after %v, before its 1.5s context ended", waited)
	}
}

// TestRedlockAcquireWaitsForAMajority: an Acquire that starts while 3 of 5
// nodes are down keeps trying (each try finds no majority, undoes its grant
// on the 2 nodes left, and marks it released there) and is granted once one
// node is back, with a token above every earlier one.
func TestRedlockAcquireWaitsForAMajority(t *testing.T) {
	servers, clients := fiveNodes(t)
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond,
		Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	ctx := context.Background()
	name := fencetest.Name("majority")
	first := mustTryAcquire(ctx, t, r, name, 5*time.Second)
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for _, i := range []int{0, 1, 2} {
		servers[i].Kill()
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	res := acquireInBackground(wctx, r, name, 5*time.Second)
	// Each failed try marks its grant released on the nodes it reached:
	// three marks on node 3 are three tries that found no majority.
	gone := "fence:{" + name + "}:gone:*"
	for {
		keys, err := clients[3].Do(ctx, "KEYS", gone).StringSlice()
		if err != nil {
			t.Fatal(err)
		}
		if len(keys) >= 3 {
			break
		}
		select {
		case r := <-res:
			t.Fatalf("Acquire with 3 of 5 nodes down returned %v, %v after %d tries, before any node came back", r.l, r.err, len(keys))
		case <-time.After(10 * time.Millisecond):
		}
	}
	servers[0].Restart(t) // empty: nodes 3 and 4 carry the counter
	got := <-res
	if got.err != nil {
		t.Fatalf("Acquire after a node came back: %v", got.err)
	}
	defer got.l.Release(ctx)
	if got.l.Token() <= first.Token() {
		t.Errorf("token %d after the wait, not above the earlier %d", got.l.Token(), first.Token())
	}
}

// TestRedlockTokensAcrossMajorities grants on changing majorities (a different
// pair of nodes down each time) and checks that every token is larger than the
// one before: each majority overlaps the previous one.
func TestRedlockTokensAcrossMajorities(t *testing.T) {
	servers, clients := fiveNodes(t)
	ctx := context.Background()
	var last fence.Token
	for round := 0; round < 5; round++ {
		down := []int{round % 5, (round + 2) % 5}
		for _, i := range down {
			if err := servers[i].Stop(); err != nil {
				t.Fatal(err)
			}
		}
		r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond})
		l, err := r.TryAcquire(ctx, "rotating", 4*time.Second)
		if err != nil {
			t.Fatalf("round %d (nodes %v paused): %v", round, down, err)
		}
		if l.Token() <= last {
			t.Errorf("round %d: token %d not above %d", round, l.Token(), last)
		}
		last = l.Token()
		if err := l.Release(ctx); err != nil {
			t.Fatalf("round %d release: %v", round, err)
		}
		for _, i := range down {
			if err := servers[i].Continue(); err != nil {
				t.Fatal(err)
			}
		}
		// A paused node runs the lock and release requests it held when it
		// resumes, in either order (the release's mark refuses a lock that
		// lands after it): wait until it has, so the next round finds it free.
		for _, i := range down {
			deadline := time.Now().Add(10 * time.Second)
			for {
				n, err := clients[i].Do(ctx, "EXISTS", "fence:{rotating}:lock").Int()
				if err == nil && n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("round %d: node %d still locked after it resumed: %d, %v", round, i, n, err)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
	}
}

// heldNode is a Redlock node whose next script call, once armed, goes through
// a proxy (which the test partitions, so the call lands when the test heals
// it), while every other call goes straight to the server.
type heldNode struct {
	redislua.Client
	slow   redislua.Client
	armed  atomic.Bool
	landed chan *redis.Cmd // the held call, once its reply came back
}

func newHeldNode(t *testing.T, s *testenv.RedisServer) (*heldNode, *faultnet.Proxy) {
	slow, p := clientVia(t, s.Addr, redis.Options{MaxRetries: -1, ReadTimeout: time.Minute})
	return &heldNode{Client: s.Client(t), slow: slow, landed: make(chan *redis.Cmd, 1)}, p
}

func (h *heldNode) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	if h.armed.CompareAndSwap(true, false) {
		cmd := h.slow.EvalSha(context.WithoutCancel(ctx), sha, keys, args...)
		h.landed <- cmd
		return cmd
	}
	return h.Client.EvalSha(ctx, sha, keys, args...)
}

// TestRedlockLateLockAfterRelease forces the order that left a node locked
// by nobody for a whole ttl: a grant's lock call to one node is held on the
// way until the grant has returned (released, failed or abandoned) and its
// release has run on that node; then the lock call lands. With two of the
// five nodes killed, one such stray lock on a survivor made every grant fail
// with ErrHeld for the ttl. The next TryAcquire must succeed.
func TestRedlockLateLockAfterRelease(t *testing.T) {
	const ttl = 20 * time.Second // a stray lock outlives the test
	for _, tc := range []string{"released", "failed", "abandoned"} {
		t.Run(tc, func(t *testing.T) {
			servers, clients := fiveNodes(t)
			held, proxy := newHeldNode(t, servers[4])
			clients[4] = held
			r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond})
			ctx := context.Background()
			name := fencetest.Name("late")
			// One grant loads the scripts on every node, so the held call is
			// the lock script itself, not a NOSCRIPT round.
			l := mustTryAcquire(ctx, t, r, name, ttl)
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if tc != "released" {
				servers[0].Kill()
				servers[1].Kill()
			}
			proxy.Partition()
			held.armed.Store(true)
			switch tc {
			case "released":
				l := mustTryAcquire(ctx, t, r, name, ttl)
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
			case "failed":
				// Nodes 2 and 3 grant, node 4 does not answer in time.
				if _, err := r.TryAcquire(ctx, name, ttl); !errors.Is(err, redislua.ErrNoQuorum) {
					t.Fatalf("grant with node 4 held: %v, want ErrNoQuorum", err)
				}
			case "abandoned":
				actx, cancel := context.WithCancel(ctx)
				c2, c3 := servers[2].Client(t), servers[3].Client(t)
				go func() {
					// Give up as soon as nodes 2 and 3 have granted.
					for {
						n2, err2 := c2.Exists(ctx, "fence:{"+name+"}:lock").Result()
						n3, err3 := c3.Exists(ctx, "fence:{"+name+"}:lock").Result()
						if (err2 == nil && err3 == nil && n2+n3 == 2) || actx.Err() != nil {
							cancel()
							return
						}
						time.Sleep(time.Millisecond)
					}
				}()
				_, err := r.TryAcquire(actx, name, ttl)
				cancel()
				if err == nil {
					t.Fatal("abandoned grant succeeded")
				}
			}
			if held.armed.Load() {
				t.Fatal("the grant never called node 4")
			}
			proxy.Heal()
			landed := lateCall(t, held.landed, "the held lock call")
			if tc == "released" {
				servers[0].Kill()
				servers[1].Kill()
			}
			l, err := r.TryAcquire(ctx, name, ttl)
			if err != nil {
				t.Fatalf("after the %s grant's lock call landed late on node 4 (reply %v), with 2 of 5 nodes killed: %v", tc, landed.Val(), err)
			}
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestRedlockRenewAfterLocalDeadline: a Renew on a lease whose
// local deadline has passed returns ErrLost and leaves no node locked for
// another ttl: the next grant succeeds once the first grant expires.
func TestRedlockRenewAfterLocalDeadline(t *testing.T) {
	_, clients := fiveNodes(t)
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond, Drift: 200 * time.Millisecond})
	ctx := context.Background()
	name := fencetest.Name("rlrenew")
	const ttl = 4 * time.Second
	l := mustTryAcquire(ctx, t, r, name, ttl)
	<-l.Context().Done() // the local deadline, up to the drift before the nodes' expiry
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Renew after the local deadline: %v, want ErrLost", err)
	}
	// A renewal would have held the nodes for another 4s.
	actx, cancel := context.WithTimeout(ctx, ttl/2)
	defer cancel()
	next, err := r.Acquire(actx, name, ttl)
	if err != nil {
		t.Fatalf("a grant after a Renew past the local deadline: %v", err)
	}
	next.Release(ctx)
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

// goOnOwnClient runs f in a goroutine that wg counts, on a new client of s
// that neither retries nor times out a read: for a call that keeps the
// server busy.
func goOnOwnClient(t *testing.T, wg *sync.WaitGroup, s *testenv.RedisServer, f func(c *redis.Client)) {
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, ReadTimeout: -1})
	t.Cleanup(func() { c.Close() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		f(c)
	}()
}

// grantedOnNodes returns l, or fails t with what, err and the name's lock
// on every node when err is not nil.
func grantedOnNodes(ctx context.Context, t *testing.T, servers []*testenv.RedisServer, name, what string, l fence.Lease, err error) fence.Lease {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v\nkeys on the nodes:%s", what, err, redlockLocks(ctx, t, servers, name))
	}
	return l
}

// redlockLocks describes the name's lock key on every node (its holder,
// its remaining ttl, whether that grant is marked released there) and how
// many release marks the node has, for failure messages.
func redlockLocks(ctx context.Context, t *testing.T, servers []*testenv.RedisServer, name string) string {
	var b strings.Builder
	base := "fence:{" + name + "}"
	for i, s := range servers {
		c := s.Client(t)
		marks, err := c.Keys(ctx, base+":gone:*").Result()
		if err != nil {
			fmt.Fprintf(&b, "\n  node %d: %v", i, err)
			continue
		}
		v, err := c.Get(ctx, base+":lock").Result()
		if err != nil {
			fmt.Fprintf(&b, "\n  node %d: no lock (%d release marks)", i, len(marks))
			continue
		}
		pttl, _ := c.PTTL(ctx, base+":lock").Result()
		nonce, _, _ := strings.Cut(v, ".")
		marked, _ := c.Exists(ctx, base+":gone:"+nonce).Result()
		fmt.Fprintf(&b, "\n  node %d: locked by %q for %v more, release mark for it: %v (%d release marks)", i, v, pttl, marked == 1, len(marks))
	}
	return b.String()
}

// TestRedlockFailedWaitLeavesNoLock: an Acquire that waits while
// 3 of 5 nodes are paused (SIGSTOP) makes tries that each find no majority and
// undo their partial grant. The paused nodes hold the tries' lock calls (and
// whatever release reached them) and run them when they resume. Once the wait
// has given up and the nodes are back, nobody holds the lock: a new Acquire
// must be granted well within the 60s ttl that a stray lock of a failed try
// would keep the nodes for.
func TestRedlockFailedWaitLeavesNoLock(t *testing.T) {
	t.Parallel()
	servers, r := fiveNodeRedlock(t, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond,
		Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	ctx := context.Background()
	name := fencetest.Name("outagestray")
	const ttl = time.Minute
	// One grant: the scripts are loaded, each client has a connection.
	first := mustTryAcquire(ctx, t, r, name, ttl)
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	pauseNodes(t, servers, 0, 1, 2)
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err := r.Acquire(wctx, name, ttl)
	cancel()
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, redislua.ErrNoQuorum) {
		t.Errorf("Acquire with 3 of 5 nodes paused: %v, want ErrHeld, DeadlineExceeded and ErrNoQuorum", err)
	}
	resumeNodes(t, servers, 0, 1, 2)
	// The nodes are all up; no grant is alive. A waiter must not be kept
	// out for the failed tries' ttl.
	l, err := acquireWithin(ctx, t, r, name, ttl, 20*time.Second)
	grantedOnNodes(ctx, t, servers, name, "Acquire after the failed wait ended and every node resumed", l, err)
	if l.Token() <= first.Token() {
		t.Errorf("token %d not above the earlier %d", l.Token(), first.Token())
	}
	_ = l.Release(ctx)
}

// TestRedlockReleasedLeaveNoLockOnPausedNodes (the "released"
// case of TestRedlockLateLockAfterRelease with a paused node instead of a
// proxy): a grant while 2 of 5 nodes are paused is made on the other 3, and
// its lock calls to the paused two wait in their sockets; Release returns
// nil. When the two resume, whatever they run, nobody holds the lock: with
// 2 other nodes killed, a new Acquire on the 3 left must be granted well
// within the 60s ttl.
func TestRedlockReleasedLeaveNoLockOnPausedNodes(t *testing.T) {
	t.Parallel()
	servers, clients := fiveNodes(t)
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond})
	ctx := context.Background()
	name := fencetest.Name("outagereleased")
	const ttl = time.Minute
	warmUp(ctx, t, r, name, ttl, false) // loads the scripts, one connection per node
	pauseNodes(t, servers, 3, 4)
	l, err := r.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("grant with 2 of 5 nodes paused: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("release with 2 of 5 nodes paused: %v", err)
	}
	// The nodes stay paused until the clients have given up every call to
	// them (go-redis drops a connection whose read timed out): a pause of a
	// second or two, as a slow disk or a VM stall makes.
	deadline := time.Now().Add(15 * time.Second)
	for _, i := range []int{3, 4} {
		for clients[i].(*redis.Client).PoolStats().TotalConns > 0 {
			if time.Now().After(deadline) {
				t.Fatalf("node %d: the client still has %d connections", i, clients[i].(*redis.Client).PoolStats().TotalConns)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	resumeNodes(t, servers, 3, 4)
	servers[0].Kill()
	servers[1].Kill()
	next, err := acquireWithin(ctx, t, r, name, ttl, 15*time.Second)
	_ = grantedOnNodes(ctx, t, servers, name, "Acquire on nodes 2-4 after a released grant, nodes 3 and 4 resumed", next, err).Release(ctx)
}

// TestRedlockWaitEndsAtItsDeadline: with 3 of 5 nodes paused and a
// NodeTimeout (4s) longer than the wait, Acquire returns soon after its
// context ends (or after Backoff.MaxWait when the context has no
// deadline), not a node timeout later, with ErrHeld, DeadlineExceeded and
// ErrNoQuorum. 1.5s of slack is allowed past the end of the wait (the
// single-node Acquirer's leave is bounded by 1s). The clients have
// go-redis's default timeouts (ReadTimeout 3s), as a user's would; the
// testenv clients' 1s ReadTimeout would cut every call short.
func TestRedlockWaitEndsAtItsDeadline(t *testing.T) {
	t.Parallel()
	servers := make([]*testenv.RedisServer, 5)
	clients := make([]redislua.Client, 5)
	for i := range servers {
		servers[i] = testenv.StartRedis(t)
		c := redis.NewClient(&redis.Options{Addr: servers[i].Addr, MaxRetries: -1})
		t.Cleanup(func() { c.Close() })
		clients[i] = c
	}
	const wait, slack = 500 * time.Millisecond, 1500 * time.Millisecond
	ctx := context.Background()
	name := fencetest.Name("outagedeadline")
	warm := newRedlock(t, clients, nil)
	// The warm-up opens each client's connection before nodes are paused;
	// on a loaded machine five just-started servers may answer too late for
	// one grant (2 of 5 answered in time once), so it is asked again.
	// (On a name of its own, which a half-made grant cannot leave locked.)
	l, err := warm.TryAcquire(ctx, fencetest.Name("outagewarm"), 5*time.Second)
	for try := 1; err != nil && try < 5; try++ {
		t.Logf("warm-up grant: %v; again", err)
		l, err = warm.TryAcquire(ctx, fencetest.Name("outagewarm"), 5*time.Second)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	pauseNodes(t, servers, 0, 1, 2)
	for _, tc := range []struct {
		name string
		ctx  func() (context.Context, context.CancelFunc)
		b    fence.Backoff
	}{
		{"context deadline", func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, wait) }, fence.Backoff{}},
		{"MaxWait", func() (context.Context, context.CancelFunc) { return context.WithCancel(ctx) }, fence.Backoff{MaxWait: wait}},
	} {
		// A node timeout longer than the wait: no try runs to its end, so
		// the error says the wait ran out (ErrNoQuorum is for a try that
		// found no majority, and none could). A node timeout a fifth of
		// the wait: tries end, find no majority, and the error says so.
		for _, nt := range []time.Duration{4 * time.Second, wait / 5} {
			t.Run(fmt.Sprintf("%s/node timeout %v", tc.name, nt), func(t *testing.T) {
				r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: nt, Backoff: tc.b})
				wctx, cancel := tc.ctx()
				defer cancel()
				start := time.Now()
				_, err = r.Acquire(wctx, name, 10*time.Second)
				took := time.Since(start)
				if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("Acquire with 3 of 5 nodes paused: %v, want ErrHeld and DeadlineExceeded", err)
				}
				if nt < wait && !errors.Is(err, redislua.ErrNoQuorum) {
					t.Errorf("Acquire with 3 of 5 nodes paused, tries that found no majority: %v, want ErrNoQuorum too", err)
				}
				if took > wait+slack {
					t.Errorf("Acquire with a %v wait and 3 of 5 nodes paused returned after %v, more than %v past the end of its wait", wait, took, slack)
				}
			})
		}
	}
}

// TestRedlockWaitThroughKilledMajority: with 3 of 5 nodes killed, an Acquire
// bounded by Backoff.MaxWait (no context deadline) makes many fast failing
// tries and gives up with ErrHeld, DeadlineExceeded and ErrNoQuorum; once
// the three come back empty, a grant has a token above every earlier one,
// and the goroutines of all those tries are gone.
func TestRedlockWaitThroughKilledMajority(t *testing.T) {
	servers, r := fiveNodeRedlock(t, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond,
		Backoff: fence.Backoff{Min: time.Millisecond, Max: 20 * time.Millisecond, MaxWait: 2 * time.Second}})
	ctx := context.Background()
	name := fencetest.Name("outagekilled")
	var last fence.Token
	for range 3 {
		l := mustTryAcquire(ctx, t, r, name, 5*time.Second)
		if l.Token() <= last {
			t.Fatalf("token %d not above %d", l.Token(), last)
		}
		last = l.Token()
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	base := runtime.NumGoroutine()
	for _, i := range []int{0, 1, 2} {
		servers[i].Kill()
	}
	_, err := r.Acquire(ctx, name, 5*time.Second)
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, redislua.ErrNoQuorum) {
		t.Fatalf("Acquire with 3 of 5 nodes killed: %v, want ErrHeld, DeadlineExceeded and ErrNoQuorum", err)
	}
	for _, i := range []int{0, 1, 2} {
		servers[i].Restart(t) // empty
	}
	l, err := acquireWithin(ctx, t, r, name, 5*time.Second, 20*time.Second)
	if err != nil {
		t.Fatalf("Acquire after the three nodes came back: %v", err)
	}
	if l.Token() <= last {
		t.Errorf("token %d after the nodes came back empty, not above the earlier %d", l.Token(), last)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// Every try's calls have ended; go-redis's own goroutines may differ by
	// a few.
	waitUntil(t, 15*time.Second, 50*time.Millisecond, func() (bool, string) {
		n := runtime.NumGoroutine()
		return n <= base+10, fmt.Sprintf("%d goroutines 15s after the wait, %d before it", n, base)
	})
}

// TestRedlockTwoWaitersThroughMinorityOutage: two Redlocks (each with its
// own clients) take turns on one name while 2 of 5 nodes are paused, so
// their tries split the votes and fail over and over. At no moment do both
// hold the lease, and the tokens grow in the order of the grants.
func TestRedlockTwoWaitersThroughMinorityOutage(t *testing.T) {
	t.Parallel()
	servers, _ := fiveNodes(t)
	ctx := context.Background()
	name := fencetest.Name("outagetwo")
	ownRedlock := func() *redislua.Redlock {
		return newRedlock(t, nodeClients(t, servers), &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond})
	}
	waiters := []*redislua.Redlock{ownRedlock(), ownRedlock()}
	for _, r := range waiters { // load the scripts, open a connection per node
		warmUp(ctx, t, r, name, 10*time.Second, false)
	}
	pauseNodes(t, servers, 3, 4)
	var (
		holding atomic.Int32
		mu      sync.Mutex
		last    fence.Token
		grants  int
		wg      sync.WaitGroup
	)
	for w, r := range waiters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for g := 0; g < 4; g++ {
				actx, cancel := context.WithTimeout(ctx, 60*time.Second)
				l, err := r.Acquire(actx, name, 10*time.Second)
				cancel()
				if err != nil {
					t.Errorf("waiter %d, grant %d: %v", w, g, err)
					return
				}
				if !holding.CompareAndSwap(0, 1) {
					t.Errorf("waiter %d granted token %d while the other holds the lease", w, l.Token())
				}
				mu.Lock()
				if l.Token() <= last {
					t.Errorf("waiter %d granted token %d, not above the previous grant's %d", w, l.Token(), last)
				}
				last = l.Token()
				grants++
				mu.Unlock()
				holding.Store(0)
				if err := l.Release(ctx); err != nil {
					t.Errorf("waiter %d release: %v", w, err)
				}
			}
		}()
	}
	wg.Wait()
	if grants != 8 {
		t.Errorf("%d grants, want 8", grants)
	}
}

// settleGoroutines waits until the goroutine count is back near base (every
// background call has ended), failing after limit.
func settleGoroutines(t *testing.T, base int, limit time.Duration, what string) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for n := runtime.NumGoroutine(); n > base+10; n = runtime.NumGoroutine() {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("%s: %d goroutines after %v, %d before; stacks:\n%s", what, n, limit, base, topStacks(string(buf)))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// topStacks counts the goroutines' stacks by their first redislua frame.
func topStacks(all string) string {
	count := map[string]int{}
	for _, g := range strings.Split(all, "\n\n") {
		key := "other"
		for _, line := range strings.Split(g, "\n") {
			if strings.Contains(line, "redislua.") && !strings.Contains(line, "_test.") {
				key = strings.TrimSpace(line)
				break
			}
		}
		count[key]++
	}
	var b strings.Builder
	for k, n := range count {
		b.WriteString("  " + strconv.Itoa(n) + " x " + k + "\n")
	}
	return b.String()
}

// defaultTimeoutClients returns go-redis clients with the library's default timeouts
// (ReadTimeout 3s, 3 retries), a pool of 2 connections, and on odd nodes
// ContextTimeoutEnabled.
func defaultTimeoutClients(t *testing.T, servers []*testenv.RedisServer) []redislua.Client {
	clients := make([]redislua.Client, len(servers))
	for i, s := range servers {
		c := redis.NewClient(&redis.Options{Addr: s.Addr, PoolSize: 2, ContextTimeoutEnabled: i%2 == 1})
		t.Cleanup(func() { c.Close() })
		clients[i] = c
	}
	return clients
}

// pausedMajorityRedlock starts five nodes, reached through
// defaultTimeoutClients, and a Redlock over them (NodeTimeout 300ms, a fast
// Backoff) that grants and releases name once; it counts the goroutines
// then, pauses nodes 0-2, and returns the servers, the clients, the Redlock
// and that count.
func pausedMajorityRedlock(ctx context.Context, t *testing.T, name string, ttl time.Duration) ([]*testenv.RedisServer, []redislua.Client, *redislua.Redlock, int) {
	t.Helper()
	servers, _ := fiveNodes(t)
	clients := defaultTimeoutClients(t, servers)
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 300 * time.Millisecond,
		Backoff: fence.Backoff{Min: time.Millisecond, Max: 20 * time.Millisecond}})
	warmUp(ctx, t, r, name, ttl, false)
	base := runtime.NumGoroutine()
	pauseNodes(t, servers, 0, 1, 2)
	return servers, clients, r, base
}

// TestRedlockGoroutinesAfterPausedWaits: four waiters try for 5s while 3 of
// 5 nodes are paused, on clients with default timeouts and tiny pools. Once
// the nodes resume, the goroutines return to the baseline within the ttl
// (plus slack), and a new Acquire is granted.
func TestRedlockGoroutinesAfterPausedWaits(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("bgreleasegoroutines")
	const ttl = 4 * time.Second
	servers, _, r, base := pausedMajorityRedlock(ctx, t, name, ttl)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			_, err := r.Acquire(wctx, name, ttl)
			if !errors.Is(err, fence.ErrHeld) {
				t.Errorf("Acquire with 3 of 5 paused: %v", err)
			}
		}()
	}
	wg.Wait()
	t.Logf("goroutines: %d before, %d after the waits", base, runtime.NumGoroutine())
	resumeNodes(t, servers, 0, 1, 2)
	settleGoroutines(t, base, ttl+20*time.Second, "after the nodes resumed")
	l, err := acquireWithin(ctx, t, r, name, ttl, 20*time.Second)
	_ = grantedOnNodes(ctx, t, servers, name, "Acquire after the nodes resumed", l, err).Release(ctx)
}

// TestRedlockCloseClientsDuringBackgroundRelease: failed tries against 3
// paused nodes leave releases running in the background; the clients are
// closed, then the nodes resume. Nothing panics or hangs, and the
// goroutines return to the baseline.
func TestRedlockCloseClientsDuringBackgroundRelease(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("bgreleaseclose")
	const ttl = 30 * time.Second
	servers, clients, r, base := pausedMajorityRedlock(ctx, t, name, ttl)
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err := r.Acquire(wctx, name, ttl)
	cancel()
	if !errors.Is(err, fence.ErrHeld) {
		t.Errorf("Acquire with 3 of 5 paused: %v", err)
	}
	for _, c := range clients {
		_ = c.(*redis.Client).Close()
	}
	resumeNodes(t, servers, 0, 1, 2)
	// Well within the 30s ttl the background releases would run for.
	settleGoroutines(t, base, 15*time.Second, "after the clients were closed")
}

// TestRedlockGoroutinesWhileMajorityDown measures what a wait against a dead
// majority (killed, connection refused: every try fails at once) leaves in
// the background: each failed try starts one release per dead node, alive
// for the ttl plus 1s. It logs the count after a 10s wait with the default
// Backoff, and checks that the goroutines return to the baseline about a
// ttl after the wait, the nodes still down.
func TestRedlockGoroutinesWhileMajorityDown(t *testing.T) {
	servers, r := fiveNodeRedlock(t, nil)
	ctx := context.Background()
	name := fencetest.Name("bgreleasedead")
	const ttl = 10 * time.Second
	warmUp(ctx, t, r, name, ttl, false)
	base := runtime.NumGoroutine()
	for _, i := range []int{0, 1, 2} {
		servers[i].Kill()
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err := r.Acquire(wctx, name, ttl)
	cancel()
	if !errors.Is(err, redislua.ErrNoQuorum) {
		t.Errorf("Acquire with 3 of 5 killed: %v", err)
	}
	t.Logf("goroutines: %d before, %d after a 10s wait (ttl %v), nodes still down", base, runtime.NumGoroutine(), ttl)
	settleGoroutines(t, base, ttl+20*time.Second, "nodes still down")
}

// nodeLock returns the value of name's lock key on c ("" when none).
func nodeLock(ctx context.Context, t *testing.T, c *redis.Client, name string) string {
	t.Helper()
	v, err := c.Get(ctx, "fence:{"+name+"}:lock").Result()
	if errors.Is(err, redis.Nil) {
		return ""
	}
	if err != nil {
		t.Fatalf("reading the lock: %v", err)
	}
	return v
}

// waitLockedEverywhere waits until name is locked on every node by one grant
// (a grant returns once a majority took it; the other lock calls are still
// on their way), and returns that grant's nonce.
func waitLockedEverywhere(ctx context.Context, t *testing.T, servers []*testenv.RedisServer, name string) string {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		nonces := map[string]bool{}
		all := true
		for _, s := range servers {
			c := s.Client(t)
			v := nodeLock(ctx, t, c, name)
			c.Close()
			if v == "" {
				all = false
				break
			}
			nonce, _, _ := strings.Cut(v, ".")
			nonces[nonce] = true
		}
		if all && len(nonces) == 1 {
			for n := range nonces {
				return n
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the grant did not lock every node:%s", redlockLocks(ctx, t, servers, name))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRedlockReleaseDuringLoadingLeavesLock (the README's "no
// node stays locked by a released grant"): the Redlock documentation asks
// for nodes that keep their data across a restart. Such a node answers
// every command with -LOADING while it reads its data back (here: DEBUG
// RELOAD, which saves and loads the dataset as a restart would, made slow by
// key-load-delay). A Release that reaches 3 of 5 nodes while they load gets
// -LOADING from them: the release did not run there, and the nodes come back
// holding the released grant's lock. releaseOn counts any Redis reply as an
// answer and never sends that release again, so the lock stays for the
// ttl: a new Acquire is refused long after every node is up.
func TestRedlockReleaseDuringLoadingLeavesLock(t *testing.T) {
	t.Parallel()
	reloadErrs := make([]error, 3)
	releaseWhileStalled(t, "bgreleaseloading", "load", []string{"--enable-debug-command", "yes", "--loading-process-events-interval-bytes", "1024"},
		func(ctx context.Context, i int, s *testenv.RedisServer, wg *sync.WaitGroup) {
			admin := s.Client(t)
			// 4000 filler keys read back at 2ms each: about 8s of loading.
			if err := admin.Do(ctx, "DEBUG", "POPULATE", 4000, "loadfiller", 10).Err(); err != nil {
				t.Fatal(err)
			}
			if err := admin.ConfigSet(ctx, "key-load-delay", "2000").Err(); err != nil {
				t.Fatal(err)
			}
			goOnOwnClient(t, wg, s, func(reloader *redis.Client) {
				reloadErrs[i] = reloader.Do(ctx, "DEBUG", "RELOAD").Err()
			})
			// Wait until the node is loading (INFO is answered while loading).
			waitUntil(t, 20*time.Second, 5*time.Millisecond, func() (bool, string) {
				info, err := admin.Info(ctx, "persistence").Result()
				return err == nil && strings.Contains(info, "loading:1"), fmt.Sprintf("node %d never started loading: %v %q", i, err, info)
			})
		},
		func(ctx context.Context, stalled []*testenv.RedisServer, wg *sync.WaitGroup) {
			wg.Wait()
			for i, s := range stalled {
				if reloadErrs[i] != nil {
					t.Fatalf("node %d: DEBUG RELOAD: %v", i, reloadErrs[i])
				}
				if err := s.Client(t).ConfigSet(ctx, "key-load-delay", "0").Err(); err != nil {
					t.Fatal(err)
				}
			}
		})
}

// releaseWhileStalled starts five nodes with the extra arguments; a
// Redlock over them grants a name after prefix (ttl 60s), and every node
// holds its lock. stall then makes each of nodes 0-2 refuse commands with
// an error reply (what refuses them runs in a goroutine that wg counts), and
// returns once the node does. The lease is released while the three
// stalled nodes do what how says (logged), and resume makes them answer
// again. Every node is up and answering then, and the lease was released: a
// new Redlock must be granted the name within 20s, not after the ttl.
func releaseWhileStalled(t *testing.T, prefix, how string, extra []string,
	stall func(ctx context.Context, i int, s *testenv.RedisServer, wg *sync.WaitGroup),
	resume func(ctx context.Context, stalled []*testenv.RedisServer, wg *sync.WaitGroup)) {
	t.Helper()
	servers, r := fiveNodeRedlock(t, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second}, extra...)
	ctx := context.Background()
	name := fencetest.Name(prefix)
	const ttl = time.Minute
	l := mustTryAcquire(ctx, t, r, name, ttl)
	waitLockedEverywhere(ctx, t, servers, name)
	var wg sync.WaitGroup
	for i, s := range servers[:3] {
		stall(ctx, i, s, &wg)
	}
	err := l.Release(ctx)
	t.Logf("Release while nodes 0-2 %s: %v", how, err)
	resume(ctx, servers[:3], &wg)
	l2, err := acquireAfresh(ctx, t, nodeClients(t, servers), name, ttl)
	_ = grantedOnNodes(ctx, t, servers, name, fmt.Sprintf("Acquire 20s after a Release (lease context: %v) that met 3 nodes that %s, all nodes up since", l.Context().Err(), how), l2, err).Release(ctx)
}

// persistentRedis is a redis-server that keeps its directory across a restart
// (testenv's Restart starts empty and waits for PING, which a loading node
// refuses).
type persistentRedis struct {
	addr string
	args []string
	cmd  *exec.Cmd
}

func startPersistentRedis(t *testing.T, extra ...string) *persistentRedis {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		testenv.Missing(t, "redis-server", err)
	}
	dir := t.TempDir()
	port := testenv.Port(t)
	p := &persistentRedis{addr: "127.0.0.1:" + strconv.Itoa(port)}
	p.args = append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", filepath.Join(dir, "redis.log")}, extra...)
	p.run(t, bin, p.args)
	t.Cleanup(p.kill)
	return p
}

// run starts the process and waits until it accepts connections.
func (p *persistentRedis) run(t *testing.T, bin string, args []string) {
	t.Helper()
	p.cmd = exec.Command(bin, args...)
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", p.addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("redis-server on %s did not start: %v", p.addr, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (p *persistentRedis) kill() {
	if p.cmd != nil && p.cmd.Process != nil {
		_ = p.cmd.Process.Kill()
		_, _ = p.cmd.Process.Wait()
		p.cmd = nil
	}
}

func (p *persistentRedis) client(t *testing.T) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: p.addr, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
	t.Cleanup(func() { c.Close() })
	return c
}

// TestRedlockReleaseLaterStopsAtLoading: as above, through
// releaseLater. 3 of 5 nodes crash (SIGKILL) after saving their data, which
// holds the grant's lock; the lease is released while they are down (no
// answer: the release is sent again in the background). They restart from
// their data: the first answer the background release gets is -LOADING,
// which ends it, although it did not run. Once loaded, the 3 nodes hold the
// released grant's lock for the ttl.
func TestRedlockReleaseLaterStopsAtLoading(t *testing.T) {
	t.Parallel()
	procs := make([]*persistentRedis, 5)
	clients := make([]redislua.Client, 5)
	for i := range procs {
		procs[i] = startPersistentRedis(t, "--enable-debug-command", "yes", "--loading-process-events-interval-bytes", "1024")
		clients[i] = procs[i].client(t)
	}
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("bgreleaserestart")
	const ttl = time.Minute
	l := mustTryAcquire(ctx, t, r, name, ttl)
	lockKey := "fence:{" + name + "}:lock"
	// Every node has the lock (the grant returned at a majority).
	deadline := time.Now().Add(15 * time.Second)
	for i, p := range procs {
		waitUntil(t, time.Until(deadline), 10*time.Millisecond, func() (bool, string) {
			n, err := p.client(t).Exists(ctx, lockKey).Result()
			return err == nil && n == 1, fmt.Sprintf("node %d never got the lock: %v", i, err)
		})
	}
	down := []int{0, 1, 2}
	for _, i := range down {
		admin := procs[i].client(t)
		if err := admin.Do(ctx, "DEBUG", "POPULATE", 4000, "loadfiller", 10).Err(); err != nil {
			t.Fatal(err)
		}
		if err := admin.Save(ctx).Err(); err != nil { // what AOF with fsync keeps
			t.Fatal(err)
		}
		procs[i].kill()
	}
	err := l.Release(ctx)
	t.Logf("Release with nodes 0-2 down: %v", err)
	bin, _ := exec.LookPath("redis-server")
	for _, i := range down {
		procs[i].run(t, bin, append(procs[i].args, "--key-load-delay", "2000")) // about 8s of loading
	}
	for _, i := range down {
		admin := procs[i].client(t)
		waitUntil(t, 60*time.Second, 20*time.Millisecond, func() (bool, string) {
			info, err := admin.Info(ctx, "persistence").Result()
			return err == nil && strings.Contains(info, "loading:0"), fmt.Sprintf("node %d still loading: %v", i, err)
		})
	}
	other := make([]redislua.Client, len(procs))
	for i, p := range procs {
		other[i] = p.client(t)
	}
	l2, err := acquireAfresh(ctx, t, other, name, ttl)
	if err != nil {
		var locked []string
		for i, p := range procs {
			v, _ := p.client(t).Get(ctx, lockKey).Result()
			pttl, _ := p.client(t).PTTL(ctx, lockKey).Result()
			locked = append(locked, "node "+strconv.Itoa(i)+": "+v+" for "+pttl.String())
		}
		t.Fatalf("Acquire 20s after the released grant's nodes came back: %v\n  %s", err, strings.Join(locked, "\n  "))
	}
	_ = l2.Release(ctx)
}

// TestRedlockReleaseDuringBusyScriptLeavesLock: a node running a
// long script (another application's, or a slow one) answers -BUSY to every
// other command once busy-reply-threshold has passed. A Release that meets
// 3 of 5 busy nodes did not run there, and is not sent again: when the
// script ends, those nodes hold the released grant's lock for the ttl.
func TestRedlockReleaseDuringBusyScriptLeavesLock(t *testing.T) {
	t.Parallel()
	releaseWhileStalled(t, "bgreleasebusy", "run a script", nil,
		func(ctx context.Context, i int, s *testenv.RedisServer, wg *sync.WaitGroup) {
			admin := s.Client(t)
			if err := admin.ConfigSet(ctx, "busy-reply-threshold", "100").Err(); err != nil {
				t.Fatal(err)
			}
			goOnOwnClient(t, wg, s, func(spinner *redis.Client) {
				_ = spinner.Eval(ctx, "while true do end", nil).Err() // ends with SCRIPT KILL
			})
			waitUntil(t, 20*time.Second, 5*time.Millisecond, func() (bool, string) {
				err := admin.Ping(ctx).Err()
				return err != nil && strings.HasPrefix(err.Error(), "BUSY"), fmt.Sprintf("node %d never busy: %v", i, err)
			})
		},
		func(ctx context.Context, stalled []*testenv.RedisServer, wg *sync.WaitGroup) {
			for _, s := range stalled {
				if err := s.Client(t).ScriptKill(ctx).Err(); err != nil {
					t.Fatal(err)
				}
			}
			wg.Wait()
		})
}

// TestRedlockBackgroundReleaseSparesLaterGrant: a lease renewed and released
// while 2 of 5 nodes are paused leaves its renewal and its release (sent
// again in the background) waiting in those nodes' sockets; the same Redlock
// then grants the name again on the 3 others, and renews it. When the two
// resume and every background call has ended, no node holds the old grant,
// the new one still holds its majority (Renew nil), and once it is released
// the name is free at once.
func TestRedlockBackgroundReleaseSparesLaterGrant(t *testing.T) {
	servers, r := fiveNodeRedlock(t, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond})
	ctx := context.Background()
	name := fencetest.Name("bgreleaselater")
	const ttl = 10 * time.Second
	warmUp(ctx, t, r, name, ttl, false)
	base := runtime.NumGoroutine()
	a := mustTryAcquire(ctx, t, r, name, ttl)
	nonceA := waitLockedEverywhere(ctx, t, servers, name)
	pauseNodes(t, servers, 3, 4)
	if err := a.Renew(ctx); err != nil {
		t.Fatalf("renew with 2 of 5 paused: %v", err)
	}
	if err := a.Release(ctx); err != nil {
		t.Fatalf("release with 2 of 5 paused: %v", err)
	}
	b, err := r.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("grant again with 2 of 5 paused: %v", err)
	}
	if b.Token() <= a.Token() {
		t.Errorf("token %d not above %d", b.Token(), a.Token())
	}
	if err := b.Renew(ctx); err != nil {
		t.Fatalf("renew of the new grant: %v", err)
	}
	resumeNodes(t, servers, 3, 4)
	settleGoroutines(t, base, ttl+30*time.Second, "after the nodes resumed")
	held := 0
	for i, s := range servers {
		v := nodeLock(ctx, t, s.Client(t), name)
		nonce, _, _ := strings.Cut(v, ".")
		switch {
		case nonce == nonceA:
			t.Errorf("node %d still locked by the released grant", i)
		case v != "":
			held++
		}
	}
	if held < 3 {
		t.Errorf("the new grant holds %d nodes after the old one's background release:%s", held, redlockLocks(ctx, t, servers, name))
	}
	if err := b.Renew(ctx); err != nil {
		t.Errorf("renew of the new grant after the old one's background release: %v", err)
	}
	if err := b.Release(ctx); err != nil {
		t.Errorf("release of the new grant: %v", err)
	}
	c, err := r.TryAcquire(ctx, name, ttl)
	_ = grantedOnNodes(ctx, t, servers, name, "TryAcquire after both grants were released, all nodes up", c, err).Release(ctx)
}

// TestRedlockReleaseWithEndedContext: Release with a context that has
// already ended, and one that ends while 3 of 5 nodes are paused, returns at
// once with an error matching fence.ErrUnknown (never ErrLost: the lease was
// held), the release still reaches every node, and a later Renew is ErrLost.
func TestRedlockReleaseWithEndedContext(t *testing.T) {
	t.Parallel()
	servers, r := fiveNodeRedlock(t, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second})
	ctx := context.Background()
	const ttl = time.Minute
	free := func(name string) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for i := 0; i < len(servers); {
			if nodeLock(ctx, t, servers[i].Client(t), name) == "" {
				i++
				continue
			}
			if time.Now().After(deadline) {
				t.Fatalf("a released lease still locks a node 20s later:%s", redlockLocks(ctx, t, servers, name))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	name := fencetest.Name("bgreleasedone")
	l := mustTryAcquire(ctx, t, r, name, ttl)
	waitLockedEverywhere(ctx, t, servers, name)
	done, cancel := context.WithCancel(ctx)
	cancel()
	err := l.Release(done)
	if !errors.Is(err, fence.ErrUnknown) && err != nil {
		t.Errorf("Release with an ended context: %v, want nil or ErrUnknown", err)
	}
	free(name)
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew after Release: %v, want ErrLost", err)
	}

	name = fencetest.Name("bgreleasemid")
	l = mustTryAcquire(ctx, t, r, name, ttl)
	waitLockedEverywhere(ctx, t, servers, name)
	pauseNodes(t, servers, 2, 3, 4)
	mid, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	start := time.Now()
	err = l.Release(mid)
	took := time.Since(start)
	cancel()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("Release ending with its context, 3 of 5 paused: %v, want ErrUnknown", err)
	}
	if took > 1500*time.Millisecond {
		t.Errorf("Release with a 300ms context returned after %v", took)
	}
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew after Release: %v, want ErrLost", err)
	}
	resumeNodes(t, servers, 2, 3, 4)
	free(name)
}
