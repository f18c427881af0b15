package redislua_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

func TestWriterConformance(t *testing.T) {
	w := newWriterOn(t, testenv.RedisClient(t), nil)
	fencetest.WriterSuite{
		New:     func(t *testing.T) fence.FencedWriter { return w },
		BadKeys: []string{"a{b}", "x}"},
		Faulty:  faultyWriter,
	}.Run(t)
}

func TestAcquirerConformance(t *testing.T) {
	c := testenv.RedisClient(t)
	for _, o := range []struct {
		name string
		opts redislua.AcquirerOptions
	}{
		{"default", redislua.AcquirerOptions{}},
		{"no-notify", redislua.AcquirerOptions{DisableNotify: true}},
		{"counter-tokens", redislua.AcquirerOptions{CounterTokens: true}},
	} {
		t.Run(o.name, func(t *testing.T) {
			a := newAcquirerOn(t, c, &o.opts)
			// With CounterTokens a deleted counter restarts at 1, as that
			// option documents: that mode does not claim to survive it.
			deleteState := deleteNameKeys(c)
			if o.opts.CounterTokens {
				deleteState = nil
			}
			fencetest.AcquirerSuite{Parallel: true, New: func(t *testing.T) fence.Acquirer { return a }, MaxTTL: redislua.MaxTTL, ShortTTL: shortTTL, BadNames: []string{"a{b}", "x}"},
				NewOther:    otherAcquirer(&o.opts),
				Faulty:      faultyAcquirer(&o.opts),
				DeleteState: deleteState,
			}.Run(t)
		})
	}
}

func TestBadInput(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	if _, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{Prefix: "x{"}); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("prefix with a brace: %v", err)
	}
	if _, err := redislua.NewWriter(c, &redislua.WriterOptions{Prefix: "}"}); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("writer prefix with a brace: %v", err)
	}
	a := newAcquirerOn(t, c, nil)
	for _, ttl := range []time.Duration{time.Microsecond, 999 * time.Microsecond} {
		if _, err := a.TryAcquire(ctx, "n", ttl); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("ttl %v: %v, want ErrInvalid", ttl, err)
		}
	}
	if _, err := a.TryAcquire(ctx, "a{b}", time.Second); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("name with braces: %v", err)
	}
	// A counter someone else left behind, not a number.
	name := fencetest.Name("corrupt")
	if err := c.Set(ctx, "fence:{"+name+"}:token", "not-a-number", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	_, err := a.TryAcquire(ctx, name, time.Second)
	var ce *redislua.CorruptError
	if !errors.As(err, &ce) || !strings.Contains(err.Error(), "not a token") || errors.Is(err, fence.ErrHeld) {
		t.Errorf("TryAcquire with a non-numeric counter: %v, want a CorruptError", err)
	}
	if err := c.Exists(ctx, "fence:{"+name+"}:lock").Err(); err != nil {
		t.Fatal(err)
	}
	if n, _ := c.Exists(ctx, "fence:{"+name+"}:lock").Result(); n != 0 {
		t.Error("a refused grant left a lock key behind")
	}
	// A counter at the top refuses to grant.
	name = fencetest.Name("top")
	c.Set(ctx, "fence:{"+name+"}:token", "9007199254740991", time.Minute)
	if _, err := a.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrTokensExhausted) {
		t.Errorf("TryAcquire at MaxToken: %v, want ErrTokensExhausted", err)
	}
}

func TestTokenFloor(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, nil) // the floor is the default
	ctx := context.Background()
	before := uint64(time.Now().Add(-time.Minute).UnixMicro())
	l := mustTryAcquire(ctx, t, a, fencetest.Name("floor"), time.Second)
	defer l.Release(ctx)
	if uint64(l.Token()) < before || !l.Token().Valid() {
		t.Errorf("token %d with the floor, want at least the clock in µs (%d) and valid", l.Token(), before)
	}
}

func TestFencedScript(t *testing.T) { fencedScriptCase(t, testenv.RedisClient(t)) }

// fencedScriptCase runs FencedScript through its cases on c: a plain client or
// a cluster client (the fence key and the body's keys share a hash tag).
func fencedScriptCase(t *testing.T, c redis.UniversalClient) {
	ctx := context.Background()
	tag := fencetest.Name("script")
	fenceKey, balance := "{"+tag+"}:fence", "{"+tag+"}:balance"
	incr := redislua.NewFencedScript(`return redis.call('INCRBY', KEYS[1], ARGV[1])`)
	got, err := incr.Run(ctx, c, fenceKey, 5, []string{balance}, 10)
	if err != nil || got != int64(10) {
		t.Fatalf("Run with token 5: %v, %v", got, err)
	}
	got, err = incr.Run(ctx, c, fenceKey, 5, []string{balance}, 1)
	if err != nil || got != int64(11) {
		t.Fatalf("Run with an equal token: %v, %v", got, err)
	}
	_, err = incr.Run(ctx, c, fenceKey, 4, []string{balance}, 100)
	var se *fence.StaleError
	if !errors.As(err, &se) || se.Current != 5 || se.Offered != 4 {
		t.Fatalf("Run with a lower token: %v, want a StaleError", err)
	}
	if v, _ := c.Get(ctx, balance).Int(); v != 11 {
		t.Errorf("balance %d after a rejected run, want 11: the body ran", v)
	}
	noReturn := redislua.NewFencedScript(`redis.call('SET', KEYS[1], ARGV[1])`)
	if got, err := noReturn.Run(ctx, c, fenceKey, 6, []string{balance}, "x"); err != nil || got != nil {
		t.Errorf("a body without return: %v, %v", got, err)
	}
	if v, _ := c.Get(ctx, fenceKey).Result(); v != "6" {
		t.Errorf("fence = %q after token 6, want 6", v)
	}
	// A body that fails half-way keeps its first write (Redis has no rollback),
	// and that write is fenced at its token: the fence was raised before it.
	failing := redislua.NewFencedScript(`redis.call('SET', KEYS[1], ARGV[1]); error('boom')`)
	if _, err := failing.Run(ctx, c, fenceKey, 7, []string{balance}, "half of token 7"); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Errorf("a failing body: %v, want its error", err)
	}
	if v, _ := c.Get(ctx, fenceKey).Result(); v != "7" {
		t.Errorf("fence = %q after a failing body with token 7, want 7", v)
	}
	if v, _ := c.Get(ctx, balance).Result(); v != "half of token 7" {
		t.Errorf("balance = %q: the failing body's first write is not there", v)
	}
	if _, err := noReturn.Run(ctx, c, fenceKey, 6, []string{balance}, "token 6"); !errors.Is(err, fence.ErrStale) {
		t.Errorf("token 6 after token 7's failed body: %v, want ErrStale", err)
	}
	if _, err := noReturn.Run(ctx, c, fenceKey, 7, []string{balance}, "token 7, finished"); err != nil {
		t.Errorf("token 7 again: %v", err)
	}
	if v, _ := c.Get(ctx, balance).Result(); v != "token 7, finished" {
		t.Errorf("balance = %q, want token 7's", v)
	}
	if _, err := incr.Run(ctx, c, fenceKey, 0, []string{balance}, 1); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("token 0: %v", err)
	}
}

// TestNilClientsAndBadOptions: constructors refuse nil clients (also a nil
// pointer in the interface) and negative options with ErrInvalid.
func TestNilClientsAndBadOptions(t *testing.T) {
	var nilClient *redis.Client
	for what, c := range map[string]redislua.Client{"nil": nil, "nil *redis.Client": nilClient} {
		if _, err := redislua.NewAcquirer(c, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewAcquirer(%s): %v", what, err)
		}
		if _, err := redislua.NewWriter(c, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewWriter(%s): %v", what, err)
		}
		if _, err := redislua.NewIdempotencyStore(c, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewIdempotencyStore(%s): %v", what, err)
		}
		if _, err := redislua.NewRedlock([]redislua.Client{testenv.RedisClient(t), c}, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewRedlock with a %s node: %v", what, err)
		}
		if _, err := redislua.NewFencedScript("return 1").Run(context.Background(), c, "f", 1, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("FencedScript.Run on a %s client: %v", what, err)
		}
	}
	c := testenv.RedisClient(t)
	for _, b := range []fence.Backoff{{Min: -1}, {Max: -time.Second}, {MaxWait: -time.Second}} {
		if _, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{Backoff: b}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewAcquirer with Backoff %+v: %v", b, err)
		}
	}
	if _, err := redislua.NewIdempotencyStore(c, &redislua.IdempotencyOptions{ReleasedRetention: -time.Second}); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("NewIdempotencyStore with a negative ReleasedRetention: %v", err)
	}
	var nilCtx context.Context
	if _, err := redislua.NewFencedScript("return 1").Run(nilCtx, c, "f", 1, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("FencedScript.Run with a nil context: %v", err)
	}
}

// TestKeysAreBytes: Redis keys are binary-safe, so keys and names with NUL
// bytes, invalid UTF-8 or a megabyte of length are stored as they are.
func TestKeysAreBytes(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	w := newWriterOn(t, c, nil)
	a := newAcquirerOn(t, c, nil)
	for _, k := range []string{"nul\x00byte", "bad utf-8 \xff\xfe", strings.Repeat("k", 1<<20)} {
		k += fencetest.Name("")
		if err := w.Write(ctx, k, []byte("v"), 3); err != nil {
			t.Errorf("Write with key %.20q: %v", k, err)
			continue
		}
		v, tok, err := w.Read(ctx, k)
		if err != nil || string(v) != "v" || tok != 3 {
			t.Errorf("Read with key %.20q: %q, %d, %v", k, v, tok, err)
		}
		if err := w.Write(ctx, k, []byte("old"), 2); !errors.Is(err, fence.ErrStale) {
			t.Errorf("a lower token on key %.20q: %v", k, err)
		}
		// A minute's lease: a 1MiB name takes a loaded machine a while to
		// send twice, and the lease must still be held for its Release.
		l, err := a.TryAcquire(ctx, k, time.Minute)
		if err != nil {
			t.Errorf("TryAcquire with name %.20q: %v", k, err)
			continue
		}
		if _, err := a.TryAcquire(ctx, k, time.Second); !errors.Is(err, fence.ErrHeld) {
			t.Errorf("second TryAcquire with name %.20q: %v", k, err)
		}
		if err := l.Release(ctx); err != nil {
			t.Errorf("Release: %v", err)
		}
		c.Del(ctx, w.Key(k))
	}
}

// shortTTL is the suites' lease for cases that renew or wait out a lease: a
// renewal every third of it must land in time under -race on a loaded 2-CPU
// machine, which the suite's default 150ms does not.
const shortTTL = time.Second

// TestDriftOverTTL: a ttl that Drift leaves no local
// validity for is refused (ErrInvalid), not granted as a lease that is
// already lost with a nil error while Redis holds the name for the ttl.
func TestDriftOverTTL(t *testing.T) {
	a := newAcquirerOn(t, testenv.RedisClient(t), &redislua.AcquirerOptions{Drift: time.Second})
	r := newRedlock(t, []redislua.Client{testenv.RedisClient(t)}, &redislua.RedlockOptions{Drift: time.Second})
	t.Run("Acquirer", func(t *testing.T) { fencetest.DriftRefusesShortTTL(t, a, time.Second, "ttl") })
	t.Run("Redlock", func(t *testing.T) { fencetest.DriftRefusesShortTTL(t, r, time.Second, "ttl") })
}

// TestFencedScriptPipeline: Run through a pipeline (the doc allows one)
// must not report a failure for a body that then runs when the pipeline is
// executed.
func TestFencedScriptPipeline(t *testing.T) {
	ctx := context.Background()
	c := testenv.RedisClient(t)
	incr := redislua.NewFencedScript(`return redis.call('INCR', KEYS[1])`)
	tag := fencetest.Name("pipe")
	fenceKey, counter := "{"+tag+"}:fence", "{"+tag+"}:n"
	if _, err := incr.Run(ctx, c, fenceKey, 3, []string{counter}); err != nil { // loads the script
		t.Fatal(err)
	}
	pipe := c.Pipeline()
	_, runErr := incr.Run(ctx, pipe, fenceKey, 3, []string{counter})
	_, execErr := pipe.Exec(ctx)
	n, _ := c.Get(ctx, counter).Int()
	if runErr != nil && n != 1 {
		t.Fatalf("Run through a pipeline: %v, but Exec (%v) ran the body: counter %d, want 1", runErr, execErr, n)
	}
}

func TestInspectAndBump(t *testing.T) {
	ctx := context.Background()
	// Counter tokens, so that the grant after a bump to 1000 is exactly 1001.
	a := newAcquirerOn(t, testenv.RedisClient(t), &redislua.AcquirerOptions{CounterTokens: true})
	name := fencetest.Name("inspect")
	if _, err := a.Inspect(ctx, name); !errors.Is(err, fence.ErrNotFound) {
		t.Errorf("Inspect of an unknown name: %v", err)
	}
	l := mustTryAcquire(ctx, t, a, name, time.Minute)
	info, err := a.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != l.Token() || info.Owner == "" || info.TimeLeft <= 50*time.Second || info.Counter != l.Token() {
		t.Fatalf("Inspect of a held lock: %+v, %v", info, err)
	}
	// A bump while held raises the counter and leaves the holder its lease.
	if err := a.Bump(ctx, name, 1000); err != nil {
		t.Fatal(err)
	}
	if err := a.Bump(ctx, name, 999); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Bump downwards: %v, want ErrInvalid", err)
	}
	if err := l.Renew(ctx); err != nil {
		t.Errorf("the holder's Renew after a bump: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l2, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil || l2.Token() != 1001 {
		t.Fatalf("grant after the bump: %v, %v; want token 1001", l2, err)
	}
	_ = l2.Release(ctx)
}
