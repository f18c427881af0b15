package bench

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/fencekit/fencekit/internal/sweep"
	"github.com/redis/go-redis/v9"
)

// BenchmarkSweep runs the contention curve (internal/sweep) with fencekit and
// its peers alternated, as go run ./sweep does, and logs its table.
// BENCH_POINTS (default 1x20,4x5,8x8,16x8), BENCH_ROUNDS (3), BENCH_INCREMENTS
// (1280) and BENCH_CONTENDERS (comma-separated, default all) size it.
func BenchmarkSweep(b *testing.B) {
	c := redis.NewClient(&redis.Options{Addr: redisAddr()})
	defer c.Close()
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		b.Skipf("Redis at %s: %v (run scripts/test.sh once to start it)", redisAddr(), err)
	}
	points := sweep.DefaultPoints
	if v := os.Getenv("BENCH_POINTS"); v != "" {
		points = v
	}
	pts, err := sweep.ParsePoints(points)
	if err != nil {
		b.Fatal(err)
	}
	names := Names
	if v := os.Getenv("BENCH_CONTENDERS"); v != "" {
		names = strings.Split(v, ",")
	}
	for i := 0; i < b.N; i++ {
		var out, progress strings.Builder
		err := sweep.Main(ctx, &out, &progress, sweep.Config{
			Client: c, Names: names, Points: pts,
			Rounds: envInt("BENCH_ROUNDS", 3), Increments: envInt("BENCH_INCREMENTS", 1280),
			Command: func(env string) *exec.Cmd {
				cmd := exec.Command(os.Args[0])
				cmd.Env = append(os.Environ(), env)
				return cmd
			},
		})
		if err != nil {
			b.Fatal(err)
		}
		b.Log("\n" + out.String())
	}
}
