package redislua_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/testenv"
)

// BenchmarkWrite compares a fenced Lua write (subject) with a plain SET of the
// same value size (baseline), interleaved in one run. Target: <= 1.3.
func BenchmarkWrite(b *testing.B) {
	c := testenv.RedisClient(b)
	w, err := redislua.NewWriter(c, nil)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	key := fencetest.Name("bench")
	value := []byte("a value of a typical small size, 64 bytes long.................")
	tok := fence.Token(0)
	benchutil.Pair(b, func(i int) error {
		tok++
		value[0] = byte(i)
		return w.Write(ctx, key, value, tok)
	}, func(i int) error {
		value[0] = byte(i)
		return c.Set(ctx, key+"-plain", value, 0).Err()
	})
}

// BenchmarkAcquireRelease measures an uncontended TryAcquire + Release (subject)
// against two PINGs (baseline, the two round trips it needs), interleaved.
func BenchmarkAcquireRelease(b *testing.B) {
	c := testenv.RedisClient(b)
	a, err := redislua.NewAcquirer(c, nil)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	name := fencetest.Name("bench")
	benchutil.Pair(b, func(int) error {
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			return err
		}
		return l.Release(ctx)
	}, func(int) error {
		if err := c.Ping(ctx).Err(); err != nil {
			return err
		}
		return c.Ping(ctx).Err()
	})
}

// BenchmarkHandoff measures the time from the start of a holder's Release to the
// grant of an Acquire already waiting (woken by pub/sub, or polling alone), and
// reports p50 and p90 next to the PING round trip measured in the same run.
func BenchmarkHandoff(b *testing.B) {
	c := testenv.RedisClient(b)
	ctx := context.Background()
	for _, mode := range []string{"notify", "poll"} {
		b.Run(mode, func(b *testing.B) {
			a, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{DisableNotify: mode == "poll"})
			if err != nil {
				b.Fatal(err)
			}
			name := fencetest.Name("handoff")
			var handoffs, pings []time.Duration
			for i := 0; i < b.N; i++ {
				holder, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					b.Fatal(err)
				}
				granted := make(chan time.Time, 1)
				go func() {
					l, err := a.Acquire(ctx, name, time.Minute)
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
				p := time.Now()
				if err := c.Ping(ctx).Err(); err != nil {
					b.Fatal(err)
				}
				pings = append(pings, time.Since(p))
				start := time.Now()
				if err := holder.Release(ctx); err != nil {
					b.Fatal(err)
				}
				at := <-granted
				if at.IsZero() {
					b.FailNow()
				}
				handoffs = append(handoffs, at.Sub(start))
			}
			slices.Sort(handoffs)
			slices.Sort(pings)
			b.ReportMetric(float64(handoffs[len(handoffs)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(handoffs[len(handoffs)*9/10].Microseconds()), "p90-µs")
			b.ReportMetric(float64(pings[len(pings)/2].Microseconds()), "ping-µs")
		})
	}
}
