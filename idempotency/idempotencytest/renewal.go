package idempotencytest

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
)

// lateArmReply is a store whose arm (claimed -> armed) is applied at once but
// answered delay later, as over a slow or loaded network; it counts the
// renewals (armed -> armed) the store confirmed, closing renewed once two are.
type lateArmReply struct {
	idempotency.Store
	delay    time.Duration
	renewals *atomic.Int32
	renewed  chan struct{}
}

func (f lateArmReply) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	rec, err := f.Store.Update(ctx, k, from, ff, ch)
	switch {
	case from == idempotency.Claimed && ch.State == idempotency.Armed:
		time.Sleep(f.delay) // the injected fault: the reply is late, the lease already runs
	case from == idempotency.Armed && ch.State == idempotency.Armed && err == nil:
		if f.renewals.Add(1) == 2 {
			close(f.renewed)
		}
	}
	return rec, err
}

// testLateArmReplyRenewsInTime: an arm whose reply comes back 70% into the
// lease (the lease runs at the store from the arm's send) is renewed before
// its local deadline: the effect, which runs until two renewals were
// confirmed, is never cancelled, and the key completes. A first renewal a flat
// third of the lease after the reply would come after the local deadline.
func (s Suite) testLateArmReplyRenewsInTime(t *testing.T) {
	lease := max(s.Lease, 2*time.Second) // room for a renewal's round trip on a loaded machine
	var renewals atomic.Int32
	st := lateArmReply{s.New(t), lease * 7 / 10, &renewals, make(chan struct{})}
	k := key()
	var cause error
	r, err := idempotency.Do(ctxT(t), st, k, "fp", func(ctx context.Context, _ string) ([]byte, error) {
		select {
		case <-st.renewed:
		case <-ctx.Done():
			cause = context.Cause(ctx)
			return nil, idempotency.NotSent(cause)
		}
		return []byte("kept"), nil
	}, s.opts(func(o *idempotency.Options) { o.Lease = lease }))
	if cause != nil {
		t.Fatalf("the effect, armed by a reply %v into its %v lease, was cancelled after %d confirmed renewals: %v",
			st.delay, lease, renewals.Load(), cause)
	}
	if err != nil || string(r.Value) != "kept" {
		t.Fatalf("Do: %+v, %v, want the effect's result", r, err)
	}
	if rec := state(t, s.New(t), k); rec.State != idempotency.Completed {
		t.Errorf("state %s after Do, want completed", rec.State)
	}
}

// renewalCounter counts the renewals (armed -> armed) sent to the store.
type renewalCounter struct {
	idempotency.Store
	sent *atomic.Int32
}

func (f renewalCounter) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if from == idempotency.Armed && ch.State == idempotency.Armed {
		f.sent.Add(1)
	}
	return f.Store.Update(ctx, k, from, ff, ch)
}

// testPanicStopsRenewals: an effect that panics after its first renewal
// leaves the key armed, and Do stops renewing it: the lease runs out at the
// store and no renewal is sent after that.
func (s Suite) testPanicStopsRenewals(t *testing.T) {
	var sent atomic.Int32
	st := renewalCounter{s.New(t), &sent}
	k := key()
	p := func() (p any) {
		defer func() { p = recover() }()
		_, _ = idempotency.Do(ctxT(t), st, k, "fp", func(ctx context.Context, _ string) ([]byte, error) {
			for sent.Load() == 0 && ctx.Err() == nil {
				time.Sleep(s.Lease / 30) // polling a counter, not synchronisation
			}
			panic("effect panicked")
		}, s.opts(func(o *idempotency.Options) { o.InProgressCeiling = time.Hour })) // only the panic may stop renewals
		return nil
	}()
	if p != "effect panicked" {
		t.Fatalf("Do with a panicking effect: recovered %v, want the effect's panic", p)
	}
	deadline := time.Now().Add(20 * s.Lease)
	for {
		rec := state(t, s.New(t), k)
		if rec.State != idempotency.Armed {
			t.Fatalf("record after the panic: %+v, want armed", rec)
		}
		if rec.LeaseLeft <= 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the lease of the panicked effect still has %v left %v after the panic: %d renewals sent",
				rec.LeaseLeft, 20*s.Lease, sent.Load())
		}
		time.Sleep(s.Lease / 10)
	}
	n := sent.Load()
	time.Sleep(s.Lease) // a renewer still running would send again within a third of it
	if m := sent.Load(); m != n {
		t.Errorf("%d renewals sent after the panicked effect's lease ran out", m-n)
	}
}
