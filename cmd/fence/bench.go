package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/sweep"
	"github.com/redis/go-redis/v9"
)

func runBench(args []string, stdout, stderr io.Writer) error {
	fs, bc := commandFlags("bench", "bench [flags]",
		"Measures, in one run on one backend, each figure as a ratio to a baseline\n"+
			"measured alongside it: a fenced write against a plain write of the same size,\n"+
			"an uncontended acquire + release, and the lesson's locked increments. On Redis\n"+
			"also the increments against the round-trip floor (4 PINGs per increment) and\n"+
			"the lesson's exercise: a lock around a read-modify-write against one Lua script.\n"+
			"On PostgreSQL and MySQL also against the server's own lock (pg_advisory_lock,\n"+
			"GET_LOCK; no token, no ttl): an uncontended lock + unlock, and the increments.", false, stdout, stderr)
	ops := fs.Int("n", 5000, "fenced and plain writes each, interleaved in random order")
	rounds := fs.Int("rounds", 3, "rounds of the locked increments (alternating with the round-trip floor on Redis, with the server's own lock on PostgreSQL and MySQL)")
	workers := fs.Int("workers", 20, "workers in the contention run")
	each := fs.Int("each", 50, "locked increments per worker in the contention run")
	exerciseEach := fs.Int("exercise-each", 500, "updates per worker in the Redis lock-versus-Lua exercise")
	processes := fs.Int("processes", 1, "processes the contention run's workers are spread over (postgres, mysql and redis)")
	doSweep := fs.Bool("sweep", false, "redis: run the contention curve instead (processes x workers at each of -points, -rounds rounds, fencekit's contenders alternated); the peers' side: cd bench && go run ./sweep")
	points := fs.String("points", sweep.DefaultPoints, "with -sweep: processes x workers per process, comma-separated")
	increments := fs.Int("increments", 1280, "with -sweep: locked increments per run, split between the workers")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := bc.checkFlags(fs.FlagSet); err != nil {
		return err
	}
	if *doSweep {
		return runSweep(*bc, *points, *rounds, *increments, stdout, stderr)
	}
	if *processes < 1 || *processes > *workers {
		return usagef("-processes must be between 1 and -workers (%d)", *workers)
	}
	if *processes > 1 && !slices.Contains(sharedBackends, bc.name) {
		return usagef("-processes needs a backend other processes can reach: %s", strings.Join(sharedBackends, ", "))
	}
	if *ops < 1 || *rounds < 1 || *workers < 1 || *each < 1 || *exerciseEach < 1 {
		return usagef("-n, -rounds, -workers, -each and -exercise-each must be at least 1")
	}
	ctx := context.Background()
	b, err := openBackend(ctx, *bc)
	if err != nil {
		return err
	}
	defer b.close()

	fenced, plain, err := writePair(ctx, b, *ops)
	if err != nil {
		return err
	}
	var acq, peerAcq time.Duration
	if b.peer != nil {
		acq, peerAcq, err = acquireReleasePair(ctx, b, *ops/5+1)
	} else {
		acq, err = acquireRelease(ctx, b, *ops/5+1)
	}
	if err != nil {
		return err
	}
	var (
		incr, floor, peerIncr time.Duration
		sent                  int64
	)
	for r := 0; r < *rounds; r++ {
		// Alternate which goes first, so that drift hits both alike.
		for k := 0; k < 2; k++ {
			if (r+k)%2 == 0 {
				var (
					n    int
					took time.Duration
					err  error
				)
				if *processes > 1 {
					var m int64
					n, took, m, err = processIncrements(ctx, b, *bc, "bench-balance", *processes, *workers, *each)
					sent += m
				} else {
					n, took, err = lockedIncrements(ctx, b, "bench-balance", *workers, *each)
				}
				if err != nil {
					return err
				}
				if n != *workers**each {
					return fmt.Errorf("locked increments ended at %d, want %d: lost updates", n, *workers**each)
				}
				incr += took
			} else if b.redis != nil {
				d, err := pingFloor(ctx, b.redis, *workers**each)
				if err != nil {
					return err
				}
				floor += d
			} else if b.peer != nil {
				// The peer's workers in this process, a session each (a
				// session lock is the connection's, so it cannot be shared
				// across processes the way fencekit's Acquirers are).
				n, took, err := peerIncrements(ctx, b, "bench-peer", *workers, *each)
				if err != nil {
					return fmt.Errorf("peer-locked increments: %w", err)
				}
				if n != *workers**each {
					return fmt.Errorf("peer-locked increments ended at %d, want %d: lost updates", n, *workers**each)
				}
				peerIncr += took
			}
		}
	}
	incrPer := incr / time.Duration(*rounds**workers**each)

	fmt.Fprintf(stdout, "fence bench on %s\n\n", b.name)
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "measurement\tper op\tratio to the plain write\n")
	fmt.Fprintf(tw, "plain write of the same size (baseline)\t%v\t1.00\n", plain.Round(100*time.Nanosecond))
	fmt.Fprintf(tw, "fenced write\t%v\t%.2f\n", fenced.Round(100*time.Nanosecond), float64(fenced)/float64(plain))
	fmt.Fprintf(tw, "acquire + release, uncontended\t%v\t%.2f\n", acq.Round(100*time.Nanosecond), float64(acq)/float64(plain))
	fmt.Fprintf(tw, "locked increment, %d workers\t%v\t%.2f\n", *workers, incrPer.Round(100*time.Nanosecond), float64(incrPer)/float64(plain))
	tw.Flush()
	where := ""
	if *processes > 1 {
		where = fmt.Sprintf(" in %d processes", *processes)
	}
	fmt.Fprintf(stdout, "\n%d workers%s x %d locked increments -> %d each time, %.3fs on average over %d rounds\n",
		*workers, where, *each, *workers**each, (incr / time.Duration(*rounds)).Seconds(), *rounds)
	if b.peer != nil {
		fmt.Fprintf(stdout, "against the server's own lock (%s on a session of its own: no token, no ttl), in the same run:\n", b.peer.name)
		fmt.Fprintf(stdout, "  uncontended lock + unlock: %v; acquire + release took %.2fx that\n", peerAcq.Round(100*time.Nanosecond), float64(acq)/float64(peerAcq))
		fmt.Fprintf(stdout, "  %d workers x %d increments under its lock (the same read and write, a session per worker, in this process): %.3fs on average; the locked increments above took %.2fx that\n",
			*workers, *each, (peerIncr / time.Duration(*rounds)).Seconds(), float64(incr)/float64(peerIncr))
	}
	if *processes > 1 && b.redis != nil {
		fmt.Fprintf(stdout, "Redis commands sent per increment (a script counts once; the workload's GET and SET are 2): %.2f\n",
			float64(sent)/float64(*rounds**workers**each))
	}
	if b.redis != nil {
		fmt.Fprintf(stdout, "round-trip floor (4 PINGs per increment, sequential, alternating with the runs): %.3fs; the increments took %.2fx the floor\n",
			(floor / time.Duration(*rounds)).Seconds(), float64(incr)/float64(floor))
		return luaExercise(ctx, stdout, b, *workers, *exerciseEach)
	}
	return nil
}

// writePair interleaves n fenced and n plain writes of the same size in random
// order and returns the mean time of each.
func writePair(ctx context.Context, b *backend, n int) (fenced, plain time.Duration, err error) {
	key := fmt.Sprintf("bench-%d", time.Now().UnixNano())
	value := []byte(strings.Repeat("v", 64))
	tok := fence.Token(1)
	if err := b.fenced.Write(ctx, key, value, tok); err != nil {
		return 0, 0, err
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < n; i++ {
		fencedFirst := rng.IntN(2) == 0
		for k := 0; k < 2; k++ {
			value[0] = byte(2*i + k) // by position, not by role
			start := time.Now()
			if fencedFirst == (k == 0) {
				tok++
				err = b.fenced.Write(ctx, key, value, tok)
				fenced += time.Since(start)
			} else {
				err = b.plainPut(ctx, key, value)
				plain += time.Since(start)
			}
			if err != nil {
				return 0, 0, err
			}
		}
	}
	return fenced / time.Duration(n), plain / time.Duration(n), nil
}

func acquireRelease(ctx context.Context, b *backend, n int) (time.Duration, error) {
	name := fmt.Sprintf("bench-lock-%d", time.Now().UnixNano())
	start := time.Now()
	for i := 0; i < n; i++ {
		l, err := b.acq.TryAcquire(ctx, name, 10*time.Second)
		if err != nil {
			return 0, err
		}
		if err := l.Release(ctx); err != nil {
			return 0, err
		}
	}
	return time.Since(start) / time.Duration(n), nil
}

// pingFloor is the time of 4 sequential PINGs per increment.
func pingFloor(ctx context.Context, c *redis.Client, increments int) (time.Duration, error) {
	start := time.Now()
	for i := 0; i < 4*increments; i++ {
		if err := c.Ping(ctx).Err(); err != nil {
			return 0, err
		}
	}
	return time.Since(start), nil
}

// luaExercise is the lesson's exercise: workers x each updates of a counter,
// with a lock around a read-modify-write against one Lua script doing the same.
func luaExercise(ctx context.Context, out io.Writer, b *backend, workers, each int) error {
	n, lockTook, err := lockedIncrements(ctx, b, "bench-exercise", workers, each)
	if err != nil {
		return err
	}
	if n != workers*each {
		return fmt.Errorf("locked updates ended at %d, want %d", n, workers*each)
	}
	key := fmt.Sprintf("fence-demo:bench-lua-%d", time.Now().UnixNano())
	incr := redis.NewScript(`local v = tonumber(redis.call('GET', KEYS[1]) or '0') + 1
redis.call('SET', KEYS[1], v)
return v`)
	luaTook, err := parallel(workers, each, func() error { return incr.Run(ctx, b.redis, []string{key}).Err() })
	if err != nil {
		return err
	}
	final, err := b.redis.Get(ctx, key).Int()
	if err != nil {
		return err
	}
	if final != workers*each {
		return fmt.Errorf("the Lua updates ended at %d, want %d", final, workers*each)
	}
	fmt.Fprintf(out, "exercise, %d workers x %d updates: locked read-modify-write %.2fs, one Lua script %.2fs: the lock costs %.1fx\n",
		workers, each, lockTook.Seconds(), luaTook.Seconds(), float64(lockTook)/float64(luaTook))
	return nil
}
