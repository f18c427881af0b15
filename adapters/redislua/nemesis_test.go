package redislua_test

import (
	"context"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// nemesisWriterPrefix keeps the nemesis's writer keys apart from the lock
// keys that its DeleteState removes: a name is also a key there.
const nemesisWriterPrefix = "fencew:"

// TestNemesis: clients on one Redis server, each behind proxies of its own,
// call random lease and write operations while replies are lost, latency
// added, clients partitioned and lock state deleted; the history holds
// (fencetest.NemesisSuite).
func TestNemesis(t *testing.T) {
	direct := testenv.RedisClient(t)
	fencetest.NemesisSuite{
		Acquirer: faultyAcquirer(&redislua.AcquirerOptions{}),
		Writer: func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			c, p := proxiedClient(t)
			return nemesisWriter(t, c), p
		},
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			return newAcquirerOn(t, direct, nil), nemesisWriter(t, direct)
		},
		// The lock, the counter, the line and the waiters of the name (the
		// writer's keys have a prefix of their own); a name with no state
		// yet is fine.
		DeleteState: nemesisDeleteKeys(direct),
		ShortTTL:    300 * time.Millisecond,
	}.Run(t)
}

// TestIdempotencyNemesis: clients on one Redis server, each store on a client
// of its own (go-redis's defaults, its retries included) behind a proxy of
// its own, call idempotency.Do while replies are lost, requests dropped,
// latency added and clients partitioned; the history holds
// (idempotencytest.NemesisSuite).
func TestIdempotencyNemesis(t *testing.T) {
	opts := &redislua.IdempotencyOptions{ReleasedRetention: 500 * time.Millisecond}
	newStore := func(t *testing.T, c redislua.Client) idempotency.Store {
		s := newStoreOn(t, c, opts)
		return s
	}
	direct := newStore(t, testenv.RedisClient(t))
	idempotencytest.NemesisSuite{
		Store: func(t *testing.T) (idempotency.Store, *faultnet.Proxy) {
			c, p := proxiedClient(t)
			return newStore(t, c), p
		},
		Direct: func(*testing.T) idempotency.Store { return direct },
	}.Run(t)
}

// The nemesis on the multi-server topologies: a Redis Cluster, Sentinel and
// Redlock. Each client's connection to each server goes through a proxy of
// its own (fencetest.NemesisSuite.AcquirerProxies and WriterProxies), so a
// fault may cut a client from one node only.

// proxiedDialer starts a proxy to each of addrs and returns a dialer that
// reaches each of those addresses only through its proxy (and refuses any
// other), for a client that learns its servers' addresses from the servers
// (CLUSTER SLOTS, a sentinel's answer), and the proxies in addrs' order.
func proxiedDialer(t *testing.T, addrs []string) (func(context.Context, string, string) (net.Conn, error), []*faultnet.Proxy) {
	byAddr := map[string]*faultnet.Proxy{}
	proxies := make([]*faultnet.Proxy, len(addrs))
	for i, a := range addrs {
		proxies[i] = faultnet.Start(t, a)
		byAddr[a] = proxies[i]
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		p, ok := byAddr[addr]
		if !ok {
			return nil, fmt.Errorf("no proxy for %s: a server the test did not start", addr)
		}
		var d net.Dialer
		return d.DialContext(ctx, network, p.Addr())
	}, proxies
}

// nemesisDeleteKeys returns the nemesis's DeleteState: every key under the
// name's hash tag with the default prefix (the lock, the counter, the line,
// the waiters) deleted on each of clients (every node that may hold them). A
// name with no key yet is fine; an error is reported with t.Errorf, since the
// nemesis calls it from a goroutine of its own.
func nemesisDeleteKeys(clients ...*redis.Client) func(*testing.T, string) {
	return func(t *testing.T, name string) {
		ctx := context.Background()
		for _, c := range clients {
			keys, err := nameKeys(ctx, c, name)
			if err != nil {
				t.Errorf("listing the keys of %q: %v", name, err)
				return
			}
			if len(keys) > 0 {
				if err := c.Del(ctx, keys...).Err(); err != nil {
					t.Errorf("deleting the keys of %q: %v", name, err)
				}
			}
		}
	}
}

// nemesisWriter is a writer on c with the nemesis's key prefix.
func nemesisWriter(t *testing.T, c redislua.Client) fence.FencedWriter {
	w := newWriterOn(t, c, &redislua.WriterOptions{Prefix: nemesisWriterPrefix})
	return w
}

// proxiedNemesis returns the NemesisSuite of a topology whose clients come
// from newClient, each with the proxies of its connections: every acquirer
// (with opts) and every writer has a client of its own, and the direct
// ones share a client of direct. The caller sets DeleteState.
func proxiedNemesis(newClient func(*testing.T) (redislua.Client, []*faultnet.Proxy), opts *redislua.AcquirerOptions, direct func(*testing.T) redislua.Client) fencetest.NemesisSuite {
	return fencetest.NemesisSuite{
		AcquirerProxies: func(t *testing.T) (fence.Acquirer, []*faultnet.Proxy) {
			c, ps := newClient(t)
			return newAcquirerOn(t, c, opts), ps
		},
		WriterProxies: func(t *testing.T) (fence.FencedWriter, []*faultnet.Proxy) {
			c, ps := newClient(t)
			return nemesisWriter(t, c), ps
		},
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			c := direct(t)
			return newAcquirerOn(t, c, opts), nemesisWriter(t, c)
		},
		ShortTTL: 300 * time.Millisecond,
	}
}

// TestClusterNemesis: clients on a 3-primary Redis Cluster, each acquirer and
// writer on a cluster client of its own whose connection to each node goes
// through a proxy of its own, call random lease and write operations while
// replies are lost, latency added, clients partitioned from one node or all
// of them, and lock state deleted; the history holds
// (fencetest.NemesisSuite). The three names and keys fall on the nodes'
// slots at random.
func TestClusterNemesis(t *testing.T) {
	rc := testenv.StartRedisCluster(t, 3)
	direct := rc.Client(t)
	clusterClient := func(t *testing.T) (redislua.Client, []*faultnet.Proxy) {
		dial, proxies := proxiedDialer(t, rc.Addrs())
		c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: rc.Addrs(), Dialer: dial, DialTimeout: time.Second, ReadTimeout: 2 * time.Second})
		t.Cleanup(func() { c.Close() })
		return c, proxies
	}
	primaries := make([]*redis.Client, len(rc.Nodes))
	for i, n := range rc.Nodes {
		primaries[i] = n.Client(t)
	}
	s := proxiedNemesis(clusterClient, nil, func(*testing.T) redislua.Client { return direct })
	s.DeleteState = nemesisDeleteKeys(primaries...)
	s.Run(t)
}

// TestSentinelNemesis: clients on a Sentinel deployment (a primary, its
// replica, three sentinels), each acquirer and writer on a failover client of
// its own whose connections to the primary and to each sentinel go through a
// proxy of their own, call random lease and write operations while replies
// are lost, latency added, clients partitioned from the primary, a sentinel
// or all of them, and lock state deleted on the primary; the history holds
// (fencetest.NemesisSuite). The acquirers WAIT for the replica
// (WaitReplicas), as a replicated deployment should. No failover: the
// primary stays (TestSentinelFailover covers the failover on its own).
func TestSentinelNemesis(t *testing.T) {
	primary := testenv.StartRedis(t, "--repl-diskless-sync-delay", "0")
	testenv.StartRedis(t, "--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	waitPrimaryReplicated(t, primary)
	sent := testenv.StartSentinels(t, primary, 3, 1)
	failoverClient := func(t *testing.T) (redislua.Client, []*faultnet.Proxy) {
		dial, proxies := proxiedDialer(t, append([]string{primary.Addr}, sent.Addrs()...))
		c := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: testenv.SentinelMaster, SentinelAddrs: sent.Addrs(), Dialer: dial,
			DialTimeout: time.Second, ReadTimeout: time.Second, WriteTimeout: time.Second})
		t.Cleanup(func() { c.Close() })
		return c, proxies
	}
	s := proxiedNemesis(failoverClient, &redislua.AcquirerOptions{WaitReplicas: 1}, func(t *testing.T) redislua.Client { return sent.FailoverClient(t) })
	s.DeleteState = nemesisDeleteKeys(primary.Client(t)) // the replica follows
	s.Run(t)
	if got := sent.Primary(t); got != primary.Addr {
		t.Errorf("the primary changed during the run: %s, want %s (the run then tested a failover it did not mean to)", got, primary.Addr)
	}
}

// TestRedlockNemesis: clients of a Redlock on three independent Redis
// servers, each on clients of its own, one per node behind a proxy of its
// own, call random lease operations while replies are lost (from one node or
// all), latency added, clients partitioned from one node or all of them, and
// each name's keys deleted on every node; their tokens fence writes to the
// test Redis server, each client's writer behind a proxy of its own; the
// history holds (fencetest.NemesisSuite). Three nodes, not five: a client cut
// from one of them is left with a bare majority. The nemesis also kills one
// node at a time and starts it again empty after one to two ttls, which is
// as long as Redlock needs a node that lost its data to stay down.
func TestRedlockNemesis(t *testing.T) {
	servers := make([]*testenv.RedisServer, 3)
	nodes := make([]*redis.Client, len(servers))
	direct := make([]redislua.Client, len(servers))
	for i := range servers {
		servers[i] = testenv.StartRedis(t)
		// The deletions have clients of their own, which never dial a node
		// that is down. The Direct Redlock (the stall probes) does: after
		// PoolSize failed dials go-redis answers every dial with the last
		// error ("connection refused") until a probe it makes once a second
		// gets through, so a client shared with it refuses a node for up
		// to a second after the node is back.
		nodes[i] = servers[i].Client(t)
		direct[i] = servers[i].Client(t)
	}
	const ttl = 600 * time.Millisecond
	opts := &redislua.RedlockOptions{NodeTimeout: ttl / 4}
	shared := testenv.RedisClient(t)
	var (
		mu   sync.Mutex
		down = map[int]bool{} // nodes the nemesis stopped
	)
	fencetest.NemesisSuite{
		AcquirerProxies: func(t *testing.T) (fence.Acquirer, []*faultnet.Proxy) {
			own, proxies := proxiedNodes(t, servers)
			return newRedlock(t, own, opts), proxies
		},
		Writer: func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			c, p := proxiedClient(t)
			return nemesisWriter(t, c), p
		},
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			return newRedlock(t, direct, opts), nemesisWriter(t, shared)
		},
		// The name's keys on every running node (a stopped node starts
		// again empty); a crash waits for a deletion in progress.
		DeleteState: func(t *testing.T, name string) {
			mu.Lock()
			defer mu.Unlock()
			var up []*redis.Client
			for i, c := range nodes {
				if !down[i] {
					up = append(up, c)
				}
			}
			nemesisDeleteKeys(up...)(t, name)
		},
		Nodes: len(servers),
		StopNode: func(t *testing.T, i int) func() {
			mu.Lock()
			defer mu.Unlock()
			down[i] = true
			servers[i].Kill()
			return func() {
				mu.Lock()
				defer mu.Unlock()
				if err := servers[i].Relaunch(); err != nil {
					t.Errorf("starting Redlock node %d again: %v", i, err)
					return
				}
				down[i] = false
			}
		},
		ShortTTL: ttl,
		// Redlock's TryAcquire answers ErrHeld when contenders split the
		// nodes' votes (its doc): three clients that try a free name at
		// once, one node each, are all refused.
		SplitVotes: true,
	}.Run(t)
}
