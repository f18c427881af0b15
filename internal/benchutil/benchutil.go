// Package benchutil holds what the benchmarks share.
package benchutil

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// Pair interleaves two operations, one of each per iteration in random order, so
// that drift in the machine (disk flushes, autovacuum, the other core's load)
// hits both alike; it reports each one's time per op (subject-ns/op,
// baseline-ns/op) and their ratio (subject/baseline). The argument of each call
// is its position in the sequence, never its role: tying a value to a role (even
// values to one, odd to the other) was tried and biased SQLite by 10-15% even for
// two identical operations. Two identical operations measure within a few
// percent of 1.00 this way; run with -count and take the median.
func Pair(b *testing.B, subject, baseline func(i int) error) {
	var ts, tb time.Duration
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < b.N; i++ {
		subjectFirst := rng.IntN(2) == 0
		for k := 0; k < 2; k++ {
			op, acc := baseline, &tb
			if subjectFirst == (k == 0) {
				op, acc = subject, &ts
			}
			start := time.Now()
			if err := op(2*i + k); err != nil {
				b.Fatal(err)
			}
			*acc += time.Since(start)
		}
	}
	b.ReportMetric(float64(ts.Nanoseconds())/float64(b.N), "subject-ns/op")
	b.ReportMetric(float64(tb.Nanoseconds())/float64(b.N), "baseline-ns/op")
	b.ReportMetric(float64(ts)/float64(tb), "subject/baseline")
}

// Handoff measures, b.N times, the time from the start of a holder's Release
// to the grant of an Acquire that was already waiting (for 5-25ms), and reports
// the p50 and p90 in microseconds. holder and waiter may be one acquirer (a
// waiter in the same process) or two (as two processes would see it).
func Handoff(b *testing.B, holder, waiter fence.Acquirer, name string) {
	ctx := context.Background()
	handoffs := make([]time.Duration, 0, b.N)
	for i := 0; i < b.N; i++ {
		h, err := holder.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		granted := make(chan time.Time, 1)
		go func() {
			l, err := waiter.Acquire(ctx, name, time.Minute)
			if err != nil {
				b.Error(err)
				granted <- time.Time{}
				return
			}
			at := time.Now()
			if err := l.Release(ctx); err != nil {
				b.Error(err)
			}
			granted <- at
		}()
		time.Sleep(5*time.Millisecond + time.Duration(i%20)*time.Millisecond)
		start := time.Now()
		if err := h.Release(ctx); err != nil {
			b.Fatal(err)
		}
		at := <-granted
		if at.IsZero() {
			b.FailNow()
		}
		handoffs = append(handoffs, at.Sub(start))
	}
	slices.Sort(handoffs)
	b.ReportMetric(float64(handoffs[len(handoffs)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(handoffs[len(handoffs)*9/10].Microseconds()), "p90-µs")
}

// AcquireRelease measures an uncontended TryAcquire + Release of name with a
// (sub-benchmark "acquire+release") next to one round trip to the same
// backend (sub-benchmark "round-trip"), the unit its cost is counted in.
func AcquireRelease(b *testing.B, a fence.Acquirer, roundTrip func(ctx context.Context) error) {
	ctx := context.Background()
	name := "bench-acquire-release-" + time.Now().Format("150405.000000")
	b.Run("acquire+release", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				b.Fatal(err)
			}
			if err := l.Release(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("round-trip", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if err := roundTrip(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
}
