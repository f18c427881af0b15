package redislua_test

import (
	"testing"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// BenchmarkFlakyNetwork: 8 workers x 200 locked increments of one counter
// (Acquire, Read, fenced Write with the Writer, Release), the acquirer and the
// writer on one client that reaches Redis only through a fault proxy with
// 1-3 ms jitter, then with 2% cuts too (benchutil.FlakyNetwork). Run it alone,
// once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/redislua/
func BenchmarkFlakyNetwork(b *testing.B) {
	benchutil.FlakyNetwork(b, benchutil.Flaky{
		Name:   "redis",
		Target: func(*testing.B) string { return testenv.RedisAddr() },
		Open: func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
			testenv.RedisClient(b) // skips when there is no server
			c := redis.NewClient(&redis.Options{Addr: p.Addr(), PoolSize: 16})
			b.Cleanup(func() { c.Close() })
			a, err := redislua.NewAcquirer(c, nil)
			if err != nil {
				b.Fatal(err)
			}
			w, err := redislua.NewWriter(c, nil)
			if err != nil {
				b.Fatal(err)
			}
			return a, w
		},
	})
}
