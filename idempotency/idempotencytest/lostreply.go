package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
)

// LostReplyEnv names the environment variable that turns the lost-reply cases
// off when it is "0". They run whenever the Suite has a Faulty harness; every
// built-in store passes them.
const LostReplyEnv = "FENCEKIT_LOST_REPLY"

// faulty returns the harness's store behind a fault proxy, and the store of
// New for re-reads that no fault touches; it skips without a Faulty harness
// or with LostReplyEnv=0.
func (s Suite) faulty(t *testing.T) (faulty idempotency.Store, px *faultnet.Proxy, direct idempotency.Store) {
	t.Helper()
	if s.Faulty == nil {
		t.Skip("no Faulty harness (the store behind a fault proxy) for this backend")
	}
	if os.Getenv(LostReplyEnv) == "0" {
		t.Skipf("the lost-reply cases are off (%s=0)", LostReplyEnv)
	}
	faulty, px = s.Faulty(t)
	return faulty, px, s.New(t)
}

// loseReplyTo makes px lose the reply to the next request that carries k: the
// store acts on it, the client's connection is cut before the reply arrives.
// Keys are random, so only the requests of the step under test carry k.
func loseReplyTo(px *faultnet.Proxy, k string) {
	px.LoseReply(func(b []byte) bool { return faultnet.Carries(b, k) })
}

// ambiguous checks the outcome of a step whose reply was lost: the fault must
// have fired, and the step must return nil (it recognised its own change) or
// an error matching fence.ErrUnknown, never a bare transport error nor a
// definite refusal of its own change.
func ambiguous(t *testing.T, px *faultnet.Proxy, step string, err error) {
	t.Helper()
	if px.Pending() != 0 {
		t.Fatalf("%s: the lost-reply fault never fired (no request carried the key)", step)
	}
	if err != nil && !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("%s whose reply was lost: %v, want nil or an error matching fence.ErrUnknown", step, err)
	}
}

// stepCtx bounds one step: a store that hangs after a lost reply fails the case.
func stepCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// testLostReplyBegin: a claim whose reply was lost is ErrUnknown or recognised
// (created, with the record it wrote); the record is either absent or this
// claim, whole.
func (s Suite) testLostReplyBegin(t *testing.T) {
	fs, px, st := s.faulty(t)
	k := key()
	loseReplyTo(px, k)
	rec, created, err := fs.Begin(stepCtx(t), k, "fp", "me", time.Minute)
	ambiguous(t, px, "Begin", err)
	got, gerr := st.Get(ctxT(t), k)
	switch {
	case errors.Is(gerr, fence.ErrNotFound):
		if err == nil {
			t.Errorf("Begin returned %+v (created %v) and nil, but the key has no record", rec, created)
		}
	case gerr != nil:
		t.Fatalf("Get after the lost reply: %v", gerr)
	case got.State != idempotency.Claimed || got.Owner != "me" || got.Fingerprint != "fp" || got.LeaseLeft <= 0:
		t.Errorf("record after Begin's lost reply: %+v, want none or this claim", got)
	case err == nil && (!created || rec.Fence != got.Fence || rec.Owner != "me"):
		t.Errorf("Begin whose reply was lost returned %+v, created %v: want its own claim, created, fence %d", rec, created, got.Fence)
	}
}

// A step of the owner after its claim, whose reply the lost-reply cases lose.
type step int

const (
	stepArm step = iota
	stepRenew
	stepComplete
	stepRelease
)

func (p step) String() string {
	return [...]string{"arm", "renew", "complete", "release"}[p]
}

// testLostReplyStep: the owner's step p (arm, renew, complete, release) whose
// reply was lost returns nil or ErrUnknown, and the record holds either the
// state before it or the state after it, whole: never a mix, never another
// fence or owner.
func (s Suite) testLostReplyStep(t *testing.T, p step) {
	fs, px, st := s.faulty(t)
	k := key()
	const owner = "me"
	rec, created, err := fs.Begin(stepCtx(t), k, "fp", owner, time.Minute)
	if err != nil || !created {
		t.Fatalf("Begin: created %v, %v", created, err)
	}
	from, f := idempotency.Claimed, rec.Fence
	armLease := 10 * time.Second
	if p != stepArm {
		if _, err := fs.Update(stepCtx(t), k, idempotency.Claimed, f, idempotency.Change{State: idempotency.Armed, Fence: f, Owner: owner, Lease: armLease}); err != nil {
			t.Fatalf("arm: %v", err)
		}
		from = idempotency.Armed
	}
	ch := idempotency.Change{Fence: f, Owner: owner}
	switch p {
	case stepArm:
		ch.State, ch.Lease = idempotency.Armed, time.Minute
	case stepRenew:
		ch.State, ch.Lease = idempotency.Armed, time.Minute
	case stepComplete:
		ch.State, ch.Result, ch.Retention = idempotency.Completed, []byte("result"), time.Hour
	case stepRelease:
		ch.State = idempotency.Released
	}
	loseReplyTo(px, k)
	out, err := fs.Update(stepCtx(t), k, from, f, ch)
	ambiguous(t, px, p.String(), err)

	got, gerr := st.Get(ctxT(t), k)
	if errors.Is(gerr, fence.ErrNotFound) && p == stepRelease && s.SelfExpiring {
		return // released, and already expired by the store
	}
	if gerr != nil {
		t.Fatalf("Get after the lost %s reply: %v", p, gerr)
	}
	if got.Fence != f || got.Owner != owner || got.Fingerprint != "fp" {
		t.Fatalf("record after the lost %s reply: %+v, want fence %d, owner %s, fingerprint fp", p, got, f, owner)
	}
	old := got.State == from && got.Result == nil
	if p == stepRenew {
		old = old && got.LeaseLeft <= armLease
	}
	var applied bool
	switch p {
	case stepArm:
		applied = got.State == idempotency.Armed && got.Result == nil
	case stepRenew:
		applied = got.State == idempotency.Armed && got.Result == nil && got.LeaseLeft > armLease
	case stepComplete:
		applied = got.State == idempotency.Completed && string(got.Result) == "result"
	case stepRelease:
		applied = got.State == idempotency.Released && got.Result == nil
	}
	switch {
	case !old && !applied:
		t.Errorf("record after the lost %s reply is half-applied: %+v (from %s)", p, got, from)
	case err == nil && !applied:
		t.Errorf("%s returned nil (%+v) after its lost reply, but the record is unchanged: %+v", p, out, got)
	}
}

// testLostRepliesDo: with 2% of requests cut (half of them after the store
// acted), Do over 100 keys, each called twice, runs each effect at most once,
// and a Do that returned the effect's result left its key completed with it.
func (s Suite) testLostRepliesDo(t *testing.T) {
	fs, px, st := s.faulty(t)
	const keys = 100
	var runs [keys]atomic.Int32
	ks := make([]string, keys)
	ran := make([]bool, keys)
	outcomes := map[string]int{}
	px.CutRate(0.02)
	for i := range ks {
		ks[i] = key()
		result := fmt.Sprintf("r-%d", i)
		for range 2 {
			r, err := idempotency.Do(stepCtx(t), fs, ks[i], "fp", func(context.Context, string) ([]byte, error) {
				runs[i].Add(1)
				return []byte(result), nil
			}, s.opts())
			switch {
			case err == nil && !r.Replayed:
				ran[i] = true
				outcomes["ran"]++
			case err == nil:
				outcomes["replayed"]++
			default:
				outcomes[outcome(err)]++
			}
		}
	}
	px.CutRate(0)
	t.Logf("outcomes of %d Do calls: %v; proxy: %+v", 2*keys, outcomes, px.Stats())
	if px.Stats().Cuts == 0 {
		t.Fatal("no request was cut")
	}
	for i, k := range ks {
		if n := runs[i].Load(); n > 1 {
			t.Errorf("key %s: the effect ran %d times", k, n)
		}
		if !ran[i] {
			continue
		}
		if rec, err := st.Get(ctxT(t), k); err != nil || rec.State != idempotency.Completed || string(rec.Result) != fmt.Sprintf("r-%d", i) {
			t.Errorf("key %s: Do returned its result, but the record is %+v, %v", k, rec, err)
		}
	}
}

// testCompletionHeldPastTimeout: a completion whose request is held in the
// network past CompleteTimeout (a partition that delivers on heal) may land
// after Do returned, so Do cannot say it was not recorded: its ErrNotRecorded
// also matches fence.ErrUnknown. Once the request is delivered, the record is
// armed or completed with the effect's result, and the effect ran once.
func (s Suite) testCompletionHeldPastTimeout(t *testing.T) {
	fs, px, st := s.faulty(t)
	defer px.Heal()
	k := key()
	var runs atomic.Int32
	_, err := idempotency.Do(stepCtx(t), fs, k, "fp", func(context.Context, string) ([]byte, error) {
		runs.Add(1)
		px.Partition()
		return []byte("done"), nil
	}, s.opts(func(o *idempotency.Options) { o.CompleteTimeout = 300 * time.Millisecond }))
	px.Heal()
	if n := runs.Load(); n != 1 {
		t.Fatalf("the effect ran %d times, want 1", n)
	}
	if !errors.Is(err, idempotency.ErrNotRecorded) || !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Do whose completion was held past CompleteTimeout: %v, want ErrNotRecorded matching fence.ErrUnknown too (the held request may still land)", err)
	}
	rec := state(t, st, k)
	if rec.State != idempotency.Armed && (rec.State != idempotency.Completed || string(rec.Result) != "done") {
		t.Errorf("record after the held completion was delivered: %+v, want armed, or completed with %q", rec, "done")
	}
	t.Logf("record after heal: %s", rec.State)
}

// outcome names the class of a Do error, for the log of testLostRepliesDo.
func outcome(err error) string {
	for _, c := range []struct {
		name string
		err  error
	}{
		{"ErrInProgress", idempotency.ErrInProgress},
		{"ErrUnknown", idempotency.ErrUnknown},
		{"ErrNotRecorded", idempotency.ErrNotRecorded},
		{"fence.ErrUnknown", fence.ErrUnknown},
		{"ErrStateChanged", idempotency.ErrStateChanged},
		{"fence.ErrStale", fence.ErrStale},
	} {
		if errors.Is(err, c.err) {
			return c.name
		}
	}
	return "other error"
}
