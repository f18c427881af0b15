package natsfence_test

import (
	"context"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
)

// TestNemesis: clients on the package's server, each acquirer and writer on
// a connection of its own behind a proxy of its own, call random lease and
// write operations while replies are lost, latency added, clients
// partitioned and a name's lock key purged; the history holds
// (fencetest.NemesisSuite). The writer's keys are in a bucket of their own,
// which the purge leaves alone.
//
// The ttl and expiry lag are the acquirer suite's: the server's 1s minimum
// key TTL, and 2s for its expiry timer on a loaded machine. A 4s run would
// hold four ttls; each seed runs 12s instead, three seeds well under a
// minute with the checks after each.
func TestNemesis(t *testing.T) {
	direct := js(t)
	kv := bucket(t, direct, lockBucket)
	fencetest.NemesisSuite{
		Acquirer: func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
			j, p := proxied(t)
			return newAcquirer(t, j, lockBucket, nil), p
		},
		Writer: func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			j, p := proxied(t)
			return newWriter(t, j, writerBucket), p
		},
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			return newAcquirer(t, direct, lockBucket, nil), newWriter(t, direct, writerBucket)
		},
		// Every message of the name's lock key, as the acquirer suite's
		// DeleteState.
		DeleteState: func(t *testing.T, name string) {
			if err := kv.Purge(context.Background(), natsfence.EncodeKey(name)); err != nil {
				t.Errorf("purging the key of %q: %v", name, err)
			}
		},
		ShortTTL:  natsfence.MinTTL,
		ExpiryLag: 2 * time.Second,
		Duration:  12 * time.Second,
	}.Run(t)
}

// TestIdempotencyNemesis: clients on the package's server, each store on a
// connection of its own behind a proxy of its own, call idempotency.Do while
// replies are lost, requests dropped, latency added and clients partitioned;
// the history holds (idempotencytest.NemesisSuite).
func TestIdempotencyNemesis(t *testing.T) {
	cfg := idemBucket(t) // one bucket for every client and seed
	direct := newStore(t, js(t), cfg)
	idempotencytest.NemesisSuite{
		Store: func(t *testing.T) (idempotency.Store, *faultnet.Proxy) {
			j, p := proxied(t)
			return newStoreOpts(t, j, cfg, faultyOpts), p
		},
		Direct: func(*testing.T) idempotency.Store { return direct },
	}.Run(t)
}
