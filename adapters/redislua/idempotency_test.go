package redislua_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

func TestIdempotencyStore(t *testing.T) {
	opts := &redislua.IdempotencyOptions{ReleasedRetention: 500 * time.Millisecond}
	s := newStoreOn(t, testenv.RedisClient(t), opts)
	idempotencytest.Suite{
		New:          func(t *testing.T) idempotency.Store { return s },
		SelfExpiring: true,
		BadKeys:      []string{"a{b}"},
		// The test server through a fault proxy, with a client on go-redis's defaults.
		Faulty: func(t *testing.T) (idempotency.Store, *faultnet.Proxy) {
			px := faultnet.Start(t, testenv.RedisAddr())
			c := redis.NewClient(&redis.Options{Addr: px.Addr()})
			t.Cleanup(func() { c.Close() })
			fs := newStoreOn(t, c, opts)
			return fs, px
		},
	}.Run(t)
}

// countingClient counts the commands a client sends (one round trip each; a
// script is one EVALSHA).
type countingClient struct {
	redislua.Client
	n atomic.Int64
}

func (c *countingClient) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	c.n.Add(1)
	return c.Client.EvalSha(ctx, sha1, keys, args...)
}

// Pipelined counts a pipeline (one round trip): scripts that must not be
// sent twice go as a one-command pipeline.
func (c *countingClient) Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error) {
	c.n.Add(1)
	return c.Client.Pipelined(ctx, fn)
}

func (c *countingClient) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	c.n.Add(1)
	return c.Client.Eval(ctx, script, keys, args...)
}

// TestIdempotencyRoundTrips counts round trips per Do: 3 on a fresh key (claim,
// arm, complete), 1 on a replay (the claim script returns the record).
func TestIdempotencyRoundTrips(t *testing.T) {
	c := &countingClient{Client: testenv.RedisClient(t)}
	s := newStoreOn(t, c, nil)
	ctx := context.Background()
	k := fencetest.Name("rt")
	effect := func(context.Context, string) ([]byte, error) { return []byte("ok"), nil }
	// Load the scripts first: a first EVALSHA that finds no script costs an EVAL.
	if _, err := idempotency.Do(ctx, s, fencetest.Name("warm"), "fp", effect, nil); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		what string
		want int64
	}{{"a fresh key", 3}, {"a replay", 1}} {
		before := c.n.Load()
		if _, err := idempotency.Do(ctx, s, k, "fp", effect, nil); err != nil {
			t.Fatal(err)
		}
		if n := c.n.Load() - before; n != tc.want {
			t.Errorf("Do on %s: %d round trips, want %d", tc.what, n, tc.want)
		}
	}
}

// TestIdempotencyBeginBadLease: a Begin with a lease that is not
// positive is refused with fence.ErrInvalid and claims nothing, as Update refuses a
// negative lease.
func TestIdempotencyBeginBadLease(t *testing.T) {
	ctx := context.Background()
	s := newStoreOn(t, testenv.RedisClient(t), nil)
	for _, lease := range []time.Duration{-time.Second, 0} {
		k := fencetest.Name("badlease")
		_, created, err := s.Begin(ctx, k, "fp", "o", lease)
		if !errors.Is(err, fence.ErrInvalid) {
			t.Fatalf("Begin with lease %v: created %v, %v; want ErrInvalid", lease, created, err)
		}
		if _, err := s.Get(ctx, k); !errors.Is(err, fence.ErrNotFound) {
			t.Fatalf("Begin with lease %v left a record: %v", lease, err)
		}
	}
}
