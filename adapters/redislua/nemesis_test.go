package redislua_test

import (
	"context"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// nemesisWriterPrefix keeps the nemesis's writer keys apart from the lock
// keys that its DeleteState removes: a name is also a key there.
const nemesisWriterPrefix = "fencew:"

// TestNemesis: clients on one Redis server, each behind proxies of its own,
// call random lease and write operations while replies are lost, latency
// added, clients partitioned and lock state deleted; the history holds
// (fencetest.NemesisSuite).
func TestNemesis(t *testing.T) {
	direct := testenv.RedisClient(t)
	wopts := &redislua.WriterOptions{Prefix: nemesisWriterPrefix}
	newWriter := func(t *testing.T, c redislua.Client) fence.FencedWriter {
		w, err := redislua.NewWriter(c, wopts)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	fencetest.NemesisSuite{
		Acquirer: faultyAcquirer(&redislua.AcquirerOptions{}),
		Writer: func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			c, p := proxiedClient(t)
			return newWriter(t, c), p
		},
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			return newAcquirerOn(t, direct, nil), newWriter(t, direct)
		},
		// The lock, the counter, the line and the waiters of the name (the
		// writer's keys have a prefix of their own); a name with no state
		// yet is fine.
		DeleteState: func(t *testing.T, name string) {
			ctx := context.Background()
			var keys []string
			iter := direct.Scan(ctx, 0, redislua.DefaultPrefix+"{"+name+"}*", 100).Iterator()
			for iter.Next(ctx) {
				keys = append(keys, iter.Val())
			}
			if err := iter.Err(); err != nil {
				t.Errorf("listing the keys of %q: %v", name, err)
				return
			}
			if len(keys) > 0 {
				if err := direct.Del(ctx, keys...).Err(); err != nil {
					t.Errorf("deleting the keys of %q: %v", name, err)
				}
			}
		},
		ShortTTL: 300 * time.Millisecond,
	}.Run(t)
}

// TestIdempotencyNemesis: clients on one Redis server, each store on a client
// of its own (go-redis's defaults, its retries included) behind a proxy of
// its own, call idempotency.Do while replies are lost, requests dropped,
// latency added and clients partitioned; the history holds
// (idempotencytest.NemesisSuite).
func TestIdempotencyNemesis(t *testing.T) {
	opts := &redislua.IdempotencyOptions{ReleasedRetention: 500 * time.Millisecond}
	newStore := func(t *testing.T, c redislua.Client) idempotency.Store {
		s, err := redislua.NewIdempotencyStore(c, opts)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	direct := newStore(t, testenv.RedisClient(t))
	idempotencytest.NemesisSuite{
		Store: func(t *testing.T) (idempotency.Store, *faultnet.Proxy) {
			c, p := proxiedClient(t)
			return newStore(t, c), p
		},
		Direct: func(*testing.T) idempotency.Store { return direct },
	}.Run(t)
}
