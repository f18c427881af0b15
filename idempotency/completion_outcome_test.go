package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
)

// A completion whose first try landed but lost its reply is sent again, and
// the second try is refused (the record is no longer armed: it holds this
// very completion). Do then reads the record to tell its own change from
// another caller's; when that read gets no answer before CompleteTimeout
// (the store became unreachable), Do cannot know whether the completion
// landed, and must not say it was not recorded: the docs promise Do "never
// reports 'not recorded' for a completion that landed", and an
// ErrNotRecorded for a step that may have landed matches fence.ErrUnknown.
func TestCompletionRefusedThenUnreadableIsNotReportedNotRecorded(t *testing.T) {
	for name, ss := range serverStores(t) {
		t.Run(name, func(t *testing.T) {
			err, _, rec, gerr := completionRefusedThenUnreadable(t, ss, 500*time.Millisecond, nil)
			if gerr != nil || rec.State != idempotency.Completed || string(rec.Result) != "done" {
				t.Fatalf("record %+v, %v: want completed with the effect's result (the first try landed)", rec, gerr)
			}
			if err != nil && !errors.Is(err, fence.ErrUnknown) {
				t.Fatalf("Do reported %v for a completion that landed (the record is completed with its result); want nil, or an error matching fence.ErrUnknown", err)
			}
		})
	}
}

// The same for the owner's other final changes: the release of an effect
// that was not sent, and the failure of a definitive one. A change that
// landed is never reported as not recorded without fence.ErrUnknown.
func TestFinalChangeRefusedThenUnreadableIsNotReportedNotRecorded(t *testing.T) {
	for name, ss := range serverStores(t) {
		for _, c := range []struct {
			outcome string
			err     error
			state   idempotency.State
		}{
			{"not-sent", idempotency.NotSent(errors.New("declined before sending")), idempotency.Released},
			{"definitive", idempotency.Definitive(errors.New("card declined")), idempotency.Failed},
		} {
			t.Run(name+"/"+c.outcome, func(t *testing.T) {
				err, _, rec, gerr := completionRefusedThenUnreadable(t, ss, 500*time.Millisecond, c.err)
				landed := (gerr == nil && rec.State == c.state) || (c.state == idempotency.Released && errors.Is(gerr, fence.ErrNotFound))
				if !landed {
					t.Fatalf("record %+v, %v: want %s (the first try landed)", rec, gerr, c.state)
				}
				if errors.Is(err, idempotency.ErrNotRecorded) && !errors.Is(err, fence.ErrUnknown) {
					t.Fatalf("Do reported %v for a change to %s that landed; want no ErrNotRecorded, or one matching fence.ErrUnknown", err, c.state)
				}
			})
		}
	}
}

// CompleteTimeout bounds recording the result, the re-read that tells a
// refused try's own change included: with the store unreachable, Do returns
// about CompleteTimeout after the effect returned, not after the client
// library's own timeouts and retries.
func TestCompletionReReadBoundedByCompleteTimeout(t *testing.T) {
	const completeTimeout = 500 * time.Millisecond
	for name, ss := range serverStores(t) {
		t.Run(name, func(t *testing.T) {
			err, took, _, _ := completionRefusedThenUnreadable(t, ss, completeTimeout, nil)
			if took > completeTimeout+time.Second {
				t.Fatalf("Do returned %v after its effect did (CompleteTimeout %v), with %v", took.Round(time.Millisecond), completeTimeout, err)
			}
		})
	}
}

// completionRefusedThenUnreadable runs Do on ss with an effect that returns
// "done" and effErr: the owner's final change's first try lands and its
// reply is lost, the second try is refused, and the store is then
// unreachable until Do returns. It returns Do's error, the time from
// the effect's return to Do's, and the record read back after the store is
// reachable again.
func completionRefusedThenUnreadable(t *testing.T, ss serverStore, completeTimeout time.Duration, effErr error) (error, time.Duration, idempotency.Record, error) {
	t.Helper()
	k := key()
	defer ss.proxy.Heal()
	var completions atomic.Int32
	var refusal atomic.Value
	hs := &hookedStore{Store: ss.faulty}
	hs.beforeUpdate = func(n int, from idempotency.State, ch idempotency.Change) {
		if from == idempotency.Armed && ch.State != idempotency.Armed && completions.Add(1) == 1 {
			ss.proxy.LoseReply(func(b []byte) bool { return faultnet.Carries(b, k) })
		}
	}
	hs.afterUpdate = func(n int, from idempotency.State, ch idempotency.Change, err error) {
		if from == idempotency.Armed && ch.State != idempotency.Armed && completions.Load() == 2 && err != nil {
			refusal.Store(err.Error())
			ss.proxy.Partition() // the re-read gets no answer
		}
	}
	runs := 0
	var returned time.Time
	_, err := idempotency.Do(ctxT(t), hs, k, "fp", func(context.Context, string) ([]byte, error) {
		runs++
		returned = time.Now()
		return []byte("done"), effErr
	}, &idempotency.Options{Lease: 5 * time.Second, CompleteTimeout: completeTimeout})
	took := time.Since(returned)
	ss.proxy.Heal()
	rec, gerr := ss.direct.Get(context.Background(), k)
	t.Logf("Do: %v, %v after the effect returned; completion tries %d, the second refused with %v; record %s %q (%v)",
		err, took.Round(time.Millisecond), completions.Load(), refusal.Load(), rec.State, rec.Result, gerr)
	if runs != 1 || completions.Load() < 2 || refusal.Load() == nil {
		t.Fatalf("effect runs %d, completion tries %d, refusal %v: the scenario did not happen", runs, completions.Load(), refusal.Load())
	}
	return err, took, rec, gerr
}
