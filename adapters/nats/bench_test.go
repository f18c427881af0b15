package natsfence_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/etcdtest"
)

// benchAcquirers returns two acquirers each (two processes' views, each on a
// client of its own) on the package's NATS server (single node, file store)
// and on an embedded single-node etcd, to be measured side by side in one run.
func benchAcquirers(b *testing.B) map[string][2]fence.Acquirer {
	c := etcdtest.Start(b, 1)
	out := map[string][2]fence.Acquirer{}
	var n, e [2]fence.Acquirer
	for i := range 2 {
		n[i] = newAcquirer(b, js(b), lockBucket, nil)
		a, err := etcdfence.NewAcquirer(c.Client(b), nil)
		if err != nil {
			b.Fatal(err)
		}
		e[i] = a
	}
	out["nats"], out["etcd"] = n, e
	return out
}

func acquireRelease(a fence.Acquirer, name string) error {
	ctx := context.Background()
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		return err
	}
	return l.Release(ctx)
}

// BenchmarkAcquireReleaseVsEtcd: an uncontended TryAcquire + Release on NATS
// (subject) and on etcd (baseline), interleaved in one run so that machine
// drift hits both alike.
func BenchmarkAcquireReleaseVsEtcd(b *testing.B) {
	all := benchAcquirers(b)
	nn, en := fencetest.Name("bench"), fencetest.Name("bench")
	benchutil.Pair(b,
		func(int) error { return acquireRelease(all["nats"][0], nn) },
		func(int) error { return acquireRelease(all["etcd"][0], en) })
}

// BenchmarkHandoffVsEtcd: from the start of a holder's Release to the grant of
// an Acquire waiting in another acquirer: NATS (KV watch on the lock key) and
// etcd (watch on the predecessor key), p50 and p90.
func BenchmarkHandoffVsEtcd(b *testing.B) {
	all := benchAcquirers(b)
	for _, kind := range []string{"nats", "etcd"} {
		b.Run(kind, func(b *testing.B) {
			benchutil.Handoff(b, all[kind][0], all[kind][1], fencetest.Name("handoff"))
		})
	}
}

// BenchmarkStoreDoVsPut: idempotency.Do on the NATS store, against a plain
// KV put of the same size on the same server (baseline, one round trip),
// interleaved in one run: "fresh" a new key each time (claim, arm, complete),
// "replay" a key already completed.
func BenchmarkStoreDoVsPut(b *testing.B) {
	j := js(b)
	cfg := idemBucket(b)
	s := newStore(b, j, cfg)
	kv, err := j.KeyValue(context.Background(), cfg.Bucket)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	effect := func(context.Context, string) ([]byte, error) { return []byte("charged"), nil }
	put := func(i int) error {
		_, err := kv.Put(ctx, "plain"+strconv.Itoa(i), []byte("charged"))
		return err
	}
	b.Run("fresh", func(b *testing.B) {
		benchutil.Pair(b, func(int) error {
			_, err := idempotency.Do(ctx, s, fencetest.Name("do"), "fp", effect, nil)
			return err
		}, put)
	})
	b.Run("replay", func(b *testing.B) {
		k := fencetest.Name("replay")
		if _, err := idempotency.Do(ctx, s, k, "fp", effect, nil); err != nil {
			b.Fatal(err)
		}
		benchutil.Pair(b, func(int) error {
			r, err := idempotency.Do(ctx, s, k, "fp", effect, nil)
			if err == nil && !r.Replayed {
				b.Fatal("not replayed")
			}
			return err
		}, put)
	})
}

// BenchmarkRenew: a held lease's Renew on NATS (subject), against a plain KV
// put of the same entry on the same server (baseline, one round trip),
// interleaved in one run.
func BenchmarkRenew(b *testing.B) {
	j := js(b)
	a := newAcquirer(b, j, lockBucket, nil)
	ctx := context.Background()
	l, err := a.TryAcquire(ctx, fencetest.Name("renew"), time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Release(ctx)
	kv, err := j.KeyValue(ctx, lockBucket.Bucket)
	if err != nil {
		b.Fatal(err)
	}
	plain := fencetest.Name("plain")
	value := []byte("0123456789abcdef0123456789abcdef host/1234")
	benchutil.Pair(b,
		func(int) error { return l.Renew(ctx) },
		func(int) error { _, err := kv.Put(ctx, natsfence.EncodeKey(plain), value); return err })
}
