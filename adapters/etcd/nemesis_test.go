package etcdfence_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestNemesis: clients on a 1-member cluster, each acquirer on a client of
// its own behind a proxy of its own, call random lease and write operations
// while replies are lost, latency added, clients partitioned and a name's
// keys deleted; the history holds (fencetest.NemesisSuite).
//
// The package has no writer: the tokens fence a SQLite writer, each client's
// on a handle of its own on one file, as TestThreeNodeLeaderLoss. SQLite has
// no network, so the writers have no proxy (nil): their writes get no lost
// replies or partitions, only the paused holders' stale tokens.
//
// The ttl is the acquirer suite's 4s (etcd raises shorter leases to about
// 2s, and 2s grants came back past their deadline on a loaded machine);
// partitions then last up to 8s, so each seed runs 24s and two seeds run, a
// minute in all, instead of the suite's 4s three times. A 3-member cluster
// runs in TestThreeMemberNemesis.
func TestNemesis(t *testing.T) {
	c := etcdtest.Start(t, 1)
	s := nemesisOn(t, c.Client(t))
	s.Acquirer = func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) { return behindProxy(t, c, nil) }
	s.ShortTTL, s.Duration, s.Seeds = 4*time.Second, 24*time.Second, 2
	s.Run(t)
}

// nemesisOn returns the parts of the suite both nemesis tests share on cl:
// SQLite writers with no proxy, direct acquirers on cl, and a DeleteState
// that deletes every key of the name's line, as the acquirer suite's, until
// a delete is answered.
func nemesisOn(t *testing.T, cl *clientv3.Client) fencetest.NemesisSuite {
	newWriter := sqliteWriters(t)
	return fencetest.NemesisSuite{
		Writer: func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) { return newWriter(t), nil },
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			a, err := etcdfence.NewAcquirer(cl, nil)
			if err != nil {
				t.Fatal(err)
			}
			return a, newWriter(t)
		},
		// A member's crash can leave a delete's outcome unknown (etcd's
		// "request timed out, possibly due to previous leader failure");
		// the delete of a prefix can run twice, so it is sent again until
		// it is answered, and the deletion's span covers every send.
		DeleteState: func(t *testing.T, name string) {
			deadline := time.Now().Add(time.Minute)
			for {
				_, err := cl.Delete(context.Background(), linePrefix(name), clientv3.WithPrefix())
				if err == nil {
					return
				}
				if time.Now().After(deadline) {
					t.Errorf("deleting the keys of %q: %v", name, err)
					return
				}
				time.Sleep(50 * time.Millisecond) // pacing between sends
			}
		},
	}
}

// sqliteWriters returns a maker of SQLite writers, each on a handle of its
// own on one file of t's: the nemesis's fenced resource (the package has no
// writer).
func sqliteWriters(t *testing.T) func(t *testing.T) fence.FencedWriter {
	path := filepath.Join(t.TempDir(), "nemesis.db")
	return func(t *testing.T) fence.FencedWriter {
		db, err := sqlfence.OpenSQLite(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		w, err := sqlfence.NewWriter(sqlfence.SQLite(db), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.CreateTable(context.Background()); err != nil {
			t.Fatal(err)
		}
		return w
	}
}

// TestThreeMemberNemesis: clients on a 3-member cluster, each acquirer on a
// client of every member whose connection to each member goes through a
// proxy of its own, call random lease and write operations while replies
// are lost (from one member or all), latency added, clients partitioned from
// one member (the leader, or a follower) or from all of them, a name's keys
// deleted, and members crash (SIGKILL: a leader hands nothing over) and
// start again on their data one to two ttls later; the history holds
// (fencetest.NemesisSuite). The writers are TestNemesis's SQLite handles,
// with no proxy.
//
// The ttl is etcd's shortest, 2s (the members run in processes of their own,
// not under -race). One seed of 20s, ten ttls, has 14s of faults: room for
// about two crashes (each one to two ttls, one to four ttls apart). The
// expiry lag is what a leader's crash adds to a lease (see below).
func TestThreeMemberNemesis(t *testing.T) {
	c := etcdtest.Start(t, 3)
	s := nemesisOn(t, c.Client(t))
	s.AcquirerProxies = func(t *testing.T) (fence.Acquirer, []*faultnet.Proxy) {
		proxies := make([]*faultnet.Proxy, len(c.Nodes))
		eps := make([]string, len(c.Nodes))
		for i := range c.Nodes {
			proxies[i] = faultnet.Start(t, c.ClientAddr(i))
			proxies[i].ReplyWindow(replyWindow)
			eps[i] = proxies[i].Addr()
		}
		a, err := etcdfence.NewAcquirer(etcdtest.NewClient(t, eps...), nil)
		if err != nil {
			t.Fatal(err)
		}
		return a, proxies
	}
	s.Nodes = len(c.Nodes)
	s.StopNode = func(t *testing.T, i int) func() {
		t.Logf("crashing etcd member %d (the leader was member %d)", i, c.Leader())
		c.Crash(i)
		return func() {
			if err := c.Restart(i, time.Minute); err != nil {
				t.Errorf("restarting etcd member %d: %v", i, err)
			}
		}
	}
	s.ShortTTL, s.Duration, s.Seeds = 2*time.Second, 20*time.Second, 1
	// A leader's crash extends every lease: the new leader sets each
	// lease's expiry to its ttl plus an election timeout (1s, the members'
	// default) from when it takes over (lessor.Promote), so a lease that
	// nobody renews after its last renewal may stay until a ttl, the
	// election (a follower campaigns 1s to 2s after it last heard from the
	// leader) and that 1s past its ttl.
	s.ExpiryLag = s.ShortTTL + 3*time.Second
	s.Run(t)
}
