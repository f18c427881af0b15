package etcdfence_test

import (
	"context"
	"slices"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/etcdtest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// acquirers returns two acquirers each (two processes' views) on an embedded
// single-node etcd and on Redis, to be measured side by side in one run.
func acquirers(b *testing.B) map[string][2]fence.Acquirer {
	c := etcdtest.Start(b, 1)
	ec, rc := c.Client(b), testenv.RedisClient(b)
	out := map[string][2]fence.Acquirer{}
	for i := 0; i < 2; i++ {
		e, err := etcdfence.New(ec, nil)
		if err != nil {
			b.Fatal(err)
		}
		r, err := redislua.NewAcquirer(rc, nil)
		if err != nil {
			b.Fatal(err)
		}
		es, rs := out["etcd"], out["redis"]
		es[i], rs[i] = e, r
		out["etcd"], out["redis"] = es, rs
	}
	return out
}

// BenchmarkAcquireRelease: an uncontended TryAcquire + Release on an embedded
// etcd and on Redis.
func BenchmarkAcquireRelease(b *testing.B) {
	ctx := context.Background()
	all := acquirers(b)
	for _, kind := range []string{"etcd", "redis"} {
		a := all[kind][0]
		b.Run(kind, func(b *testing.B) {
			name := fencetest.Name("bench")
			for i := 0; i < b.N; i++ {
				l, err := a.TryAcquire(ctx, name, 10*time.Second)
				if err != nil {
					b.Fatal(err)
				}
				if err := l.Release(ctx); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkHandoff: the time from the start of a holder's Release to the grant
// of an Acquire already waiting in another acquirer (another process's view: no
// in-process hand-over), p50 and p90, on etcd and on Redis.
func BenchmarkHandoff(b *testing.B) {
	ctx := context.Background()
	all := acquirers(b)
	for _, kind := range []string{"etcd", "redis"} {
		holders, waiters := all[kind][0], all[kind][1]
		b.Run(kind, func(b *testing.B) {
			name := fencetest.Name("handoff")
			var handoffs []time.Duration
			for i := 0; i < b.N; i++ {
				h, err := holders.TryAcquire(ctx, name, 10*time.Second)
				if err != nil {
					b.Fatal(err)
				}
				granted := make(chan time.Time, 1)
				go func() {
					l, err := waiters.Acquire(ctx, name, 10*time.Second)
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
		})
	}
}
