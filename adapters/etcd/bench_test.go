package etcdfence_test

import (
	"context"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/etcdtest"
	"github.com/fencekit/fencekit/internal/testenv"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// acquirers returns two acquirers each (two processes' views) on an embedded
// single-node etcd and on Redis, to be measured side by side in one run, and
// the etcd client.
func acquirers(b *testing.B) (map[string][2]fence.Acquirer, *clientv3.Client) {
	c := etcdtest.Start(b, 1)
	ec, rc := c.Client(b), testenv.RedisClient(b)
	out := map[string][2]fence.Acquirer{}
	for i := 0; i < 2; i++ {
		e, err := etcdfence.NewAcquirer(ec, nil)
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
	return out, ec
}

// BenchmarkAcquireRelease: an uncontended TryAcquire + Release on an embedded
// etcd and on Redis; etcd-vs-mutex compares it with concurrency.Mutex in the
// same run (acquireReleaseVsMutex).
func BenchmarkAcquireRelease(b *testing.B) {
	ctx := context.Background()
	all, ec := acquirers(b)
	b.Run("etcd-vs-mutex", func(b *testing.B) { acquireReleaseVsMutex(b, ec) })
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
	all, _ := acquirers(b)
	for _, kind := range []string{"etcd", "redis"} {
		b.Run(kind, func(b *testing.B) {
			benchutil.Handoff(b, all[kind][0], all[kind][1], fencetest.Name("handoff"))
		})
	}
}
