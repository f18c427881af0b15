package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/idemstores"
)

// faultyStores returns the PostgreSQL and Redis stores, each through its own
// fault proxy.
func faultyStores(t *testing.T) map[string]idemstores.Faulty { return idemstores.Faults(t) }

// stores returns the SQLite, PostgreSQL and Redis stores, without faults.
func stores(t *testing.T) map[string]idempotency.Store { return idemstores.All(t) }

func key() string { return fencetest.Name("idem") }

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// ledger counts an effect's runs per key.
type ledger struct {
	mu   sync.Mutex
	runs map[string]int
}

func (l *ledger) effect(key string) idempotency.Effect {
	return func(context.Context, string) ([]byte, error) {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.runs == nil {
			l.runs = map[string]int{}
		}
		l.runs[key]++
		return []byte("charged " + key), nil
	}
}

func (l *ledger) count(key string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.runs[key]
}

// the requests of one key's store steps, as the proxy sees them: the
// completion carries "completed", the arm "claimed" and "armed".
func completion(k string) func([]byte) bool {
	return func(b []byte) bool { return bytes.Contains(b, []byte(k)) && bytes.Contains(b, []byte("completed")) }
}

// beginning matches the claim by its fingerprint, which only Begin sends.
func beginning(k string) func([]byte) bool {
	return func(b []byte) bool { return bytes.Contains(b, []byte("fp-"+k)) }
}

func arming(k string) func([]byte) bool {
	return func(b []byte) bool {
		return bytes.Contains(b, []byte(k)) && bytes.Contains(b, []byte("claimed")) && bytes.Contains(b, []byte("armed"))
	}
}

// A completion whose reply was lost landed; Do recognises its
// own applied change (re-sent by Do, or by the client library) instead of
// reporting ErrNotRecorded.
// An arm whose reply was lost landed; Do goes on with the
// effect instead of leaving the key armed (later unknown) with no effect run.
// The same for a claim whose reply was lost: Do goes on with its own claim
// instead of an error, or ErrInProgress against itself.
func TestLostReplies(t *testing.T) {
	for name, f := range faultyStores(t) {
		t.Run(name, func(t *testing.T) {
			for _, c := range []struct {
				step  string
				match func(string) func([]byte) bool
			}{{"begin", beginning}, {"complete", completion}, {"arm", arming}} {
				t.Run(c.step, func(t *testing.T) {
					var l ledger
					k := key()
					lost := f.Proxy.Stats().LostReplies
					f.Proxy.LoseReply(c.match(k))
					r, err := idempotency.Do(ctxT(t), f.Store, k, "fp-"+k, l.effect(k), &idempotency.Options{Lease: 2 * time.Second})
					if f.Proxy.Pending() != 0 || f.Proxy.Stats().LostReplies == lost {
						t.Fatalf("the %s's reply was never lost (pending %d)", c.step, f.Proxy.Pending())
					}
					if err != nil || string(r.Value) != "charged "+k {
						t.Fatalf("Do with the %s's reply lost: %+v, %v; want its result", c.step, r, err)
					}
					rec, err := f.Store.Get(ctxT(t), k)
					if err != nil || rec.State != idempotency.Completed || string(rec.Result) != "charged "+k || l.count(k) != 1 {
						t.Fatalf("record %+v, %v, effect ran %d times; want completed with the one run's result", rec, err, l.count(k))
					}
				})
			}
		})
	}
}

// A Reconcile hook's completion, and the mark of an unknown key, whose replies
// were lost, landed: Do answers with the result found, or ErrUnknown, instead
// of a bare transport error or ErrInProgress against its own change.
func TestLostRepliesAfterCrash(t *testing.T) {
	for name, f := range faultyStores(t) {
		t.Run(name, func(t *testing.T) {
			for _, reconcile := range []bool{true, false} {
				k := key()
				lease := 300 * time.Millisecond
				// An owner that stops after arming: its effect's outcome is ambiguous.
				_, err := idempotency.Do(ctxT(t), f.Store, k, "fp", func(context.Context, string) ([]byte, error) {
					return nil, errors.New("connection to the provider reset")
				}, &idempotency.Options{Lease: lease})
				if err == nil {
					t.Fatal("the ambiguous effect returned no error")
				}
				o := &idempotency.Options{Lease: lease}
				match := func(b []byte) bool { return bytes.Contains(b, []byte(k)) && bytes.Contains(b, []byte("unknown")) }
				if reconcile {
					o.Reconcile = func(context.Context, string) (bool, []byte, error) { return true, []byte("found " + k), nil }
					match = completion(k)
				}
				var r idempotency.Result
				for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
					if rec, err := f.Store.Get(ctxT(t), k); err == nil && rec.LeaseLeft <= 0 {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("the lease never ran out")
					}
				}
				lost := f.Proxy.Stats().LostReplies
				f.Proxy.LoseReply(match)
				r, err = idempotency.Do(ctxT(t), f.Store, k, "fp", func(context.Context, string) ([]byte, error) { return nil, errors.New("must not run") }, o)
				if f.Proxy.Pending() != 0 || f.Proxy.Stats().LostReplies == lost {
					t.Fatalf("reconcile %v: the reply was never lost", reconcile)
				}
				rec, gerr := f.Store.Get(ctxT(t), k)
				switch {
				case reconcile && (err != nil || string(r.Value) != "found "+k || rec.State != idempotency.Completed):
					t.Fatalf("Reconcile found the effect, its completion's reply lost: %+v, %v; record %+v, %v", r, err, rec, gerr)
				case !reconcile && (!errors.Is(err, idempotency.ErrUnknown) || rec.State != idempotency.Unknown):
					t.Fatalf("no Reconcile, the unknown mark's reply lost: %v; want ErrUnknown; record %+v, %v", err, rec, gerr)
				}
			}
		})
	}
}

// TestCutConnections runs 200 keys under 2% random cuts (half of them lose
// the reply of a request the server applied): every Do succeeds (Do
// recognises its own claim, arm and completion, and sends again what did not
// land), so no completion that landed is reported ErrNotRecorded, no key is left armed or unknown without its effect
// having run, and no effect runs twice, also when every key is tried again
// without faults.
func TestCutConnections(t *testing.T) {
	const keys = 200
	for name, f := range faultyStores(t) {
		t.Run(name, func(t *testing.T) {
			var l ledger
			opts := &idempotency.Options{Lease: 2 * time.Second, Wait: true}
			ks := make([]string, keys)
			for i := range ks {
				ks[i] = key()
			}
			f.Proxy.CutRate(0.02)
			var notRecorded, failed atomic.Int32
			var wg sync.WaitGroup
			next := make(chan string)
			for w := 0; w < 4; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for k := range next {
						ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
						start := time.Now()
						_, err := idempotency.Do(ctx, f.Store, k, "fp", l.effect(k), opts)
						took, ctxErr := time.Since(start), ctx.Err()
						cancel()
						switch {
						case errors.Is(err, idempotency.ErrNotRecorded):
							notRecorded.Add(1)
							t.Errorf("key %s: %v (after %v; context: %v)", k, err, took, ctxErr)
						case err != nil:
							failed.Add(1)
							t.Errorf("key %s: %v (after %v; context: %v)", k, err, took, ctxErr)
						}
					}
				}()
			}
			for _, k := range ks {
				next <- k
			}
			close(next)
			wg.Wait()
			f.Proxy.CutRate(0)
			st := f.Proxy.Stats()
			t.Logf("%d keys: %d connections cut, %d replies lost; %d ErrNotRecorded, %d other errors", keys, st.Cuts, st.LostReplies, notRecorded.Load(), failed.Load())
			if st.LostReplies == 0 {
				t.Fatal("no reply was lost: the run shows nothing")
			}
			for _, k := range ks {
				rec, err := f.Store.Get(ctxT(t), k)
				if err == nil && (rec.State == idempotency.Armed || rec.State == idempotency.Unknown) && l.count(k) == 0 {
					t.Errorf("key %s left %s although its effect never ran", k, rec.State)
				}
				// Again, without faults: a replay, or the first run.
				r, err := idempotency.Do(ctxT(t), f.Store, k, "fp", l.effect(k), opts)
				if err != nil || string(r.Value) != "charged "+k {
					t.Errorf("key %s, again: %+v, %v", k, r, err)
				}
				if n := l.count(k); n != 1 {
					t.Errorf("key %s: the effect ran %d times", k, n)
				}
			}
		})
	}
}

// Retention Forever keeps the record past every purge, so
// the key never runs again; a finite retention ends the promise, and the
// claim after it is a new request with a new effect key.
func TestRetention(t *testing.T) {
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			var l ledger
			keys := map[string]bool{}
			effect := func(k string) idempotency.Effect {
				return func(ctx context.Context, ek string) ([]byte, error) {
					keys[ek] = true
					return l.effect(k)(ctx, ek)
				}
			}
			short := &idempotency.Options{Retention: 50 * time.Millisecond}
			k := key()
			if _, err := idempotency.Do(ctxT(t), s, k, "fp", effect(k), short); err != nil {
				t.Fatal(err)
			}
			time.Sleep(100 * time.Millisecond) // past the retention under test
			if _, err := s.Purge(ctxT(t)); err != nil {
				t.Fatal(err)
			}
			r, err := idempotency.Do(ctxT(t), s, k, "fp", effect(k), short)
			if err != nil || r.Replayed || l.count(k) != 2 || len(keys) != 2 {
				t.Fatalf("after the retention: %+v, %v, runs %d, effect keys %d; want a new run under a new effect key (the documented end of the promise)", r, err, l.count(k), len(keys))
			}
			for _, discard := range []bool{false, true} {
				forever := &idempotency.Options{Retention: idempotency.Forever, DiscardResult: discard}
				k := key()
				if _, err := idempotency.Do(ctxT(t), s, k, "fp", effect(k), forever); err != nil {
					t.Fatal(err)
				}
				time.Sleep(100 * time.Millisecond)
				if _, err := s.Purge(ctxT(t)); err != nil {
					t.Fatal(err)
				}
				r, err := idempotency.Do(ctxT(t), s, k, "fp", effect(k), short)
				switch {
				case l.count(k) != 1:
					t.Fatalf("Forever (discard %v): the effect ran %d times", discard, l.count(k))
				case discard && !errors.Is(err, idempotency.ErrResultNotStored):
					t.Fatalf("Forever, results discarded: %+v, %v; want ErrResultNotStored", r, err)
				case !discard && (err != nil || !r.Replayed || string(r.Value) != "charged "+k):
					t.Fatalf("Forever: %+v, %v; want the replay", r, err)
				}
				rec, err := s.Get(ctxT(t), k)
				if err != nil || rec.State != idempotency.Completed {
					t.Fatalf("Forever: record %+v, %v", rec, err)
				}
			}
		})
	}
}

// In Do itself: when the caller's ctx ends, the effect's ctx
// is cancelled, but renewals go on while the effect runs: another caller gets
// ErrInProgress (never a takeover, even with a Reconcile hook that says "not
// done"), then the result.
func TestRenewalsOutliveCaller(t *testing.T) {
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			lease := 600 * time.Millisecond // renewals every 200ms, under load too
			k := key()
			var runs, reconciles atomic.Int32
			release, cancelled := make(chan struct{}), make(chan struct{})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() {
				_, err := idempotency.Do(ctx, s, k, "fp", func(ectx context.Context, _ string) ([]byte, error) {
					runs.Add(1)
					cancel()
					<-ectx.Done()
					close(cancelled)
					<-release // ignores its context
					return []byte("done"), nil
				}, &idempotency.Options{Lease: lease})
				done <- err
			}()
			<-cancelled
			time.Sleep(2 * lease) // the time under test: renewals alone keep the key
			o := &idempotency.Options{Lease: lease, Reconcile: func(context.Context, string) (bool, []byte, error) {
				reconciles.Add(1)
				return false, nil, nil
			}}
			_, err := idempotency.Do(ctxT(t), s, k, "fp", func(context.Context, string) ([]byte, error) { runs.Add(1); return nil, nil }, o)
			close(release)
			if !errors.Is(err, idempotency.ErrInProgress) {
				t.Fatalf("another caller while the first effect runs: %v; want ErrInProgress", err)
			}
			if err := <-done; err != nil {
				t.Fatalf("the first call, whose caller left: %v", err)
			}
			o.Wait = true
			r, err := idempotency.Do(ctxT(t), s, k, "fp", func(context.Context, string) ([]byte, error) { runs.Add(1); return nil, nil }, o)
			if err != nil || string(r.Value) != "done" || !r.Replayed || runs.Load() != 1 || reconciles.Load() != 0 {
				t.Fatalf("after: %+v, %v, runs %d, reconciles %d; want the replay of the one run", r, err, runs.Load(), reconciles.Load())
			}
		})
	}
}

// twoStepBegin answers Begin as a store that claims in one statement and reads
// the record in a second would, when the record changes between the two: after
// a real Begin that found the key armed, it lets the owner go on (next), waits
// for the key to be released, and answers with the released record.
type twoStepBegin struct {
	idempotency.Store
	next chan struct{}
}

func (s twoStepBegin) Begin(ctx context.Context, key, fp, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	rec, created, err := s.Store.Begin(ctx, key, fp, owner, lease)
	if err != nil || created || rec.State != idempotency.Armed || s.next == nil {
		return rec, created, err
	}
	close(s.next)
	for {
		got, err := s.Store.Get(ctx, key)
		if err != nil || got.State == idempotency.Released {
			return got, false, err
		}
		select {
		case <-ctx.Done():
			return got, false, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// A Begin answered with a record released in the meantime claims the key
// again, instead of failing with "unexpected state released".
func TestBeginSeesRelease(t *testing.T) {
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			k := key()
			next, armed := make(chan struct{}), make(chan struct{})
			first := make(chan error, 1)
			go func() {
				_, err := idempotency.Do(ctxT(t), s, k, "fp", func(context.Context, string) ([]byte, error) {
					close(armed)
					<-next
					return nil, idempotency.NotSent(errors.New("the provider refused the request unread"))
				}, nil)
				first <- err
			}()
			<-armed
			var l ledger
			r, err := idempotency.Do(ctxT(t), twoStepBegin{s, next}, k, "fp", l.effect(k), nil)
			if err != nil || string(r.Value) != "charged "+k || l.count(k) != 1 {
				t.Fatalf("Begin answered with a released record: %+v, %v, runs %d; want a claim and a run", r, err, l.count(k))
			}
			if err := <-first; err == nil {
				t.Error("the first call's NotSent error was lost")
			}
		})
	}
}

// lateTwoStepBegin is twoStepBegin from the Begin after waits of them on:
// the caller has waited that many times for the key's owner first.
type lateTwoStepBegin struct {
	twoStepBegin
	waits *atomic.Int32
}

func (s lateTwoStepBegin) Begin(ctx context.Context, key, fp, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	if s.waits.Add(-1) >= 0 {
		return s.Store.Begin(ctx, key, fp, owner, lease)
	}
	return s.twoStepBegin.Begin(ctx, key, fp, owner, lease)
}

// A caller that waited many times for another owner (Wait) and then gets a
// Begin answered with a record released in the meantime claims the key
// again too: its waits do not use up the tries it has for a released record.
func TestBeginSeesReleaseAfterLongWait(t *testing.T) {
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			k := key()
			next, armed := make(chan struct{}), make(chan struct{})
			first := make(chan error, 1)
			go func() {
				_, err := idempotency.Do(ctxT(t), s, k, "fp", func(context.Context, string) ([]byte, error) {
					close(armed)
					<-next
					return nil, idempotency.NotSent(errors.New("the provider refused the request unread"))
				}, nil)
				first <- err
			}()
			<-armed
			var (
				l     ledger
				waits atomic.Int32
			)
			waits.Store(12)
			r, err := idempotency.Do(ctxT(t), lateTwoStepBegin{twoStepBegin{s, next}, &waits}, k, "fp", l.effect(k), &idempotency.Options{Wait: true})
			if err != nil || string(r.Value) != "charged "+k || l.count(k) != 1 {
				t.Fatalf("after %d waits, Begin answered with a released record: %+v, %v, runs %d; want a claim and a run", 12-max(waits.Load(), 0), r, err, l.count(k))
			}
			if err := <-first; err == nil {
				t.Error("the first call's NotSent error was lost")
			}
		})
	}
}

// A lease shorter than the stores' millisecond resolution and the local drift
// margin (1% + 2ms) is no lease: the store records it as already expired, so a
// second caller whose Reconcile hook says "not done" (the provider has not
// seen the first charge yet, it is still running) takes the key over and
// charges again, while the first effect runs. Do refuses such a lease, or
// keeps the key while the effect runs: one charge per key either way.
func TestTinyLeaseNeverRunsTwice(t *testing.T) {
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			for _, lease := range []time.Duration{time.Nanosecond, 500 * time.Microsecond, 2 * time.Millisecond} {
				k := key()
				var runs atomic.Int32
				notDone := func(context.Context, string) (bool, []byte, error) { return false, nil, nil }
				opts := &idempotency.Options{Lease: lease, Reconcile: notDone}
				var second error
				_, first := idempotency.Do(ctxT(t), s, k, "fp", func(ctx context.Context, ek string) ([]byte, error) {
					runs.Add(1)
					// A retry arrives while the charge is in flight.
					_, second = idempotency.Do(ctxT(t), s, k, "fp", func(context.Context, string) ([]byte, error) {
						runs.Add(1)
						return []byte("second charge"), nil
					}, &idempotency.Options{Lease: time.Second, Reconcile: notDone})
					return []byte("first charge"), nil
				}, opts)
				if n := runs.Load(); n > 1 {
					t.Fatalf("lease %v: the effect ran %d times for one key (first: %v; retry during the run: %v)", lease, n, first, second)
				}
				if runs.Load() == 0 && !errors.Is(first, fence.ErrInvalid) {
					t.Fatalf("lease %v: the effect did not run, and Do said %v, not ErrInvalid", lease, first)
				}
			}
		})
	}
}

// An operator who finds that an unknown key's charge did happen resolves it
// as completed for good: Resolve with Retention Forever keeps the record (as
// Do's Forever does) on every store, and the key never runs again.
func TestResolveForever(t *testing.T) {
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			k := key()
			rec, _, err := s.Begin(ctxT(t), k, "fp", "crashed", time.Minute)
			if err == nil {
				rec, err = s.Update(ctxT(t), k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "crashed", Lease: time.Minute})
			}
			if err == nil {
				rec, err = s.Update(ctxT(t), k, idempotency.Armed, rec.Fence, idempotency.Change{State: idempotency.Unknown, Fence: rec.Fence, Owner: "crashed"})
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := idempotency.Resolve(ctxT(t), s, k, rec.Fence, idempotency.Completed, []byte("charged"), idempotency.Forever); err != nil {
				t.Fatalf("Resolve with Retention Forever: %v", err)
			}
			var l ledger
			r, err := idempotency.Do(ctxT(t), s, k, "fp", l.effect(k), nil)
			if err != nil || !r.Replayed || string(r.Value) != "charged" || l.count(k) != 0 {
				t.Fatalf("after Resolve: %+v, %v, runs %d; want the resolved result replayed", r, err, l.count(k))
			}
		})
	}
}

// A takeover whose reply was lost landed: the key is this caller's claim. Do
// goes on with it (one run, its result) instead of a bare transport error or
// ErrInProgress against its own claim, which leaves the key held by nobody
// for a whole lease.
func TestLostTakeoverReply(t *testing.T) {
	for name, f := range faultyStores(t) {
		t.Run(name, func(t *testing.T) {
			for _, armed := range []bool{true, false} {
				k := key()
				lease := 300 * time.Millisecond
				if armed {
					// An owner that stops after arming, and a Reconcile hook that
					// finds its effect did not happen.
					_, err := idempotency.Do(ctxT(t), f.Store, k, "fp", func(context.Context, string) ([]byte, error) {
						return nil, errors.New("connection to the provider reset")
					}, &idempotency.Options{Lease: lease})
					if err == nil {
						t.Fatal("the ambiguous effect returned no error")
					}
				} else if _, _, err := f.Store.Begin(ctxT(t), k, "fp", "crashed", lease); err != nil { // a claim whose owner crashed before arming
					t.Fatal(err)
				}
				for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
					if rec, err := f.Store.Get(ctxT(t), k); err == nil && rec.LeaseLeft <= 0 {
						break
					}
					if time.Now().After(deadline) {
						t.Fatal("the lease never ran out")
					}
				}
				lost := f.Proxy.Stats().LostReplies
				// The takeover is the first update of k from here, to claimed.
				f.Proxy.LoseReply(func(b []byte) bool { return bytes.Contains(b, []byte(k)) && bytes.Contains(b, []byte("claimed")) })
				var l ledger
				notDone := func(context.Context, string) (bool, []byte, error) { return false, nil, nil }
				r, err := idempotency.Do(ctxT(t), f.Store, k, "fp", l.effect(k), &idempotency.Options{Lease: 2 * time.Second, Reconcile: notDone})
				if f.Proxy.Pending() != 0 || f.Proxy.Stats().LostReplies == lost {
					t.Fatalf("armed %v: the takeover's reply was never lost", armed)
				}
				rec, gerr := f.Store.Get(ctxT(t), k)
				if err != nil || string(r.Value) != "charged "+k || l.count(k) != 1 || gerr != nil || rec.State != idempotency.Completed {
					t.Fatalf("armed %v, the takeover's reply lost: %+v, %v, runs %d; record %+v, %v; want one run and its result", armed, r, err, l.count(k), rec, gerr)
				}
			}
		})
	}
}

// A CompleteTimeout too short for any round trip to the store (10, meant as
// seconds, is 10ns) is accepted and then fails every completion: the charge
// happens and its result is never recorded, so every key is left armed, then
// unknown. Do refuses it, naming the option, before the effect runs.
func TestTinyCompleteTimeout(t *testing.T) {
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			var l ledger
			k := key()
			_, err := idempotency.Do(ctxT(t), s, k, "fp", l.effect(k), &idempotency.Options{CompleteTimeout: 10})
			if l.count(k) != 0 || !errors.Is(err, fence.ErrInvalid) {
				rec, _ := s.Get(ctxT(t), k)
				t.Fatalf("CompleteTimeout 10ns: %v, effect ran %d times, record %s; want ErrInvalid before the effect", err, l.count(k), rec.State)
			}
		})
	}
}

// An InProgressCeiling under the lease (5, meant as minutes, is 5ns) is
// accepted and then cancels every effect at its first renewal, Lease/3 after
// it started, and stops the renewals: Do refuses it, naming the option, before
// the effect runs.
func TestCeilingUnderLease(t *testing.T) {
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			k := key()
			var runs atomic.Int32
			var cause error
			_, err := idempotency.Do(ctxT(t), s, k, "fp", func(ctx context.Context, _ string) ([]byte, error) {
				runs.Add(1)
				select { // a card network call that takes a while
				case <-ctx.Done():
					cause = context.Cause(ctx)
					return nil, idempotency.NotSent(cause)
				case <-time.After(2 * time.Second):
					return []byte("charged"), nil
				}
			}, &idempotency.Options{Lease: 300 * time.Millisecond, InProgressCeiling: 5})
			if runs.Load() != 0 || !errors.Is(err, fence.ErrInvalid) {
				t.Fatalf("InProgressCeiling 5ns: %v (effect ran %d times, its context ended with %v); want ErrInvalid before the effect", err, runs.Load(), cause)
			}
		})
	}
}

// stuckRenewals is a store whose lease renewals (armed -> armed) hang until
// their context ends, as they would with the store cut off.
type stuckRenewals struct{ idempotency.Store }

func (f stuckRenewals) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if from == idempotency.Armed && ch.State == idempotency.Armed {
		<-ctx.Done()
		return idempotency.Record{}, fmt.Errorf("injected: renewal timed out: %w", ctx.Err())
	}
	return f.Store.Update(ctx, k, from, ff, ch)
}

// TestEffectErrReadsTheClock: an effect that checks ctx.Err() once its lease's
// local deadline has passed sees the lease lost, even when the timer that
// cancels its context has not run yet (the scheduler is busy: here the effect
// itself holds the only P, spinning without a blocking call). Without it, a
// loaded machine let the store accept another owner's takeover while the
// first effect's ctx.Err() was still nil (RenewalFailureCancelsEffect on NATS,
// in a run of the whole test command with two busy loops).
func TestEffectErrReadsTheClock(t *testing.T) {
	const lease = 500 * time.Millisecond
	st := stuckRenewals{stores(t)["sqlite"]}
	for i := range 5 {
		var errAtDeadline, causeAtDeadline error
		func() {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
			_, _ = idempotency.Do(ctxT(t), st, key(), "fp", func(ctx context.Context, _ string) ([]byte, error) {
				// The local deadline is at most lease less the drift
				// after the arm was sent, which was before now.
				end := time.Now().Add(lease - lease/100 - 2*time.Millisecond)
				for time.Now().Before(end) {
				}
				errAtDeadline, causeAtDeadline = ctx.Err(), context.Cause(ctx)
				<-ctx.Done()
				return nil, ctx.Err()
			}, &idempotency.Options{Lease: lease})
		}()
		if errAtDeadline == nil {
			t.Fatalf("round %d: ctx.Err() right after the local deadline: nil, want the lease lost", i)
		}
		if !errors.Is(causeAtDeadline, fence.ErrLost) {
			t.Fatalf("round %d: cause %v, want fence.ErrLost", i, causeAtDeadline)
		}
	}
}

// lateArmReply is a store whose arm's reply comes late: the arm lands, then,
// before its reply, another caller waits out the lease, finds nothing done,
// takes the key over and completes it.
type lateArmReply struct {
	idempotency.Store
	other func(ctx context.Context)
}

func (s lateArmReply) Update(ctx context.Context, k string, from idempotency.State, ff fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	rec, err := s.Store.Update(ctx, k, from, ff, ch)
	if err == nil && from == idempotency.Claimed && ch.State == idempotency.Armed {
		s.other(ctx)
	}
	return rec, err
}

// An arm whose reply comes after its lease's local deadline does not start
// the effect: another caller may have taken the key over and completed it by
// then, under another effect key, so a second run could not be told apart.
func TestLateArmReplyDoesNotStartEffect(t *testing.T) {
	const lease = 150 * time.Millisecond
	for name, s := range stores(t) {
		t.Run(name, func(t *testing.T) {
			k := key()
			var l ledger
			var other idempotency.Result
			var otherErr error
			notDone := func(context.Context, string) (bool, []byte, error) { return false, nil, nil }
			late := lateArmReply{Store: s, other: func(ctx context.Context) {
				other, otherErr = idempotency.Do(ctx, s, k, "fp", l.effect(k),
					&idempotency.Options{Lease: lease, Wait: true, Reconcile: notDone})
			}}
			started := false
			_, err := idempotency.Do(ctxT(t), late, k, "fp", func(context.Context, string) ([]byte, error) {
				started = true
				return []byte("second"), nil
			}, &idempotency.Options{Lease: lease})
			if otherErr != nil || string(other.Value) != "charged "+k || l.count(k) != 1 {
				t.Fatalf("the other caller: %+v, %v, runs %d; want it to take the key over and run", other, otherErr, l.count(k))
			}
			if started || !errors.Is(err, fence.ErrLost) {
				t.Fatalf("the caller whose arm reply came late: started %v, %v; want no start and an error matching fence.ErrLost", started, err)
			}
			rec, gerr := s.Get(ctxT(t), k)
			if gerr != nil || rec.State != idempotency.Completed || string(rec.Result) != "charged "+k {
				t.Fatalf("the record: %+v, %v; want the other caller's completion", rec, gerr)
			}
		})
	}
}
