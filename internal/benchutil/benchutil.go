// Package benchutil holds what the benchmarks share.
package benchutil

import (
	"context"
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"strings"
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
// to the grant of an Acquire that was already waiting, and reports the p50 and
// p90 in microseconds. holder and waiter may be one acquirer (a waiter in the
// same process) or two (as two processes would see it).
//
// "Already waiting" is an event, not a pause: the release starts only once
// the waiter's Acquire is parked in its wait (see waiting), after the backend
// refused it, and then 0-19ms later (i%20); until then the measurement would
// time a fresh grant after a plain release. A waiter granted before the
// release started fails the benchmark.
func Handoff(b *testing.B, holder, waiter fence.Acquirer, name string) {
	ctx := context.Background()
	pkg := acquirerPackage(waiter)
	handoffs := make([]time.Duration, 0, b.N)
	for i := 0; i < b.N; i++ {
		h, err := holder.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		granted := make(chan time.Time, 1)
		go handoffWaiter(b, ctx, waiter, name, granted)
		if err := waiting(pkg, granted); err != nil {
			b.Fatal(err)
		}
		// The workload's shape, not synchronisation: waiters that have
		// waited 0-19ms, so that a polling waiter's backoff has grown as
		// it would.
		time.Sleep(time.Duration(i%20) * time.Millisecond)
		start := time.Now()
		if err := h.Release(ctx); err != nil {
			b.Fatal(err)
		}
		at := <-granted
		if at.IsZero() {
			b.FailNow()
		}
		if at.Before(start) {
			b.Fatalf("the waiter was granted %v before the holder's release started", start.Sub(at))
		}
		handoffs = append(handoffs, at.Sub(start))
	}
	slices.Sort(handoffs)
	b.ReportMetric(float64(handoffs[len(handoffs)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(handoffs[len(handoffs)*9/10].Microseconds()), "p90-µs")
}

// handoffWaiter is the waiter of Handoff: its name marks the goroutine that
// waiting looks for.
func handoffWaiter(b *testing.B, ctx context.Context, waiter fence.Acquirer, name string, granted chan<- time.Time) {
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
}

// waitingLimit bounds how long waiting looks for the waiter's wait; only a
// waiter that never waits (a bug) reaches it.
const waitingLimit = 30 * time.Second

// waiting returns once the goroutine running handoffWaiter is parked (in a
// select or a channel receive) in code of the acquirer's package pkg or of
// package fence (fence.Backoff's loop): the waiter's first attempt was refused
// and it now waits for a wake-up (a release notification, a grant in the
// Redis line, an etcd watch, the next poll). A goroutine inside a request is
// parked in the client's or the network's code instead (pgx, go-redis, gRPC,
// net), and one not yet started has no such frame: neither counts. It fails
// when the waiter ended first (granted: the lock was not held) or after
// waitingLimit.
func waiting(pkg string, granted <-chan time.Time) error {
	buf := make([]byte, 1<<20)
	limit := time.Now().Add(waitingLimit)
	for {
		select {
		case at := <-granted:
			return fmt.Errorf("the waiter ended (at %v) before it waited: the holder's lease did not keep it out", at)
		default:
		}
		n := runtime.Stack(buf, true)
		for n == len(buf) {
			buf = make([]byte, 2*len(buf))
			n = runtime.Stack(buf, true)
		}
		if parkedIn(string(buf[:n]), pkg) {
			return nil
		}
		if time.Now().After(limit) {
			return fmt.Errorf("the waiter was not seen waiting within %v", waitingLimit)
		}
		time.Sleep(100 * time.Microsecond) // poll pace
	}
}

// parkedIn reports whether the handoffWaiter goroutine in the stack dump is
// parked in a select or a channel receive whose innermost frame outside the
// runtime is in package pkg, package fence, fence/leasekit (leasekit.Retry,
// the waiting loop adapters share) or internal/wakeup (the line of waiters).
func parkedIn(dump, pkg string) bool {
	for _, g := range strings.Split(dump, "\n\n") {
		if !strings.Contains(g, "benchutil.handoffWaiter(") {
			continue
		}
		header, frames, _ := strings.Cut(g, "\n")
		if !strings.Contains(header, "[select") && !strings.Contains(header, "[chan receive") {
			return false
		}
		for _, line := range strings.Split(frames, "\n") {
			if line == "" || strings.HasPrefix(line, "\t") || strings.HasPrefix(line, "runtime.") {
				continue
			}
			return strings.HasPrefix(line, pkg+".") || strings.HasPrefix(line, fencePkg+".") || strings.HasPrefix(line, fencePkg+"/leasekit.") || strings.HasPrefix(line, wakeupPkg+".")
		}
	}
	return false
}

var fencePkg = reflect.TypeFor[fence.Backoff]().PkgPath()

// wakeupPkg is internal/wakeup, whose Line the waiting Acquire calls of
// several acquirers (sqlfence's among them) park in between attempts.
var wakeupPkg = strings.TrimSuffix(fencePkg, "/fence") + "/internal/wakeup"

// acquirerPackage returns the import path of a's concrete type.
func acquirerPackage(a fence.Acquirer) string {
	t := reflect.TypeOf(a)
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t.PkgPath()
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
