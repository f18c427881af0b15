package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// locker takes a lock on name and returns its release.
type locker func(ctx context.Context, name string) (release func() error, err error)

// contender builds one of the compared lockers by name (see Contenders).
func contender(name string, c *redis.Client) locker {
	mk, ok := Contenders[name]
	if !ok {
		panic("unknown contender " + name)
	}
	lock, err := mk(c)
	if err != nil {
		panic(err)
	}
	return func(ctx context.Context, name string) (func() error, error) {
		release, err := lock(ctx, name)
		if err != nil {
			return nil, err
		}
		return func() error { return release(ctx) }, nil
	}
}

var contenderNames = []string{"fencekit", "redislock-100ms", "redislock-1ms", "redsync-default", "redsync-1ms"}

func redisAddr() string {
	if a := os.Getenv("FENCEKIT_REDIS_ADDR"); a != "" {
		return a
	}
	return "127.0.0.1:6379"
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
// BENCH_ROUNDS (default 5), BENCH_WORKERS (20) and BENCH_EACH (50) size it;
// BENCH_CONTENDERS (comma-separated) picks contenders.
func BenchmarkPeers(b *testing.B) {
	c := redis.NewClient(&redis.Options{Addr: redisAddr(), PoolSize: 64})
	defer c.Close()
	lockers := map[string]locker{}
	comparePeers(b, c, "", func(ctx context.Context, name string, workers, each int) (time.Duration, int64, int64, error) {
		if lockers[name] == nil {
			lockers[name] = contender(name, c)
		}
		d, err := increments(ctx, c, lockers[name], workers, each)
		return d, -1, -1, err
	})
}

// run is one contender's locked increments: the time, and the commands
// processed by Redis and sent by the clients (-1 when not counted).
type run func(ctx context.Context, name string, workers, each int) (took time.Duration, server, sent int64, err error)

// comparePeers runs every contender and the round-trip floor in rounds of
// random order and logs each one's mean time, its ratios to the floor and to
// fencekit, and the commands per increment when counted.
func comparePeers(b *testing.B, c *redis.Client, where string, inc run) {
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		b.Skipf("Redis at %s: %v (run scripts/test.sh once to start it)", redisAddr(), err)
	}
	rounds, workers, each := envInt("BENCH_ROUNDS", 5), envInt("BENCH_WORKERS", 20), envInt("BENCH_EACH", 50)
	only := contenderNames
	if v := os.Getenv("BENCH_CONTENDERS"); v != "" {
		only = strings.Split(v, ",")
	}
	for i := 0; i < b.N; i++ {
		total, server, sent := map[string]time.Duration{}, map[string]int64{}, map[string]int64{}
		rng := rand.New(rand.NewPCG(uint64(i), 7))
		for r := 0; r < rounds; r++ {
			for _, k := range rng.Perm(len(only) + 1) {
				if k == len(only) {
					d, err := floor(ctx, c, workers*each)
					if err != nil {
						b.Fatal(err)
					}
					total["floor"] += d
					continue
				}
				d, n, m, err := inc(ctx, only[k], workers, each)
				if err != nil {
					b.Fatalf("%s: %v", only[k], err)
				}
				total[only[k]] += d
				server[only[k]] += n
				sent[only[k]] += m
			}
		}
		names := make([]string, 0, len(total))
		for n := range total {
			names = append(names, n)
		}
		sort.Slice(names, func(i, j int) bool { return total[names[i]] < total[names[j]] })
		counted := sent[only[0]] >= 0
		var sb strings.Builder
		fmt.Fprintf(&sb, "%d workers%s x %d locked increments, mean of %d rounds (floor: 4 PINGs per increment, sequential)\n",
			workers, where, each, rounds)
		fmt.Fprintf(&sb, "%-16s %10s %8s %10s", "", "time", "/floor", "/fencekit")
		if counted {
			fmt.Fprintf(&sb, " %10s %12s", "sent/incr", "server/incr")
		}
		sb.WriteString("\n")
		incr := float64(rounds * workers * each)
		for _, n := range names {
			mean := total[n] / time.Duration(rounds)
			fmt.Fprintf(&sb, "%-16s %10v %8.2f %10.2f", n, mean.Round(time.Millisecond),
				float64(total[n])/float64(total["floor"]), float64(total[n])/float64(total["fencekit"]))
			if counted && n == "floor" {
				fmt.Fprintf(&sb, " %10.1f %12.1f", 4.0, 4.0)
			} else if counted {
				fmt.Fprintf(&sb, " %10.1f %12.1f", float64(sent[n])/incr, float64(server[n])/incr)
			}
			sb.WriteString("\n")
			b.ReportMetric(float64(mean.Milliseconds()), n+"-ms")
		}
		b.Log("\n" + sb.String())
	}
}
