package redislua_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// namePairs are names that a conversion on the way (case folding, trailing
// space, a 4-byte character turned into '?', Unicode normalisation, a
// truncation) would make one. Each gets a fresh random prefix.
func namePairs() [][2]string {
	long := strings.Repeat("n", 1023)
	return [][2]string{
		{"a", "a "}, {"a", "A"}, {"x😀", "x????"}, {"\u00e9", "e\u0301"}, {"ss", "\u00df"},
		{"a\tb", "a b"}, {long + "a", long + "b"},
	}
}

// checkNamesApart holds and renews one name of each pair while the other is
// granted, renewed and released, and writes keys so named at different
// tokens: every step must see two locks and two keys.
func checkNamesApart(t *testing.T, c redis.UniversalClient) {
	ctx := context.Background()
	a := newAcquirerOn(t, c, nil)
	w := newWriterOn(t, c, nil)
	for _, p := range namePairs() {
		pre := fencetest.Name("names") + ":"
		n1, n2 := pre+p[0], pre+p[1]
		l1, err := a.TryAcquire(ctx, n1, time.Minute)
		if err != nil {
			t.Fatalf("%q: %v", n1, err)
		}
		l2, err := a.TryAcquire(ctx, n2, time.Minute)
		if err != nil {
			t.Fatalf("%q while %q is held: %v, want a separate lock", n2, n1, err)
		}
		if err := l2.Renew(ctx); err != nil {
			t.Fatalf("renew %q: %v", n2, err)
		}
		if err := l2.Release(ctx); err != nil {
			t.Fatalf("release %q: %v", n2, err)
		}
		if err := l1.Renew(ctx); err != nil {
			t.Fatalf("renew %q after %q was released: %v", n1, n2, err)
		}
		if _, err := a.TryAcquire(ctx, n1, time.Minute); !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("%q after %q was released: %v, want ErrHeld", n1, n2, err)
		}
		l1.Release(ctx)
		if err := w.Write(ctx, n1, []byte("one"), 9); err != nil {
			t.Fatal(err)
		}
		if err := w.Write(ctx, n2, []byte("two"), 1); err != nil {
			t.Fatalf("write %q at token 1 after %q at 9: %v, want a separate key", n2, n1, err)
		}
		if v, tok, err := w.Read(ctx, n1); err != nil || string(v) != "one" || tok != 9 {
			t.Fatalf("read %q: %q %d %v", n1, v, tok, err)
		}
	}
}

func TestNamesApart(t *testing.T) { checkNamesApart(t, testenv.RedisClient(t)) }

func TestClusterNamesApart(t *testing.T) {
	checkNamesApart(t, testenv.StartRedisCluster(t, 3).Client(t))
}

// TestWriterIdempotencyKeysApart (two names one row): with the
// default prefix, the Writer's key "idem:k" and the idempotency store's key
// "k" must not share a Redis key, or a Begin on "k" wipes the Writer's fence
// and a stale write is accepted.
func TestWriterIdempotencyKeysApart(t *testing.T) {
	ctx := context.Background()
	c := testenv.RedisClient(t)
	w := newWriterOn(t, c, nil)
	s := newStoreOn(t, c, nil)
	k := fencetest.Name("apart")
	wkey := "idem:" + k
	err := w.Write(ctx, wkey, []byte("new"), 10)
	if errors.Is(err, fence.ErrInvalid) {
		return // refused: the two key spaces cannot meet
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Begin(ctx, k, "fp", "o", time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, wkey, []byte("stale"), 5); !errors.Is(err, fence.ErrStale) {
		v, tok, _ := w.Read(ctx, wkey)
		t.Fatalf("token 5 after token 10 and an idempotency Begin on %q: %v (key holds %q at %d), want ErrStale", k, err, v, tok)
	}
}

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
	w := newWriterOn(f, c, &redislua.WriterOptions{Prefix: prefix})
	a := newAcquirerOn(f, c, &redislua.AcquirerOptions{Prefix: prefix})
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
