package redislua_test

import (
	"context"
	"sync"
	"testing"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// The suites' optional harness parts for Redis: an independent acquirer on a
// client of its own (NewOther), and a writer or acquirer whose client reaches
// the server through a faultnet proxy (Faulty).

// proxiedClient returns a client of the test Redis server that dials it only
// through a new proxy.
func proxiedClient(t *testing.T) (*redis.Client, *faultnet.Proxy) {
	return clientVia(t, testenv.RedisAddr(), redis.Options{})
}

// clientVia starts a proxy to addr and returns a client with the options o
// that dials addr only through it, and the proxy.
func clientVia(t *testing.T, addr string, o redis.Options) (*redis.Client, *faultnet.Proxy) {
	p := faultnet.Start(t, addr)
	o.Addr = p.Addr()
	c := redis.NewClient(&o)
	t.Cleanup(func() { c.Close() })
	return c, p
}

// otherAcquirer returns NewOther: an acquirer with opts on a client of its own.
func otherAcquirer(opts *redislua.AcquirerOptions) func(*testing.T) fence.Acquirer {
	return func(t *testing.T) fence.Acquirer { return newAcquirerOn(t, testenv.RedisClient(t), opts) }
}

// faultyAcquirer returns Faulty: an acquirer with opts behind a new proxy.
func faultyAcquirer(opts *redislua.AcquirerOptions) func(*testing.T) (fence.Acquirer, *faultnet.Proxy) {
	return func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
		c, p := proxiedClient(t)
		return newAcquirerOn(t, c, opts), p
	}
}

// faultyWriter is Faulty: a default writer behind a new proxy.
func faultyWriter(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
	c, p := proxiedClient(t)
	w := newWriterOn(t, c, nil)
	return w, p
}

// nameKeys lists every key on c under name's hash tag with the default
// prefix.
func nameKeys(ctx context.Context, c *redis.Client, name string) ([]string, error) {
	var keys []string
	iter := c.Scan(ctx, 0, redislua.DefaultPrefix+"{"+name+"}*", 100).Iterator()
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	return keys, iter.Err()
}

// deleteNameKeys returns DeleteState: on each of clients (every node, for
// Redlock), it deletes every key under the name's hash tag with the default
// prefix (the lock, the token counter, the line and the waiters' entries), as
// a DEL, a FLUSHALL or an eviction would. A name with no key on any node
// fails the test: the deletion would prove nothing.
func deleteNameKeys(clients ...*redis.Client) func(*testing.T, string) {
	return func(t *testing.T, name string) {
		ctx := context.Background()
		deleted := int64(0)
		for _, c := range clients {
			keys, err := nameKeys(ctx, c, name)
			if err != nil {
				t.Fatalf("listing the keys of %q: %v", name, err)
			}
			if len(keys) == 0 {
				continue
			}
			n, err := c.Del(ctx, keys...).Result()
			if err != nil {
				t.Fatalf("deleting the keys of %q: %v", name, err)
			}
			deleted += n
		}
		if deleted == 0 {
			t.Fatalf("no key of %q to delete", name)
		}
	}
}

// deleteClusterNameKeys returns DeleteState on a Redis Cluster: the name's
// keys deleted on whichever primary holds the name's slot.
func deleteClusterNameKeys(cc *redis.ClusterClient) func(*testing.T, string) {
	return func(t *testing.T, name string) {
		var (
			mu        sync.Mutex
			primaries []*redis.Client
		)
		err := cc.ForEachMaster(context.Background(), func(_ context.Context, c *redis.Client) error {
			mu.Lock()
			defer mu.Unlock()
			primaries = append(primaries, c)
			return nil
		})
		if err != nil {
			t.Fatalf("listing the primaries: %v", err)
		}
		deleteNameKeys(primaries...)(t, name)
	}
}
