package redislua_test

import (
	"bytes"
	"context"
	"errors"
	"math"
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
	model := map[string]fence.Token{}
	f.Fuzz(func(t *testing.T, key, name string, ttlNs int64, token uint64, value []byte) {
		ctx := context.Background()
		tok := fence.Token(token)
		err := w.Write(ctx, key, value, tok)
		switch {
		case err == nil:
			if tok < model[key] {
				t.Fatalf("Write(%q, token %d) accepted below the key's %d", key, tok, model[key])
			}
			model[key] = tok
			got, gotTok, err := w.Read(ctx, key)
			if err != nil || !bytes.Equal(got, value) || gotTok != tok {
				t.Fatalf("Read(%q) after a write = %q, %d, %v; want %q, %d", key, got, gotTok, err, value, tok)
			}
		case errors.Is(err, fence.ErrStale):
			if tok >= model[key] {
				t.Fatalf("Write(%q, token %d) stale although the key holds %d: %v", key, tok, model[key], err)
			}
		case errors.Is(err, fence.ErrInvalid):
		default:
			t.Fatalf("Write(%q, %d): undocumented error %v", key, tok, err)
		}

		ttl := time.Duration(ttlNs)
		l, err := a.TryAcquire(ctx, name, ttl)
		switch {
		case err == nil:
			if !l.Token().Valid() {
				t.Fatalf("granted invalid token %d", l.Token())
			}
			if ttl >= time.Second {
				if _, err := a.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrHeld) {
					t.Fatalf("TryAcquire(%q) while a %v lease is held: %v", name, ttl, err)
				}
			}
			if err := l.Release(ctx); err != nil && !(ttl < time.Second && errors.Is(err, fence.ErrLost)) {
				t.Fatalf("Release: %v", err)
			}
		case errors.Is(err, fence.ErrInvalid), errors.Is(err, fence.ErrHeld):
		default:
			t.Fatalf("TryAcquire(%q, %d): undocumented error %v", name, ttlNs, err)
		}
	})
}
