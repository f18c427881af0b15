package redislua_test

import (
	"context"
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

// BenchmarkHandoff measures the time from the start of a holder's Release to
// the grant of an Acquire already waiting in the same process (handed over in
// the releasing script, or woken by pub/sub, or polling alone): p50 and p90.
func BenchmarkHandoff(b *testing.B) {
	c := testenv.RedisClient(b)
	for _, mode := range []string{"notify", "poll"} {
		b.Run(mode, func(b *testing.B) {
			a, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{DisableNotify: mode == "poll"})
			if err != nil {
				b.Fatal(err)
			}
			benchutil.Handoff(b, a, a, fencetest.Name("handoff"))
		})
	}
}
