package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/redis/go-redis/v9"
)

func runBench(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("fence bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var bc backendConfig
	bc.register(fs)
	ops := fs.Int("n", 2000, "operations per round of each write measurement")
	rounds := fs.Int("rounds", 5, "rounds, alternating fenced and plain; the median round counts")
	workers := fs.Int("workers", 20, "workers in the contention run")
	each := fs.Int("each", 50, "locked increments per worker in the contention run")
	exerciseEach := fs.Int("exercise-each", 500, "updates per worker in the Redis lock-versus-Lua exercise")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: fence bench [flags]\n\n"+
			"Measures, in one run on one backend: a fenced write against a plain write of\n"+
			"the same row (the ratio is what counts, not the absolute figures), an\n"+
			"uncontended acquire + release, and the lesson's locked increments. On Redis\n"+
			"also the increments against the round-trip floor (PING) and the lesson's\n"+
			"exercise: a lock around a read-modify-write against one Lua script.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *ops < 1 || *rounds < 1 || *workers < 1 || *each < 1 || *exerciseEach < 1 {
		return fmt.Errorf("%w: -n, -rounds, -workers, -each and -exercise-each must be at least 1", errUsage)
	}
	ctx := context.Background()
	b, err := openBackend(ctx, bc)
	if err != nil {
		return err
	}
	defer b.close()

	key := fmt.Sprintf("bench-%d", time.Now().UnixNano())
	value := []byte(strings.Repeat("v", 64))
	if err := b.plainPut(ctx, key, value); err != nil {
		return err
	}
	if err := b.fenced.Write(ctx, key, value, 1); err != nil {
		return err
	}
	tok := fence.Token(1)
	var fencedRounds, plainRounds []time.Duration
	for r := 0; r < *rounds; r++ {
		start := time.Now()
		for i := 0; i < *ops; i++ {
			tok++
			value[0] = byte(i)
			if err := b.fenced.Write(ctx, key, value, tok); err != nil {
				return err
			}
		}
		fencedRounds = append(fencedRounds, time.Since(start)/time.Duration(*ops))
		start = time.Now()
		for i := 0; i < *ops; i++ {
			value[0] = byte(i)
			if err := b.plainPut(ctx, key, value); err != nil {
				return err
			}
		}
		plainRounds = append(plainRounds, time.Since(start)/time.Duration(*ops))
	}
	fw, pw := median(fencedRounds), median(plainRounds)

	var acq []time.Duration
	for r := 0; r < *rounds; r++ {
		start := time.Now()
		for i := 0; i < *ops; i++ {
			l, err := b.acq.TryAcquire(ctx, key, 10*time.Second)
			if err != nil {
				return err
			}
			if err := l.Release(ctx); err != nil {
				return err
			}
		}
		acq = append(acq, time.Since(start)/time.Duration(*ops))
	}

	n, took, err := lockedIncrements(ctx, b, "bench-balance", *workers, *each)
	if err != nil {
		return err
	}
	if n != *workers**each {
		return fmt.Errorf("locked increments ended at %d, want %d: lost updates", n, *workers**each)
	}

	fmt.Fprintf(stdout, "fence bench on %s (median of %d rounds x %d ops)\n\n", b.name, *rounds, *ops)
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "measurement\tper op\tratio\n")
	fmt.Fprintf(tw, "plain write (baseline)\t%v\t1.00\n", pw.Round(100*time.Nanosecond))
	fmt.Fprintf(tw, "fenced write\t%v\t%.2f\n", fw.Round(100*time.Nanosecond), float64(fw)/float64(pw))
	fmt.Fprintf(tw, "acquire + release, uncontended\t%v\t%.2f\n", median(acq).Round(100*time.Nanosecond), float64(median(acq))/float64(pw))
	fmt.Fprintf(tw, "locked increment, %d workers\t%v\t%.2f\n", *workers, (took / time.Duration(n)).Round(100*time.Nanosecond), float64(took/time.Duration(n))/float64(pw))
	tw.Flush()
	fmt.Fprintf(stdout, "\n%d workers x %d locked increments -> %d in %.2fs\n", *workers, *each, n, took.Seconds())
	if b.redis != nil {
		return redisBench(ctx, stdout, b, *workers, *each, took, *exerciseEach)
	}
	return nil
}

// redisBench adds the Redis-only figures: the locked increments against the
// round-trip floor, and the lesson's exercise (a lock around a read-modify-write
// against one Lua script doing the same update).
func redisBench(ctx context.Context, out io.Writer, b *backend, workers, each int, took time.Duration, exerciseEach int) error {
	var pings []time.Duration
	for i := 0; i < 2000; i++ {
		start := time.Now()
		if err := b.redis.Ping(ctx).Err(); err != nil {
			return err
		}
		pings = append(pings, time.Since(start))
	}
	rtt := median(pings)
	floor := time.Duration(workers*each*4) * rtt
	fmt.Fprintf(out, "round trip (PING, median of 2000): %v; floor for %d increments at 4 round trips each: %.3fs; locked increments took %.2fx the floor\n",
		rtt.Round(100*time.Nanosecond), workers*each, floor.Seconds(), float64(took)/float64(floor))

	n, lockTook, err := lockedIncrements(ctx, b, "bench-exercise", workers, exerciseEach)
	if err != nil {
		return err
	}
	if n != workers*exerciseEach {
		return fmt.Errorf("locked updates ended at %d, want %d", n, workers*exerciseEach)
	}
	key := fmt.Sprintf("fence-demo:bench-lua-%d", time.Now().UnixNano())
	incr := redis.NewScript(`local v = tonumber(redis.call('GET', KEYS[1]) or '0') + 1
redis.call('SET', KEYS[1], v)
return v`)
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < exerciseEach; i++ {
				if err := incr.Run(ctx, b.redis, []string{key}).Err(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	luaTook := time.Since(start)
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	final, err := b.redis.Get(ctx, key).Int()
	if err != nil {
		return err
	}
	if final != workers*exerciseEach {
		return fmt.Errorf("Lua updates ended at %d, want %d", final, workers*exerciseEach)
	}
	fmt.Fprintf(out, "exercise, %d workers x %d updates: locked read-modify-write %.2fs, one Lua script %.2fs: the lock costs %.1fx\n",
		workers, exerciseEach, lockTook.Seconds(), luaTook.Seconds(), float64(lockTook)/float64(luaTook))
	return nil
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}
