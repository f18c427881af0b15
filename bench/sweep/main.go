// Command sweep runs the Redis contention curve with fencekit and
// its peers alternated in one run, and prints one table:
//
//	cd bench && go run ./sweep -points 1x20,4x5,8x8,16x8 -rounds 3
//
// Commands processed are read from the server's INFO, which counts every
// client: point FENCEKIT_REDIS_ADDR (or -redis-addr) at a Redis of its own
// for exact figures.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"github.com/fencekit/fencekit/bench"
	"github.com/fencekit/fencekit/internal/sweep"
	"github.com/redis/go-redis/v9"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "sweep: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	addr := os.Getenv("FENCEKIT_REDIS_ADDR")
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	ctx := context.Background()
	if sweep.IsChild() {
		c := redis.NewClient(&redis.Options{Addr: addr})
		defer c.Close()
		return sweep.RunChild(ctx, c, bench.Contenders, os.Stdout)
	}
	points := flag.String("points", sweep.DefaultPoints, "processes x workers per process, comma-separated")
	rounds := flag.Int("rounds", 3, "rounds; each runs every contender once, in an order that changes between rounds")
	incr := flag.Int("increments", 1280, "locked increments per run, split between the workers")
	names := flag.String("contenders", strings.Join(bench.Names, ","), "contenders, comma-separated")
	flag.StringVar(&addr, "redis-addr", addr, "Redis host:port (default $FENCEKIT_REDIS_ADDR or 127.0.0.1:6379)")
	flag.Parse()
	pts, err := sweep.ParsePoints(*points)
	if err != nil {
		return err
	}
	cs := strings.Split(*names, ",")
	for _, n := range cs {
		if bench.Contenders[n] == nil {
			return fmt.Errorf("unknown contender %q (have %s)", n, strings.Join(bench.Names, ", "))
		}
	}
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	if err := c.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis at %s: %w", addr, err)
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	return sweep.Main(ctx, os.Stdout, os.Stderr, sweep.Config{
		Client: c, Names: cs, Points: pts, Rounds: *rounds, Increments: *incr,
		Command: func(env string) *exec.Cmd {
			cmd := exec.Command(exe)
			cmd.Env = append(os.Environ(), env, "FENCEKIT_REDIS_ADDR="+addr)
			return cmd
		},
	})
}
