package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bsm/redislock"
	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/go-redsync/redsync/v4"
	goredis "github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/redis/go-redis/v9"
)

// locker takes a lock on name and returns its release.
type locker func(ctx context.Context, name string) (release func() error, err error)

func fencekitLocker(c *redis.Client) locker {
	a, err := redislua.NewAcquirer(c, nil)
	if err != nil {
		panic(err)
	}
	return func(ctx context.Context, name string) (func() error, error) {
		l, err := a.Acquire(ctx, name, 10*time.Second)
		if err != nil {
			return nil, err
		}
		return func() error { return l.Release(ctx) }, nil
	}
}

func redislockLocker(c *redis.Client, retry redislock.RetryStrategy) locker {
	lc := redislock.New(c)
	return func(ctx context.Context, name string) (func() error, error) {
		l, err := lc.Obtain(ctx, name, 10*time.Second, &redislock.Options{RetryStrategy: retry})
		if err != nil {
			return nil, err
		}
		return func() error { return l.Release(ctx) }, nil
	}
}

func redsyncLocker(c *redis.Client, opts ...redsync.Option) locker {
	rs := redsync.New(goredis.NewPool(c))
	return func(ctx context.Context, name string) (func() error, error) {
		m := rs.NewMutex(name, append([]redsync.Option{redsync.WithExpiry(10 * time.Second)}, opts...)...)
		if err := m.LockContext(ctx); err != nil {
			return nil, err
		}
		return func() error {
			ok, err := m.UnlockContext(ctx)
			if err == nil && !ok {
				err = errors.New("redsync: unlock found the lock gone")
			}
			return err
		}, nil
	}
}

// increments is the lesson's workload: workers x each read-modify-write
// increments of one counter, each under the lock. It returns the time taken and
// fails when the count is not exact.
func increments(ctx context.Context, c *redis.Client, lock locker, workers, each int) (time.Duration, error) {
	key := fmt.Sprintf("bench-counter-%d", time.Now().UnixNano())
	if err := c.Set(ctx, key, 0, time.Hour).Err(); err != nil {
		return 0, err
	}
	start := time.Now()
	if err := incrementLoop(ctx, c, lock, key, workers, each); err != nil {
		return 0, err
	}
	took := time.Since(start)
	n, err := c.Get(ctx, key).Int()
	if err != nil {
		return 0, err
	}
	if n != workers*each {
		return 0, fmt.Errorf("counter ended at %d, want %d: lost updates", n, workers*each)
	}
	return took, nil
}

// incrementLoop runs workers goroutines, each doing each read-modify-write
// increments of key under the lock (named key+"-lock"), and returns the first error.
func incrementLoop(ctx context.Context, c *redis.Client, lock locker, key string, workers, each int) error {
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				release, err := lock(ctx, key+"-lock")
				if err != nil {
					errs <- err
					return
				}
				v, err := c.Get(ctx, key).Int()
				if err == nil {
					err = c.Set(ctx, key, v+1, time.Hour).Err()
				}
				if err = errors.Join(err, release()); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// floor is the sequential time of 4 round trips per increment, by PING.
func floor(ctx context.Context, c *redis.Client, n int) (time.Duration, error) {
	start := time.Now()
	for i := 0; i < 4*n; i++ {
		if err := c.Ping(ctx).Err(); err != nil {
			return 0, err
		}
	}
	return time.Since(start), nil
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// BenchmarkPeers runs the lesson's 20 workers x 50 locked increments with
// fencekit, bsm/redislock and go-redsync/redsync (each with its documented retry
// and with a 1ms retry), and the round-trip floor, in rounds of random order.
// It reports each one's mean time and its ratio to the floor and to fencekit.
// BENCH_ROUNDS (default 5), BENCH_WORKERS (20) and BENCH_EACH (50) size it.
func BenchmarkPeers(b *testing.B) {
	addr := os.Getenv("FENCEKIT_REDIS_ADDR")
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	c := redis.NewClient(&redis.Options{Addr: addr, PoolSize: 64})
	defer c.Close()
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		b.Skipf("Redis at %s: %v (run scripts/test.sh once to start it)", addr, err)
	}
	rounds, workers, each := envInt("BENCH_ROUNDS", 5), envInt("BENCH_WORKERS", 20), envInt("BENCH_EACH", 50)
	contenders := []struct {
		name string
		lock locker
	}{
		{"fencekit", fencekitLocker(c)},
		// redislock does not retry by default; its README retries with a
		// linear 100ms backoff.
		{"redislock-100ms", redislockLocker(c, redislock.LinearBackoff(100*time.Millisecond))},
		{"redislock-1ms", redislockLocker(c, redislock.LinearBackoff(time.Millisecond))},
		// redsync's defaults: 32 tries, 50-250ms apart; tries raised so that 20
		// contenders do not give up.
		{"redsync-default", redsyncLocker(c, redsync.WithTries(math.MaxInt32))},
		{"redsync-1ms", redsyncLocker(c, redsync.WithTries(math.MaxInt32), redsync.WithRetryDelay(time.Millisecond))},
	}
	for i := 0; i < b.N; i++ {
		total := map[string]time.Duration{}
		rng := rand.New(rand.NewPCG(uint64(i), 7))
		for r := 0; r < rounds; r++ {
			order := rng.Perm(len(contenders) + 1)
			for _, k := range order {
				if k == len(contenders) {
					d, err := floor(ctx, c, workers*each)
					if err != nil {
						b.Fatal(err)
					}
					total["floor"] += d
					continue
				}
				d, err := increments(ctx, c, contenders[k].lock, workers, each)
				if err != nil {
					b.Fatalf("%s: %v", contenders[k].name, err)
				}
				total[contenders[k].name] += d
			}
		}
		names := make([]string, 0, len(total))
		for n := range total {
			names = append(names, n)
		}
		sort.Slice(names, func(i, j int) bool { return total[names[i]] < total[names[j]] })
		var sb strings.Builder
		fmt.Fprintf(&sb, "%d workers x %d locked increments, mean of %d rounds (floor: 4 PINGs per increment, sequential)\n", workers, each, rounds)
		fmt.Fprintf(&sb, "%-16s %10s %8s %12s\n", "", "time", "/floor", "/fencekit")
		for _, n := range names {
			mean := total[n] / time.Duration(rounds)
			fmt.Fprintf(&sb, "%-16s %10v %8.2f %12.2f\n", n, mean.Round(time.Millisecond),
				float64(total[n])/float64(total["floor"]), float64(total[n])/float64(total["fencekit"]))
			b.ReportMetric(float64(mean.Milliseconds()), n+"-ms")
		}
		b.Log("\n" + sb.String())
	}
}
