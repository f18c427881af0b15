package testenv

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisCluster is a Redis Cluster of primaries started by a test (no replicas).
type RedisCluster struct {
	Nodes []*RedisServer
	ids   []string
}

// StartRedisCluster starts primaries redis-server processes with cluster mode
// on, splits the 16384 slots between them, joins them and waits until every
// node reports the cluster ok. They are stopped at the end of the test.
// Without a redis-server binary the test skips (fails under CI).
func StartRedisCluster(t testing.TB, primaries int) *RedisCluster {
	t.Helper()
	rc := &RedisCluster{}
	for i := 0; i < primaries; i++ {
		rc.Nodes = append(rc.Nodes, StartRedis(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "5000", "--cluster-require-full-coverage", "yes"))
	}
	ctx := context.Background()
	per := 16384 / primaries
	for i, n := range rc.Nodes {
		c := n.Client(t)
		lo, hi := i*per, (i+1)*per-1
		if i == primaries-1 {
			hi = 16383
		}
		if err := c.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", lo, hi).Err(); err != nil {
			t.Fatalf("CLUSTER ADDSLOTSRANGE on %s: %v", n.Addr, err)
		}
		id, err := c.Do(ctx, "CLUSTER", "MYID").Text()
		if err != nil {
			t.Fatal(err)
		}
		rc.ids = append(rc.ids, id)
		if i > 0 {
			if err := c.Do(ctx, "CLUSTER", "MEET", "127.0.0.1", rc.Nodes[0].Port).Err(); err != nil {
				t.Fatalf("CLUSTER MEET: %v", err)
			}
		}
	}
	rc.waitOK(t)
	return rc
}

func (rc *RedisCluster) waitOK(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for _, n := range rc.Nodes {
		c := n.Client(t)
		for {
			info, _ := c.Do(context.Background(), "CLUSTER", "INFO").Text()
			nodes, _ := c.Do(context.Background(), "CLUSTER", "NODES").Text()
			if strings.Contains(info, "cluster_state:ok") && strings.Count(strings.TrimSpace(nodes), "\n")+1 == len(rc.Nodes) &&
				!strings.Contains(nodes, "handshake") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("cluster not ok on %s:\n%s\n%s", n.Addr, info, nodes)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// Addrs returns the nodes' addresses.
func (rc *RedisCluster) Addrs() []string {
	var a []string
	for _, n := range rc.Nodes {
		a = append(a, n.Addr)
	}
	return a
}

// Client returns a cluster client, closed at the end of the test.
func (rc *RedisCluster) Client(t testing.TB) *redis.ClusterClient {
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: rc.Addrs(), DialTimeout: time.Second, ReadTimeout: 2 * time.Second})
	t.Cleanup(func() { c.Close() })
	return c
}

// Owner returns the index of the node that serves slot, as node 0 sees it.
func (rc *RedisCluster) Owner(t testing.TB, slot int) int {
	t.Helper()
	i, err := rc.ownerSeenBy(t, 0, slot)
	if err != nil {
		t.Fatal(err)
	}
	return i
}

// ownerSeenBy returns the index of the node that serves slot in node
// viewer's view of the cluster.
func (rc *RedisCluster) ownerSeenBy(t testing.TB, viewer, slot int) (int, error) {
	t.Helper()
	shards, err := rc.Nodes[viewer].Client(t).ClusterShards(context.Background()).Result()
	if err != nil {
		return -1, err
	}
	for _, sh := range shards {
		for _, r := range sh.Slots {
			if slot < int(r.Start) || slot > int(r.End) {
				continue
			}
			for _, n := range sh.Nodes {
				if n.Role != "master" {
					continue
				}
				for i, node := range rc.Nodes {
					if int(n.Port) == node.Port {
						return i, nil
					}
				}
			}
		}
	}
	return -1, fmt.Errorf("node %d sees no node serving slot %d", viewer, slot)
}

// Slot returns the cluster slot of key.
func (rc *RedisCluster) Slot(t testing.TB, key string) int {
	t.Helper()
	s, err := rc.Nodes[0].Client(t).ClusterKeySlot(context.Background(), key).Result()
	if err != nil {
		t.Fatal(err)
	}
	return int(s)
}

// Migration moves one slot from one node to another, the way redis-cli
// --cluster reshard does: mark the slot importing and migrating, MIGRATE its
// keys (with their TTLs), then hand the slot over on every node.
type Migration struct {
	rc             *RedisCluster
	slot, from, to int
	src, dst       *redis.Client
}

// BeginMigration marks slot as migrating from node from to node to. Until
// Finish, clients are redirected with ASK for keys already moved, and a
// script over keys split between the nodes gets TRYAGAIN.
func (rc *RedisCluster) BeginMigration(t testing.TB, slot, from, to int) *Migration {
	t.Helper()
	m := &Migration{rc: rc, slot: slot, from: from, to: to, src: rc.Nodes[from].Client(t), dst: rc.Nodes[to].Client(t)}
	ctx := context.Background()
	if err := m.dst.Do(ctx, "CLUSTER", "SETSLOT", slot, "IMPORTING", rc.ids[from]).Err(); err != nil {
		t.Fatalf("SETSLOT IMPORTING: %v", err)
	}
	if err := m.src.Do(ctx, "CLUSTER", "SETSLOT", slot, "MIGRATING", rc.ids[to]).Err(); err != nil {
		t.Fatalf("SETSLOT MIGRATING: %v", err)
	}
	return m
}

// Move migrates the given keys of the slot (all remaining keys when none are given).
func (m *Migration) Move(t testing.TB, keys ...string) {
	t.Helper()
	ctx := context.Background()
	if len(keys) == 0 {
		var err error
		if keys, err = m.src.ClusterGetKeysInSlot(ctx, m.slot, 1000).Result(); err != nil {
			t.Fatal(err)
		}
	}
	if len(keys) == 0 {
		return
	}
	args := []any{"MIGRATE", "127.0.0.1", m.rc.Nodes[m.to].Port, "", 0, 5000, "KEYS"}
	for _, k := range keys {
		args = append(args, k)
	}
	if err := m.src.Do(ctx, args...).Err(); err != nil && err.Error() != "NOKEY" {
		t.Fatalf("MIGRATE %v: %v", keys, err)
	}
}

// Finish moves the remaining keys and assigns the slot to its new node on
// every node.
func (m *Migration) Finish(t testing.TB) {
	t.Helper()
	m.Move(t)
	ctx := context.Background()
	for _, i := range []int{m.to, m.from} {
		if err := m.rc.Nodes[i].Client(t).Do(ctx, "CLUSTER", "SETSLOT", m.slot, "NODE", m.rc.ids[m.to]).Err(); err != nil {
			t.Fatalf("SETSLOT NODE on %s: %v", m.rc.Nodes[i].Addr, err)
		}
	}
	for i, n := range m.rc.Nodes {
		if i != m.to && i != m.from {
			_ = n.Client(t).Do(ctx, "CLUSTER", "SETSLOT", m.slot, "NODE", m.rc.ids[m.to]).Err()
		}
	}
	// As redis-cli --cluster reshard does, wait until every node agrees: a
	// client that reloads its slot map from a node with the old view is sent
	// back and forth with MOVED until its redirects run out.
	deadline := time.Now().Add(10 * time.Second)
	for i := range m.rc.Nodes {
		for {
			owner, err := m.rc.ownerSeenBy(t, i, m.slot)
			if err == nil && owner == m.to {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("node %d still sees slot %d on node %d (%v) after the migration to %d", i, m.slot, owner, err, m.to)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}
