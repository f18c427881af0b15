package redislua_test

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// FuzzRedisEntryPoints drives the public entry points with arbitrary keys,
// names, ttls, tokens and values on a real Redis. Every call either succeeds
// with the documented outcome or fails with a documented error (ErrInvalid
// before any script runs, ErrStale, ErrHeld): never a panic, never a raw Redis
// error such as "invalid expire time", never a lease that does not exclude.
func FuzzRedisEntryPoints(f *testing.F) {
	f.Add("k", "n", int64(time.Second), uint64(1), []byte("v"))
	f.Add("", "", int64(0), uint64(0), []byte(nil))
	f.Add("nul\x00", "bad\xff", int64(-1), uint64(math.MaxUint64), []byte{0})
	f.Add("k", "n", int64(math.MaxInt64), uint64(fence.MaxToken), []byte("top"))
	f.Add("a{b}", "x}", int64(math.MinInt64), uint64(fence.MaxToken+1), []byte(""))
	f.Add("k", "n", int64(999*time.Microsecond), uint64(2), []byte("x"))
	c := testenv.RedisClient(f)
	prefix := fencetest.Name("fuzz") + ":" // this process's own keys
	w, err := redislua.NewWriter(c, &redislua.WriterOptions{Prefix: prefix})
	if err != nil {
		f.Fatal(err)
	}
	a, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{Prefix: prefix})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() {
		ctx := context.Background()
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			c.Del(ctx, iter.Val())
		}
	})
	e := &fencetest.EntryPoints{Writer: w, Acquirer: a, MinTTL: 3 * time.Millisecond, MaxTTL: redislua.MaxTTL,
		// Redis stores any bytes; braces would be read as a Cluster hash tag;
		// a Writer key "idem:..." would name an IdempotencyStore record.
		Refuses: func(s string) bool { return strings.ContainsAny(s, "{}") || strings.HasPrefix(s, "idem:") }}
	f.Fuzz(func(t *testing.T, key, name string, ttlNs int64, token uint64, value []byte) {
		e.Check(t, key, name, ttlNs, token, value)
	})
}
