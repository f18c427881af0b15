package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/fencekit/fencekit/fence"
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
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: fence bench [flags]\n\n"+
			"Measures, in one run on one backend: a fenced write against a plain write of\n"+
			"the same row (the ratio is what counts, not the absolute figures), an\n"+
			"uncontended acquire + release, and the lesson's locked increments.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *ops < 1 || *rounds < 1 || *workers < 1 || *each < 1 {
		return fmt.Errorf("%w: -n, -rounds, -workers and -each must be at least 1", errUsage)
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
	return nil
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}
