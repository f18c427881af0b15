package testenv

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// writeFile writes a file in dir and returns its path.
func writeFile(t testing.TB, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// Sentinels are redis-server processes in sentinel mode, monitoring one
// primary under the name SentinelMaster.
type Sentinels struct {
	Nodes []*RedisServer
}

// SentinelMaster is the name the sentinels monitor the primary under.
const SentinelMaster = "fencekit"

// StartSentinels starts n sentinels (quorum n/2+1) monitoring primary, with
// a 1s down-after period, and waits until each knows the primary's replicas
// (want of them) and the other sentinels.
func StartSentinels(t testing.TB, primary *RedisServer, n, replicas int) *Sentinels {
	t.Helper()
	s := &Sentinels{}
	for i := 0; i < n; i++ {
		dir := t.TempDir()
		conf := writeFile(t, dir, "sentinel.conf", fmt.Sprintf(`sentinel monitor %[1]s 127.0.0.1 %[2]d %[3]d
sentinel down-after-milliseconds %[1]s 1000
sentinel failover-timeout %[1]s 5000
sentinel parallel-syncs %[1]s 1
`, SentinelMaster, primary.Port, n/2+1))
		s.Nodes = append(s.Nodes, startRedisIn(t, dir, conf, "--sentinel"))
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, node := range s.Nodes {
		c := node.Client(t)
		for {
			reps, _ := c.Do(context.Background(), "SENTINEL", "REPLICAS", SentinelMaster).Slice()
			sents, _ := c.Do(context.Background(), "SENTINEL", "SENTINELS", SentinelMaster).Slice()
			if len(reps) >= replicas && len(sents) >= n-1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("sentinel %s sees %d replicas and %d other sentinels", node.Addr, len(reps), len(sents))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return s
}

// Addrs returns the sentinels' addresses.
func (s *Sentinels) Addrs() []string {
	var a []string
	for _, n := range s.Nodes {
		a = append(a, n.Addr)
	}
	return a
}

// Primary asks a sentinel for the current primary's address.
func (s *Sentinels) Primary(t testing.TB) string {
	t.Helper()
	for _, n := range s.Nodes {
		addr, err := n.Client(t).Do(context.Background(), "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SentinelMaster).StringSlice()
		if err == nil && len(addr) == 2 {
			return addr[0] + ":" + addr[1]
		}
	}
	t.Fatal("no sentinel knows the primary")
	return ""
}

// WaitPrimary waits until the sentinels name a primary other than old, and it
// answers as a primary.
func (s *Sentinels) WaitPrimary(t testing.TB, old string) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if p := s.Primary(t); p != old {
			c := redis.NewClient(&redis.Options{Addr: p, MaxRetries: -1})
			role, _ := c.Do(context.Background(), "ROLE").Slice()
			c.Close()
			if len(role) > 0 && role[0] == "master" {
				return p
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no failover away from %s within 30s", old)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// FailoverClient returns a client that follows the sentinels' primary, closed
// at the end of the test.
func (s *Sentinels) FailoverClient(t testing.TB) *redis.Client {
	c := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: SentinelMaster, SentinelAddrs: s.Addrs(),
		DialTimeout: time.Second, ReadTimeout: time.Second, WriteTimeout: time.Second})
	t.Cleanup(func() { c.Close() })
	return c
}
