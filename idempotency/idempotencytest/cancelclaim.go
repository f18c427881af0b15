package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
)

// claimLongLease is the lease of the claims these cases abandon: far longer
// than they wait for the key, so only a release can free it in time.
const claimLongLease = time.Minute

// claimFreedWithin bounds the wait for an abandoned claim to be freed.
const claimFreedWithin = 20 * time.Second

// cancelAfterClaim is a store whose claim lands, after which the caller's
// context ends before the reply arrives, as when a deadline passes while the
// reply is in flight: Begin then returns the context's error.
type cancelAfterClaim struct {
	idempotency.Store
	cancel  context.CancelFunc
	created *atomic.Bool
}

func (f cancelAfterClaim) Begin(ctx context.Context, key, fp, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	rec, created, err := f.Store.Begin(context.WithoutCancel(ctx), key, fp, owner, lease)
	if err != nil || !created {
		return rec, created, err
	}
	f.created.Store(true)
	f.cancel()
	<-ctx.Done()
	return idempotency.Record{}, false, fmt.Errorf("injected: the claim's reply was in flight: %w", ctx.Err())
}

// Update does the same to a takeover (an Update with Restart).
func (f cancelAfterClaim) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if !ch.Restart {
		return f.Store.Update(ctx, k, from, ff, ch)
	}
	if _, err := f.Store.Update(context.WithoutCancel(ctx), k, from, ff, ch); err != nil {
		return idempotency.Record{}, err
	}
	f.created.Store(true)
	f.cancel()
	<-ctx.Done()
	return idempotency.Record{}, fmt.Errorf("injected: the takeover's reply was in flight: %w", ctx.Err())
}

// keyFreed asserts that another caller can run k's effect before the
// abandoned claim's lease would have ended: Do, waiting while the key is in
// progress, completes it within claimFreedWithin.
func keyFreed(t *testing.T, st idempotency.Store, k string, opts *idempotency.Options) {
	t.Helper()
	o := *opts
	o.Wait = true
	ctx, cancel := context.WithTimeout(context.Background(), claimFreedWithin)
	defer cancel()
	begun := time.Now()
	r, err := idempotency.Do(ctx, st, k, "fp", func(context.Context, string) ([]byte, error) { return []byte("next"), nil }, &o)
	if err != nil || string(r.Value) != "next" || r.Replayed {
		t.Fatalf("the next caller, after %v, with the abandoned claim's lease (%v) not over: %+v, %v; want its own result",
			time.Since(begun).Round(time.Millisecond), claimLongLease, r, err)
	}
}

// testCancelledDuringClaim: a caller whose context ends while its claim's
// reply is in flight (the claim, or the takeover of a crashed owner's claim,
// landed) gets the context's error, its effect never runs, and the key is
// not left claimed by nobody for the claim's lease: the next caller runs its
// effect.
func (s Suite) testCancelledDuringClaim(t *testing.T, takeover bool) {
	st := s.New(t)
	k := key()
	if takeover {
		s.crashedOwner(t, st, k, false)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var created atomic.Bool
	opts := s.opts(func(o *idempotency.Options) { o.Lease = claimLongLease })
	ran := false
	_, err := idempotency.Do(ctx, cancelAfterClaim{st, cancel, &created}, k, "fp", func(context.Context, string) ([]byte, error) {
		ran = true
		return nil, nil
	}, opts)
	if !errors.Is(err, context.Canceled) || ran {
		t.Fatalf("Do cancelled during its claim: %v, effect ran %v; want context.Canceled and no effect", err, ran)
	}
	if !created.Load() {
		t.Fatal("the claim did not land; the case proves nothing")
	}
	keyFreed(t, st, k, opts)
}

// testSlowNetworkCancelledClaim: over a network with 150ms latency each way,
// a caller whose deadline ends after its claim landed and before the reply
// came back (220ms for a claim of one round trip: it lands at 150ms, its
// reply comes at 300ms) gets an error, and the key does not stay claimed by
// nobody for the claim's lease: the next caller runs its effect.
func (s Suite) testSlowNetworkCancelledClaim(t *testing.T) {
	fs, px, st := s.faulty(t)
	opts := s.opts(func(o *idempotency.Options) { o.Lease = claimLongLease })
	// A connection opened, and a claim prepared on it, now: under the
	// latency, opening one or preparing a statement (a round trip for some
	// clients) would take longer than the caller's deadline, and the claim
	// would never be sent.
	if _, _, err := fs.Begin(ctxT(t), key(), "fp", "warm-up", time.Second); err != nil {
		t.Fatalf("Begin of a new key: %v", err)
	}
	if _, err := fs.Get(ctxT(t), key()); !errors.Is(err, fence.ErrNotFound) {
		t.Fatalf("Get of a missing key: %v, want fence.ErrNotFound", err)
	}
	const oneWay = 150 * time.Millisecond
	px.Latency(oneWay, oneWay)
	t.Cleanup(func() { px.Latency(0, 0) })
	// A store whose claim takes several round trips sends its last request
	// a round trip before the answer: the deadline falls between that
	// request's arrival and its reply.
	begun := time.Now()
	if _, _, err := fs.Begin(ctxT(t), key(), "fp", "warm-up", time.Second); err != nil {
		t.Fatalf("Begin of a new key over the slow network: %v", err)
	}
	claim := time.Since(begun)
	// 220ms for one round trip of 300ms. A loaded machine moves the
	// moment the claim lands: a try whose claim did not land before the
	// deadline tries again with a later one, and a try whose reply came
	// before it (a claim faster than the one measured) with an earlier
	// one, never past the measured claim nor below 220ms.
	const step, tries = 25 * time.Millisecond, 6
	floor, ceiling := 220*time.Millisecond, max(claim-10*time.Millisecond, 220*time.Millisecond)
	deadline := max(claim-80*time.Millisecond, floor)
	for try := 1; ; try++ {
		k := key()
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		ran := false
		_, err := idempotency.Do(ctx, fs, k, "fp", func(context.Context, string) ([]byte, error) {
			ran = true
			return nil, nil
		}, opts)
		cancel()
		if ran || err == nil {
			if try == tries {
				t.Fatalf("in %d tries Do never failed with its deadline before the claim's reply (effect ran %v: %v; last deadline %v, a claim took %v)", tries, ran, err, deadline, claim)
			}
			t.Logf("try %d: Do with a %v deadline: effect ran %v, %v: the reply came first; again, with an earlier deadline", try, deadline, ran, err)
			deadline = max(deadline-step, floor)
			continue
		}
		rec, gerr := st.Get(ctxT(t), k)
		landed := gerr == nil && (rec.State == idempotency.Claimed || rec.State == idempotency.Released)
		if !landed && try < tries {
			// The claim was not sent before the deadline (a loaded
			// machine): nothing to free; try again with a new key.
			t.Logf("try %d: the claim did not land (%+v, %v); again, with a later deadline", try, rec, gerr)
			deadline = min(deadline+step, ceiling)
			continue
		}
		if !landed {
			t.Fatalf("in %d tries the claim never landed before the caller's deadline (last %v; a claim took %v): %+v, %v", tries, deadline, claim, rec, gerr)
		}
		t.Logf("Do with a %v deadline (a claim took %v): %v", deadline, claim, err)
		keyFreed(t, st, k, opts)
		return
	}
}
