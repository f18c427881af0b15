package natsfence_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestNemesis: clients on the package's server, each acquirer and writer on
// a connection of its own behind a proxy of its own, call random lease and
// write operations while replies are lost, latency added, clients
// partitioned and a name's lock key purged; the history holds
// (fencetest.NemesisSuite). The writer's keys are in a bucket of their own,
// which the purge leaves alone.
//
// The ttl and expiry lag are the acquirer suite's: the server's 1s minimum
// key TTL, and 2s for its expiry timer on a loaded machine. A 4s run would
// hold four ttls; each seed runs 12s instead, three seeds well under a
// minute with the checks after each.
func TestNemesis(t *testing.T) {
	direct := js(t)
	kv := bucket(t, direct, lockBucket)
	fencetest.NemesisSuite{
		Acquirer: func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
			j, p := proxied(t)
			return newAcquirer(t, j, lockBucket, nil), p
		},
		Writer: func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			j, p := proxied(t)
			return newWriter(t, j, writerBucket), p
		},
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			return newAcquirer(t, direct, lockBucket, nil), newWriter(t, direct, writerBucket)
		},
		// Every message of the name's lock key, as the acquirer suite's
		// DeleteState.
		DeleteState: func(t *testing.T, name string) {
			if err := kv.Purge(context.Background(), natsfence.EncodeKey(name)); err != nil {
				t.Errorf("purging the key of %q: %v", name, err)
			}
		},
		ShortTTL:  natsfence.MinTTL,
		ExpiryLag: 2 * time.Second,
		Duration:  12 * time.Second,
	}.Run(t)
}

// TestIdempotencyNemesis: clients on the package's server, each store on a
// connection of its own behind a proxy of its own, call idempotency.Do while
// replies are lost, requests dropped, latency added and clients partitioned;
// the history holds (idempotencytest.NemesisSuite).
func TestIdempotencyNemesis(t *testing.T) {
	cfg := idemBucket(t) // one bucket for every client and seed
	direct := newStore(t, js(t), cfg)
	idempotencytest.NemesisSuite{
		Store: func(t *testing.T) (idempotency.Store, *faultnet.Proxy) {
			j, p := proxied(t)
			return newStoreOpts(t, j, cfg, faultyOpts), p
		},
		Direct: func(*testing.T) idempotency.Store { return direct },
	}.Run(t)
}

// TestClusterNemesis: clients on a 3-node JetStream cluster with R3 buckets,
// each acquirer and writer on a connection of its own that may reach each
// node only through a proxy of its own (client i's connection goes to node
// i mod 3 first, so the clients spread over the nodes), call random lease
// and write operations while replies are lost, latency added, clients
// partitioned from one node or from all of them, a name's lock key purged,
// and nodes stopped and started again on their store one to two ttls later;
// the history holds (fencetest.NemesisSuite). A connection follows
// the next node's proxy only when its own is cut for long enough to
// reconnect, so a fault on a node the client is not connected to changes
// nothing.
//
// The ttl and the expiry lag are TestNemesis's; one seed of 10s keeps the
// test near 15s with the cluster's start.
func TestClusterNemesis(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	direct := jsOn(t, natstest.Connect(t, c.URLs()))
	lockCfg := natsfence.LockBucket("locks-nemesis")
	lockCfg.Replicas = 3
	fenceCfg := jetstream.KeyValueConfig{Bucket: "fences-nemesis", History: 1, Replicas: 3}
	kv := bucket(t, direct, lockCfg)
	var conns atomic.Int64
	// connect returns a JetStream context on a connection of its own whose
	// servers are the nodes' proxies, the first a different node each time.
	connect := func(t *testing.T) (jetstream.JetStream, []*faultnet.Proxy) {
		first := int(conns.Add(1)) % len(c.Nodes)
		proxies := make([]*faultnet.Proxy, len(c.Nodes))
		urls := make([]string, len(c.Nodes))
		for i := range c.Nodes {
			proxies[i] = faultnet.Start(t, c.ClientAddr(i))
			urls[(i-first+len(c.Nodes))%len(c.Nodes)] = "nats://" + proxies[i].Addr()
		}
		// The connection's breaks are the nemesis's doing: not logged.
		quiet := nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {})
		return jsOn(t, natstest.Connect(t, strings.Join(urls, ","), quiet)), proxies
	}
	fencetest.NemesisSuite{
		AcquirerProxies: func(t *testing.T) (fence.Acquirer, []*faultnet.Proxy) {
			j, ps := connect(t)
			return newAcquirer(t, j, lockCfg, nil), ps
		},
		WriterProxies: func(t *testing.T) (fence.FencedWriter, []*faultnet.Proxy) {
			j, ps := connect(t)
			return newWriter(t, j, fenceCfg), ps
		},
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			return newAcquirer(t, direct, lockCfg, nil), newWriter(t, direct, fenceCfg)
		},
		DeleteState: func(t *testing.T, name string) {
			if err := kv.Purge(context.Background(), natsfence.EncodeKey(name)); err != nil {
				t.Errorf("purging the key of %q: %v", name, err)
			}
		},
		// An in-process node cannot be killed: it is shut down (its
		// connections and routes close at once, its store is flushed) and
		// started again on its store and ports.
		Nodes: len(c.Nodes),
		StopNode: func(t *testing.T, i int) func() {
			t.Logf("stopping NATS node %d (the lock bucket's stream leader was node %d)", i, c.StreamLeader("KV_"+lockCfg.Bucket))
			c.Stop(i)
			return func() {
				if err := c.TryRestart(i); err != nil {
					t.Errorf("restarting NATS node %d: %v", i, err)
				}
			}
		},
		ShortTTL:  natsfence.MinTTL,
		ExpiryLag: 2 * time.Second,
		Duration:  10 * time.Second,
		Seeds:     1,
	}.Run(t)
}
