// Package fencetest holds the conformance suites that every fencekit adapter runs
// against a real backend, in the manner of gocloud.dev's drivertest: the adapter
// supplies a constructor, the suite supplies a flat list of subtests that assert
// the documented contract of package fence.
//
// # The nemesis
//
// The suites' cases test one fault at a time. NemesisSuite runs random calls
// from several clients, each behind a faultnet proxy of its own, while a
// seeded nemesis loses replies, adds latency, partitions clients and deletes
// lock state, and then checks the recorded history: token order, no two live
// leases of a name, no Renew succeeding after a newer grant, each key a
// linearizable fenced register (porcupine), and every name free again once
// the faults stop. A failure logs its seed and fault schedule;
// FENCETEST_NEMESIS_SEED=N replays the seed and FENCETEST_NEMESIS_DURATION=2m
// makes a soak run:
//
//	FENCETEST_NEMESIS_DURATION=2m go test -run TestMemoryNemesis ./fence/fencetest/
package fencetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"os"
	"regexp"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// AcquirerSuite is the conformance suite for a fence.Acquirer.
type AcquirerSuite struct {
	// New returns an acquirer on a live backend. Tests use fresh random lock names,
	// so one backend may serve every test. Required.
	New func(t *testing.T) fence.Acquirer

	// ShortTTL is the lease length of tests that wait for a lease to expire; it must
	// be at least the backend's minimum ttl. Default: 150ms.
	ShortTTL time.Duration

	// ExpiryLag is how long past a lease's ttl the backend may still hold a
	// name nobody renewed, on a loaded machine: a server that expires keys on
	// a timer of its own and then writes a marker (NATS's per-message TTLs)
	// frees the name later than its clock's deadline. The cases that wait for
	// an expiry wait this much longer, and LateRenewHoldsNothing makes its
	// lease at least three times as long, so that a name freed by the expiry
	// is still told apart from one a late Renew held for a new ttl.
	// Default: 0 (the name is free once its ttl has run on the backend).
	ExpiryLag time.Duration

	// RenewTTL is the least lease length of the cases that keep a lease
	// alive by renewing it every third of its ttl (RenewExtends,
	// HoldRunsAndReleases), which run for three ttls each: a renewal must
	// be confirmed within two thirds of it, also on a loaded machine.
	// Default: 5s.
	RenewTTL time.Duration

	// Workers and Increments size the mutual-exclusion test.
	// Default: 20 workers x 25 increments (the lesson uses 20 x 50).
	Workers, Increments int

	// MaxTTL is the longest ttl the acquirer documents. A ttl up to it must be
	// granted and exclude others; one past it must be refused with ErrInvalid.
	// Default: the largest time.Duration (no limit of its own).
	MaxTTL time.Duration

	// BadNames are lock names the backend cannot store, beside the empty name,
	// which every acquirer must refuse with ErrInvalid before any request.
	BadNames []string

	// NewOther returns an acquirer independent of the ones New returns: its own
	// client, connection pool or database handle on the same backend, as a
	// second process would have. Cases that mean two processes (mutual
	// exclusion, a new holder after an expiry, a second acquirer's TryAcquire)
	// take one acquirer from New and one from NewOther.
	// Default: New, called again (which shares whatever New shares).
	NewOther func(t *testing.T) fence.Acquirer

	// SetCounter, when set, makes the backend's token counter for name say that
	// tok was the last token granted, with no holder, so the next grant would
	// carry tok+1. The TokensExhausted case uses it to bring a counter to
	// MaxToken. Default: the acquirer's Bump when it is a fence.Bumper;
	// without either, that case is skipped with a logged reason.
	SetCounter func(t *testing.T, name string, tok fence.Token)

	// Faulty, when set, returns an acquirer with a client of its own that
	// reaches the backend only through the returned proxy, and nothing else
	// uses that proxy. The lost-reply cases arm the proxy to lose the reply
	// of the next request after a warm-up grant. When Faulty is nil, or the
	// environment variable named by LostReplyEnv is "0", they are skipped
	// with a logged reason.
	Faulty func(t *testing.T) (fence.Acquirer, *faultnet.Proxy)

	// DeleteState, when set, removes every piece of state the backend keeps
	// for lock name (the lease row, the Redis keys, the lock object, the
	// etcd or NATS key), as an operator's DELETE, a lifecycle rule, FLUSHALL
	// or an eviction would, while the caller may still hold a lease on it.
	// The TokensSurviveDeletedState case uses it to check that a
	// grant after the deletion carries a token above every token granted
	// before, or is refused with ErrTokensExhausted (ErrHeld fails the case:
	// the name's holder was deleted too, so nobody holds it), and that the
	// paused holder's Release does not free the new holder. When nil,
	// that case is skipped with a logged reason.
	DeleteState func(t *testing.T, name string)

	// Parallel runs the cases as parallel subtests on the same acquirers
	// (every case uses names of its own), so that a suite takes about as long
	// as its longest case instead of their sum (most of a case's time is spent
	// waiting for leases to expire). The cases then also run against each
	// other's load, and are named parallel/Case. Run returns once every case
	// has ended. Default: false, one case at a time.
	Parallel bool
}

// Name returns a fresh random lock name with prefix, for tests that share a backend.
func Name(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

// pastExpiry is the time by which a ShortTTL lease that the backend set no
// later than from is free on the backend: half a ttl of margin for clocks and
// a loaded machine, and the backend's ExpiryLag.
func (s AcquirerSuite) pastExpiry(from time.Time) time.Time {
	return from.Add(s.ShortTTL + s.ShortTTL/2 + s.ExpiryLag)
}

// Run runs every test of the suite as a subtest of t.
func (s AcquirerSuite) Run(t *testing.T) {
	if s.New == nil {
		t.Fatal("fencetest: AcquirerSuite.New is nil")
	}
	if s.RenewTTL <= 0 {
		s.RenewTTL = 5 * time.Second
	}
	if s.ShortTTL <= 0 {
		s.ShortTTL = 150 * time.Millisecond
	}
	if s.Workers <= 0 {
		s.Workers = 20
	}
	if s.Increments <= 0 {
		s.Increments = 25
	}
	if s.NewOther == nil {
		s.NewOther = s.New
	}
	tests := []struct {
		name string
		fn   func(*testing.T)
	}{
		{"MutualExclusion", s.testMutualExclusion},
		{"TokensIncrease", s.testTokensIncrease},
		{"TokensIncreaseAfterExpiry", s.testTokensIncreaseAfterExpiry},
		{"TryAcquireHeld", s.testTryAcquireHeld},
		{"NamesIndependent", s.testNamesIndependent},
		{"AcquireWaitsForRelease", s.testAcquireWaitsForRelease},
		{"AcquireGivesUpAtDeadline", s.testAcquireGivesUp},
		{"AcquireCancelled", s.testAcquireCancelled},
		{"AcquireContextDone", s.testAcquireContextDone},
		{"ExpiredReleaseDoesNotFreeNextHolder", s.testExpiredRelease},
		{"ReleaseTwice", s.testReleaseTwice},
		{"RenewExtends", s.testRenewExtends},
		{"ContextDoneAfterRelease", s.testContextAfterRelease},
		{"ContextDoneAfterLoss", s.testContextAfterLoss},
		{"HoldRunsAndReleases", s.testHold},
		{"BadInput", s.testBadInput},
		{"ExtremeTTLs", s.testExtremeTTLs},
		{"NilContext", s.testNilContext},
		{"StaleRenewKeepsNewHolder", s.testStaleRenew},
		{"LateRenewHoldsNothing", s.testLateRenew},
		{"NoGrantWhileHolderContextLive", s.testNoGrantWhileLive},
		{"TokensExhausted", s.testTokensExhausted},
		{"TokensSurviveDeletedState", s.testDeletedState},
		{"RenewLostAfterDeletedState", s.testRenewAfterDeletedState},
		{"LostReplyTryAcquire", s.lostReply(s.testLostReplyGrant(false))},
		{"LostReplyAcquire", s.lostReply(s.testLostReplyGrant(true))},
		{"LostReplyRenew", s.lostReply(s.testLostReplyRenew)},
		{"LostReplyRenewThenRenew", s.lostReply(s.testLostReplyRenewThenRenew)},
		{"LostReplyRelease", s.lostReply(s.testLostReplyRelease)},
	}
	if only := os.Getenv(CasesEnv); only != "" {
		re, err := regexp.Compile(only)
		if err != nil {
			t.Fatalf("fencetest: %s=%q: %v", CasesEnv, only, err)
		}
		tests = slices.DeleteFunc(tests, func(tc struct {
			name string
			fn   func(*testing.T)
		}) bool {
			return !re.MatchString(tc.name)
		})
	}
	if !s.Parallel {
		for _, tc := range tests {
			t.Run(tc.name, tc.fn)
		}
		return
	}
	// One group, so that Run returns only once every case has ended (a
	// parallel subtest starts only after its parent's function returns).
	t.Run("parallel", func(t *testing.T) {
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				t.Parallel()
				tc.fn(t)
			})
		}
	})
}

const longTTL = 30 * time.Second

// CasesEnv names an environment variable: when set, to a regular expression,
// the suites run only the cases whose names match it (for a developer who
// wants one case on every backend: FENCETEST_CASES=AcquireContextDone go test
// ./...; go test -run cannot name a case at every nesting depth at once).
const CasesEnv = "FENCETEST_CASES"

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func release(t *testing.T, l fence.Lease) {
	t.Helper()
	if err := l.Release(context.Background()); err != nil {
		t.Errorf("Release(%s, token %d): %v", l.Name(), l.Token(), err)
	}
}

func mustTry(t *testing.T, a fence.Acquirer, name string, ttl time.Duration) fence.Lease {
	t.Helper()
	return TryLive(ctxT(t), t, a, name, ttl)
}

// TryLive is TryAcquire for a test that needs a live lease to go on: it fails
// t on any error but ErrLost, and asks again, at most twice, on ErrLost (a
// grant confirmed after the lease's local deadline and given back, which a
// loaded machine produces with short leases). A try after ErrLost waits (an
// Acquire of at most the ttl and 10s) rather than tries: a backend may give
// the late grant back in the background, and until then the name is held by
// it. It also checks the lease's token is valid and its name is the one
// asked for.
func TryLive(ctx context.Context, t testing.TB, a fence.Acquirer, name string, ttl time.Duration) fence.Lease {
	t.Helper()
	l, err := a.TryAcquire(ctx, name, ttl)
	for try := 1; try < 3 && errors.Is(err, fence.ErrLost); try++ {
		t.Logf("TryAcquire(%q, %v), try %d: %v: waiting for the name", name, ttl, try, err)
		wctx, cancel := context.WithTimeout(ctx, ttl+10*time.Second)
		l, err = a.Acquire(wctx, name, ttl)
		cancel()
	}
	if err != nil {
		t.Fatalf("TryAcquire(%q, %v): %v", name, ttl, err)
	}
	if !l.Token().Valid() {
		t.Fatalf("TryAcquire(%q) granted invalid token %d", name, l.Token())
	}
	if l.Name() != name {
		t.Fatalf("lease name = %q, want %q", l.Name(), name)
	}
	return l
}

// testMutualExclusion: workers do a non-atomic read-modify-write of a shared
// counter under the lease; the result is exact and no two holders overlap.
// Half the workers use New's acquirer, half NewOther's, as two processes would.
func (s AcquirerSuite) testMutualExclusion(t *testing.T) {
	acqs := [2]fence.Acquirer{s.New(t), s.NewOther(t)}
	name := Name("mutex")
	var (
		// counter is read and written in two separate steps; mu only keeps the race
		// detector quiet (it cannot see the backend's ordering). Only the lease
		// prevents lost updates.
		counter   int
		mu        sync.Mutex
		inside    atomic.Int32
		overlaps  atomic.Int32
		lastToken atomic.Uint64
		badOrder  atomic.Int32
	)
	var wg sync.WaitGroup
	errs := make(chan error, s.Workers)
	for w := 0; w < s.Workers; w++ {
		wg.Add(1)
		a := acqs[w%2]
		go func() {
			defer wg.Done()
			for i := 0; i < s.Increments; i++ {
				l, err := a.Acquire(ctxT(t), name, longTTL)
				if err != nil {
					errs <- err
					return
				}
				if inside.Add(1) != 1 {
					overlaps.Add(1)
				}
				if prev := lastToken.Swap(uint64(l.Token())); prev >= uint64(l.Token()) {
					badOrder.Add(1)
				}
				mu.Lock()
				v := counter
				mu.Unlock()
				time.Sleep(50 * time.Microsecond) // widen the window a lost update needs
				mu.Lock()
				counter = v + 1
				mu.Unlock()
				inside.Add(-1)
				if err := l.Release(context.Background()); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("worker: %v", err)
	}
	if want := s.Workers * s.Increments; counter != want {
		t.Errorf("counter = %d after %d locked increments: lost updates", counter, want)
	}
	if n := overlaps.Load(); n != 0 {
		t.Errorf("%d grants overlapped another holder", n)
	}
	if n := badOrder.Load(); n != 0 {
		t.Errorf("%d grants carried a token not larger than the previous grant's", n)
	}
}

func (s AcquirerSuite) testTokensIncrease(t *testing.T) {
	a := s.New(t)
	name := Name("tokens")
	var prev fence.Token
	for i := 0; i < 10; i++ {
		l := mustTry(t, a, name, longTTL)
		if l.Token() <= prev {
			t.Fatalf("grant %d: token %d not larger than previous %d", i, l.Token(), prev)
		}
		prev = l.Token()
		release(t, l)
	}
}

func (s AcquirerSuite) testTokensIncreaseAfterExpiry(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("expiry")
	l1 := mustTry(t, a, name, s.ShortTTL)
	time.Sleep(time.Until(s.pastExpiry(time.Now())))
	l2 := mustTry(t, b, name, longTTL)
	defer release(t, l2)
	if l2.Token() <= l1.Token() {
		t.Fatalf("re-grant after expiry: token %d not larger than expired grant's %d", l2.Token(), l1.Token())
	}
}

// tryBound is how long a TryAcquire on a held lease may take on a loaded
// machine beyond twice a grant of a free name by the same acquirer, measured
// just before: a few round trips (or one per node), never a wait for the
// holder. The measured part lets a slow backend (an emulator in one busy
// process) answer at its own pace without letting a wait of a second pass on
// a fast one.
const tryBound = 750 * time.Millisecond

// lateBound is how long after its context ended a waiting Acquire may take to
// return on a loaded machine, beyond twice a TryAcquire of the held name by
// the same acquirer, measured just before (lateAllowed): giving up may take a
// round trip or two (leaving the line, giving back a grant that landed), and
// a loaded machine stretches those (a PostgreSQL Acquire once took 521ms).
// A wait that does not watch its context (a backoff sleep) is late by its
// own length whatever the round trips take.
const lateBound = 400 * time.Millisecond

// lateAllowed is lateBound plus twice the time of a TryAcquire by b of name,
// which another holder holds: how late b's Acquire of name may return after
// its context ended.
func lateAllowed(t *testing.T, b fence.Acquirer, name string) time.Duration {
	t.Helper()
	start := time.Now()
	l, err := b.TryAcquire(ctxT(t), name, longTTL)
	took := time.Since(start)
	if err == nil {
		_ = l.Release(context.Background())
		t.Fatal("TryAcquire granted a held lease")
	}
	if !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("TryAcquire of a held lease: %v, want ErrHeld", err)
	}
	return lateBound + 2*took
}

func (s AcquirerSuite) testTryAcquireHeld(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("held")
	l := mustTry(t, a, name, longTTL)
	defer release(t, l)
	start := time.Now()
	release(t, mustTry(t, b, Name("free"), longTTL))
	bound := tryBound + 2*time.Since(start)
	// No deadline on ctx: an acquirer that waited instead of answering at once
	// would wait its whole maximum wait.
	start = time.Now()
	l2, err := b.TryAcquire(context.Background(), name, longTTL)
	if !errors.Is(err, fence.ErrHeld) {
		if l2 != nil {
			_ = l2.Release(context.Background())
		}
		t.Fatalf("TryAcquire on a held lease: err = %v, want ErrHeld", err)
	}
	if l2 != nil {
		t.Errorf("TryAcquire returned a lease together with ErrHeld")
	}
	if d := time.Since(start); d > bound {
		t.Errorf("TryAcquire on a held lease took %v (more than %v) instead of answering at once", d, bound)
	}
}

// testNamesIndependent: names that differ in any byte are different locks,
// also where a collation or a conversion would fold them into one (case, a
// trailing space, 4-byte characters, Unicode normalisation, a tab, a long
// name's last byte, a path a file system resolves). Holding the first of a
// pair must not block the second. A name spelled as such a path may instead
// be refused with ErrInvalid.
func (s AcquirerSuite) testNamesIndependent(t *testing.T) {
	a := s.New(t)
	la := mustTry(t, a, Name("a"), longTTL)
	lb := mustTry(t, a, Name("b"), longTTL)
	release(t, lb)
	// Released before the pairs: on a backend whose first grant of a name
	// waits for its clock (S3, about a second), the pairs can take longer
	// than a ttl on a loaded machine.
	release(t, la)
	for _, p := range confusablePairs(Name("names")) {
		if p.skip(s.BadNames) {
			continue
		}
		l1, err := a.TryAcquire(ctxT(t), p.a, longTTL)
		if errors.Is(err, fence.ErrInvalid) && p.long {
			l2, err2 := a.TryAcquire(ctxT(t), p.b, longTTL)
			if errors.Is(err2, fence.ErrInvalid) {
				t.Logf("%s: both names refused with ErrInvalid (a length limit below %d bytes): %v", p.what, len(p.a), err)
				continue
			}
			if l2 != nil {
				_ = l2.Release(context.Background())
			}
			t.Errorf("%s: one name refused (%v), the other of the same length not (%v)", p.what, err, err2)
			continue
		}
		if errors.Is(err, fence.ErrInvalid) && p.path {
			// Refused rather than merged: the plain name must still work.
			if l2, err2 := a.TryAcquire(ctxT(t), p.b, longTTL); err2 != nil {
				t.Errorf("%s: %s refused (%v), and TryAcquire(%s): %v, want a grant", p.what, shortName(p.a), err, shortName(p.b), err2)
			} else {
				release(t, l2)
			}
			t.Logf("%s: name %s refused with ErrInvalid: %v", p.what, shortName(p.a), err)
			continue
		}
		if err != nil {
			t.Errorf("%s: TryAcquire(%s): %v", p.what, shortName(p.a), err)
			continue
		}
		l2, err := a.TryAcquire(ctxT(t), p.b, longTTL)
		if err != nil {
			t.Errorf("%s: while %s is held, TryAcquire(%s): %v, want a grant: the two names share one lock", p.what, shortName(p.a), shortName(p.b), err)
		} else {
			if l2.Name() != p.b {
				t.Errorf("%s: lease name = %s, want %s", p.what, shortName(l2.Name()), shortName(p.b))
			}
			release(t, l2)
		}
		// The first lease is still held after the second came and went.
		if l3, err := a.TryAcquire(ctxT(t), p.a, longTTL); !errors.Is(err, fence.ErrHeld) {
			if l3 != nil {
				_ = l3.Release(context.Background())
			}
			t.Errorf("%s: after the lease on %s was released, TryAcquire(%s) = %v, want ErrHeld", p.what, shortName(p.b), shortName(p.a), err)
		}
		release(t, l1)
	}
}

func (s AcquirerSuite) testAcquireWaitsForRelease(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("wait")
	l1 := mustTry(t, a, name, longTTL)
	var released atomic.Bool
	go func() {
		time.Sleep(100 * time.Millisecond)
		released.Store(true)
		_ = l1.Release(context.Background())
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	l2, err := b.Acquire(ctx, name, longTTL)
	if err != nil {
		t.Fatalf("Acquire waiting for a release: %v", err)
	}
	defer release(t, l2)
	if !released.Load() {
		t.Fatalf("Acquire granted %q while the first holder had not released", name)
	}
	if l2.Token() <= l1.Token() {
		t.Errorf("token after handoff %d not larger than %d", l2.Token(), l1.Token())
	}
}

// testAcquireGivesUp: Acquire returns soon after its deadline (at most
// lateAllowed later), with ErrHeld joined with DeadlineExceeded.
func (s AcquirerSuite) testAcquireGivesUp(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("giveup")
	l := mustTry(t, a, name, longTTL)
	defer release(t, l)
	late := lateAllowed(t, b, name)
	const wait = 200 * time.Millisecond
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	l2, err := b.Acquire(ctx, name, longTTL)
	if d := time.Since(start); d > wait+late {
		t.Errorf("Acquire with a %v deadline returned after %v, more than %v past its deadline", wait, d, late)
	}
	if err == nil {
		_ = l2.Release(context.Background())
		t.Fatal("Acquire granted a held lease")
	}
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Acquire past its deadline: err = %v, want ErrHeld joined with context.DeadlineExceeded", err)
	}
}

// testAcquireCancelled: a cancelled Acquire returns soon after the cancel (at
// most lateAllowed later), with ErrHeld joined with context.Canceled.
func (s AcquirerSuite) testAcquireCancelled(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("cancel")
	l := mustTry(t, a, name, longTTL)
	defer release(t, l)
	late := lateAllowed(t, b, name)
	ctx, cancel := context.WithCancel(context.Background())
	var cancelled atomic.Int64
	time.AfterFunc(100*time.Millisecond, func() {
		cancelled.Store(time.Now().UnixNano())
		cancel()
	})
	l2, err := b.Acquire(ctx, name, longTTL)
	if at := cancelled.Load(); at == 0 {
		t.Errorf("Acquire returned before it was cancelled (err %v)", err)
	} else if d := time.Since(time.Unix(0, at)); d > late {
		t.Errorf("Acquire returned %v after it was cancelled, more than %v", d, late)
	}
	if err == nil {
		_ = l2.Release(context.Background())
		t.Fatal("Acquire granted a held lease")
	}
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled Acquire: err = %v, want ErrHeld joined with context.Canceled", err)
	}
}

// testAcquireContextDone: an Acquire whose context is already done when it is
// called gives up as any wait that ran out (ErrHeld joined with the context's
// error), at once, and grants nothing. The cancel of AcquireCancelled can land
// before the Acquire's first step on a loaded machine: sqlfence answered that
// with the bare context error (a full run with -p 24).
func (s AcquirerSuite) testAcquireContextDone(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("ctxdone")
	l := mustTry(t, a, name, longTTL)
	defer release(t, l)
	late := lateAllowed(t, b, name)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	l2, err := b.Acquire(ctx, name, longTTL)
	if err == nil {
		_ = l2.Release(context.Background())
		t.Fatal("Acquire with a done context granted a held lease")
	}
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) {
		t.Errorf("Acquire with a done context: err = %v, want ErrHeld joined with context.Canceled", err)
	}
	if d := time.Since(start); d > late {
		t.Errorf("Acquire with a done context returned after %v, more than %v", d, late)
	}
}

// testExpiredRelease is the lesson's plain-DEL bug: A's lease expires, B takes the
// lock, A "releases". A's release must report the loss and leave B's lease alone.
func (s AcquirerSuite) testExpiredRelease(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("plaindel")
	la := mustTry(t, a, name, s.ShortTTL)
	time.Sleep(time.Until(s.pastExpiry(time.Now())))
	lb := mustTry(t, b, name, longTTL)
	defer release(t, lb)
	if err := la.Release(context.Background()); !errors.Is(err, fence.ErrLost) {
		t.Errorf("expired holder's Release: err = %v, want ErrLost", err)
	}
	if err := la.Renew(context.Background()); !errors.Is(err, fence.ErrLost) {
		t.Errorf("expired holder's Renew: err = %v, want ErrLost", err)
	}
	lc, err := a.TryAcquire(ctxT(t), name, longTTL)
	if !errors.Is(err, fence.ErrHeld) {
		if lc != nil {
			_ = lc.Release(context.Background())
		}
		t.Fatalf("after the expired holder released, a third client got %v, want ErrHeld: the release freed the new holder's lease", err)
	}
	if lb.Context().Err() != nil {
		t.Errorf("the new holder's context is done after the old holder's release: %v", context.Cause(lb.Context()))
	}
}

func (s AcquirerSuite) testReleaseTwice(t *testing.T) {
	a := s.New(t)
	name := Name("twice")
	l := mustTry(t, a, name, longTTL)
	release(t, l)
	l2 := mustTry(t, a, name, longTTL)
	defer release(t, l2)
	if err := l.Release(context.Background()); !errors.Is(err, fence.ErrLost) {
		t.Errorf("second Release: err = %v, want ErrLost", err)
	}
	if err := l.Renew(context.Background()); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew after Release: err = %v, want ErrLost", err)
	}
	if l2.Context().Err() != nil {
		t.Error("second Release of an old lease ended the new holder's lease")
	}
}

func (s AcquirerSuite) testRenewExtends(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("renew")
	ttl := s.renewTTL()
	prev := time.Now() // the send of the grant, then of each renewal
	l := mustTry(t, a, name, ttl)
	defer func() {
		// The case ends once its check is made; a lease whose local
		// deadline passed after it (a machine that stalled for two
		// thirds of the ttl since the last renewal) is lost by contract,
		// and its Release says so (seen on etcd on a loaded machine).
		if l.Context().Err() != nil {
			if err := l.Release(context.Background()); err != nil && !errors.Is(err, fence.ErrLost) {
				t.Errorf("Release of a lease past its local deadline: %v, want nil or ErrLost", err)
			}
			return
		}
		release(t, l)
	}()
	end := time.Now().Add(3 * ttl)
	// A check is conclusive when the other acquirer's answer came back
	// within a ttl of the last renewal's send: the renewed lease cannot have
	// expired on the server by then. On a machine too slow for that, the
	// renewals go on and the check is made again.
	for try := 0; ; try++ {
		var sent time.Time
		for {
			sent = time.Now()
			live := l.Context().Err() == nil
			if err := l.Renew(ctxT(t)); err != nil {
				// A Renew sent once the local deadline had passed, or
				// answered more than a ttl after the previous send (the
				// lease may have expired before it arrived), is lost by
				// contract: a machine too slow for the ttl, not a failed
				// renewal. Anything else fails.
				if !errors.Is(err, fence.ErrLost) || (live && time.Since(prev) < ttl) || try == 2 {
					t.Fatalf("Renew %v after the previous send (of a %v lease, the lease's context live when sent: %v): %v", sent.Sub(prev), ttl, live, err)
				}
				t.Logf("Renew %v after the previous send lost the %v lease on a slow machine: checking again on a new lease", sent.Sub(prev), ttl)
				_ = l.Release(context.Background())
				prev = time.Now()
				l = mustTry(t, a, name, ttl)
				end = time.Now().Add(ttl)
				try++
				continue
			}
			prev = sent
			if !sent.Before(end) {
				break
			}
			time.Sleep(ttl / 3)
		}
		if err := l.Context().Err(); err != nil {
			t.Fatalf("context of a renewed lease is done: %v", context.Cause(l.Context()))
		}
		l2, err := b.TryAcquire(ctxT(t), name, longTTL)
		answered := time.Now()
		if errors.Is(err, fence.ErrHeld) {
			return
		}
		if err != nil {
			t.Fatalf("TryAcquire of a held name: %v, want ErrHeld", err)
		}
		if l2 != nil {
			_ = l2.Release(context.Background())
		}
		if l.Context().Err() == nil {
			t.Fatalf("another acquirer was granted the lease while the renewed holder's context was live")
		}
		if answered.Before(sent.Add(ttl)) {
			t.Fatalf("TryAcquire granted the lease %v after the last renewal was sent, within its ttl %v: want ErrHeld", answered.Sub(sent), ttl)
		}
		if try == 2 {
			t.Fatalf("TryAcquire answered more than a ttl after the last renewal in 3 tries (last: %v): the renewals were never checked", answered.Sub(sent))
		}
		t.Logf("TryAcquire answered %v after the last renewal, more than the ttl %v: checking again", answered.Sub(sent), ttl)
		// The lease expired and was granted to b (now released): a new
		// holder for the next try.
		prev = time.Now()
		l = mustTry(t, a, name, ttl)
		end = time.Now().Add(ttl)
	}
}

// renewTTL is the lease of the cases that keep a lease alive by renewing it
// every third of its ttl: ShortTTL, but at least RenewTTL (5s), so that a renewal
// delayed on a loaded machine does not lose it, nor do the TryAcquire and the
// Release after the last renewal (a 150ms lease leaves a renewal under 100ms
// of slack; with 600ms a MySQL run under the whole test command once took
// longer than the lease between the last renewal and the release; with 1s,
// then with 2s, the in-process NATS server lost a Hold's lease in a run of
// the test command: a renewal every 667ms left 1.3s for a stalled process;
// with 3s the embedded etcd lost a Hold's lease in a run beside two busy
// loops: no renewal was confirmed within 2s).
func (s AcquirerSuite) renewTTL() time.Duration { return max(s.ShortTTL, s.RenewTTL) }

func (s AcquirerSuite) testContextAfterRelease(t *testing.T) {
	a := s.New(t)
	l := mustTry(t, a, Name("ctxrel"), longTTL)
	if err := l.Context().Err(); err != nil {
		t.Fatalf("context done before release: %v", err)
	}
	release(t, l)
	select {
	case <-l.Context().Done():
	case <-time.After(time.Second):
		t.Fatal("context not done after Release")
	}
}

func (s AcquirerSuite) testContextAfterLoss(t *testing.T) {
	a := s.New(t)
	l := mustTry(t, a, Name("ctxloss"), s.ShortTTL)
	// The backend ran the grant before its answer came back: its lease
	// ends at most a ttl after this (the request's send time is no bound:
	// a PostgreSQL grant that ran 100ms after it was sent, under load, was
	// still held 1.5 ttl after the send).
	granted := time.Now()
	select {
	case <-l.Context().Done():
	case <-time.After(s.ShortTTL + 2*time.Second):
		t.Fatal("context not done after the lease's ttl passed without renewal")
	}
	if !errors.Is(context.Cause(l.Context()), fence.ErrLost) {
		t.Errorf("context cause after expiry = %v, want ErrLost", context.Cause(l.Context()))
	}
	// The local deadline comes before the backend's expiry (drift margin); past
	// the backend's expiry, Release must report the loss.
	time.Sleep(time.Until(s.pastExpiry(granted)))
	if err := l.Release(context.Background()); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Release after expiry: %v, want ErrLost", err)
	}
}

func (s AcquirerSuite) testHold(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("hold")
	var token fence.Token
	ttl := s.renewTTL()
	err := fence.Hold(ctxT(t), a, name, ttl, func(ctx context.Context, l fence.Lease) error {
		token = l.Token()
		// Outlive the ttl several times: the watchdog must keep the lease.
		select {
		case <-time.After(3 * ttl):
		case <-ctx.Done():
		}
		// Both may be ready (select then picks either): a lost lease
		// is Hold's error below, not a reason to test the other.
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		l2, err := b.TryAcquire(context.Background(), name, longTTL)
		if l2 != nil {
			_ = l2.Release(context.Background())
		}
		// The lease may have been lost while TryAcquire ran (renewals
		// that failed for the whole ttl): then another may be granted,
		// but only once the lease's own context (whose Err reads the
		// clock; ctx learns of the end through a timer) has ended.
		if err == nil && l.Context().Err() != nil {
			return context.Cause(l.Context())
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Errorf("while Hold renewed the lease (its context live: %v), TryAcquire got %v, want ErrHeld", l.Context().Err() == nil, err)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("Hold: %v", err)
	}
	l := mustTry(t, b, name, longTTL)
	defer release(t, l)
	if l.Token() <= token {
		t.Errorf("token after Hold %d not larger than Hold's %d", l.Token(), token)
	}
}

func (s AcquirerSuite) testBadInput(t *testing.T) {
	a := s.New(t)
	ctx := ctxT(t)
	cases := []struct {
		what string
		name string
		ttl  time.Duration
	}{
		{"empty name", "", time.Second},
		{"zero ttl", Name("bad"), 0},
		{"negative ttl", Name("bad"), -time.Second},
		{"the most negative ttl", Name("bad"), math.MinInt64},
	}
	for _, n := range s.BadNames {
		what := n
		if len(what) > 40 {
			what = fmt.Sprintf("%.40q... (%d bytes)", n, len(n))
		}
		cases = append(cases, struct {
			what string
			name string
			ttl  time.Duration
		}{"name " + what, n, time.Second})
	}
	// Bad input is ErrInvalid also with a context already done: never
	// ErrHeld, which a caller may retry (a review of sqlfence's done-context
	// change found it answered an empty name so).
	done, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range cases {
		for _, op := range []struct {
			n string
			f func(context.Context, string, time.Duration) (fence.Lease, error)
		}{{"Acquire", a.Acquire}, {"TryAcquire", a.TryAcquire}} {
			for _, cc := range []struct {
				what string
				ctx  context.Context
			}{{"", ctx}, {" and a done context", done}} {
				l, err := op.f(cc.ctx, c.name, c.ttl)
				if !errors.Is(err, fence.ErrInvalid) || errors.Is(err, fence.ErrHeld) {
					if l != nil {
						_ = l.Release(context.Background())
					}
					t.Errorf("%s with %s%s: err = %v, want ErrInvalid (and not ErrHeld)", op.n, c.what, cc.what, err)
				}
			}
		}
	}
	err := fence.Hold(ctx, a, Name("bad"), time.Second, nil)
	if !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Hold with nil work: err = %v, want ErrInvalid", err)
	}
}

// testExtremeTTLs: the largest durations, and the acquirer's own maximum and one
// past it. A ttl up to MaxTTL is granted; one past it is refused with
// ErrInvalid. Whatever happens, a second acquirer never gets a lease that is
// already granted (the bug of a ttl whose rounding overflows).
func (s AcquirerSuite) testExtremeTTLs(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	max := s.MaxTTL
	if max <= 0 {
		max = math.MaxInt64
	}
	ttls := []time.Duration{math.MaxInt64, math.MaxInt64 - 1, max}
	if max < math.MaxInt64 {
		ttls = append(ttls, max+1, max+time.Second)
	}
	for _, ttl := range ttls {
		for _, op := range []string{"TryAcquire", "Acquire"} {
			name := Name("ttl")
			var (
				l   fence.Lease
				err error
			)
			if op == "TryAcquire" {
				l, err = a.TryAcquire(ctxT(t), name, ttl)
			} else {
				l, err = a.Acquire(ctxT(t), name, ttl)
			}
			if ttl > max {
				if !errors.Is(err, fence.ErrInvalid) {
					t.Errorf("%s with ttl %d, past the maximum %v: err = %v, want ErrInvalid", op, ttl, max, err)
				}
				if l != nil {
					_ = l.Release(context.Background())
				}
				continue
			}
			if err != nil {
				t.Errorf("%s with ttl %d (within the maximum %v): %v", op, ttl, max, err)
				continue
			}
			if l.Context().Err() != nil {
				t.Errorf("%s with ttl %d: the lease's context is already done", op, ttl)
			}
			l2, err := b.TryAcquire(ctxT(t), name, time.Second)
			if !errors.Is(err, fence.ErrHeld) {
				t.Errorf("a second acquirer while ttl %d is granted: %v, want ErrHeld: mutual exclusion is gone", ttl, err)
				if l2 != nil {
					_ = l2.Release(context.Background())
				}
			}
			if err := l.Renew(ctxT(t)); err != nil {
				t.Errorf("Renew of the ttl %d lease: %v", ttl, err)
			}
			release(t, l)
		}
	}
}

// testNilContext: every method that takes a context refuses a nil one with
// ErrInvalid (never a panic that could leave a handle locked).
func (s AcquirerSuite) testNilContext(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	var nilCtx context.Context
	name := Name("nilctx")
	if _, err := a.TryAcquire(nilCtx, name, longTTL); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("TryAcquire with a nil context: %v, want ErrInvalid", err)
	}
	if _, err := a.Acquire(nilCtx, name, longTTL); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Acquire with a nil context: %v, want ErrInvalid", err)
	}
	if err := fence.Hold(nilCtx, a, name, longTTL, func(context.Context, fence.Lease) error { return nil }); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Hold with a nil context: %v, want ErrInvalid", err)
	}
	l := mustTry(t, a, name, longTTL)
	if err := l.Renew(nilCtx); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Renew with a nil context: %v, want ErrInvalid", err)
	}
	if err := l.Release(nilCtx); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Release with a nil context: %v, want ErrInvalid", err)
	}
	// The refused calls changed nothing: the lease is still held and works.
	if _, err := b.TryAcquire(ctxT(t), name, longTTL); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("after the refused calls: %v, want ErrHeld", err)
	}
	release(t, l)
}

// testStaleRenew: A's lease expires, B is granted the name, then A renews. A
// gets ErrLost, and A's renewal must not touch B's lease on the backend: one
// ttl of A's later, the name is still B's. (A Renew that checks the expiry but
// not the holder's token would shorten B's lease to A's ttl, and a third
// client would be granted while B's context is live.)
func (s AcquirerSuite) testStaleRenew(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("stalerenew")
	la := mustTry(t, a, name, s.ShortTTL)
	// From the grant's answer: the backend set the lease no later than that
	// (a grant may take a while, e.g. S3's first grant of a name waits for
	// its clock), so its expiry is at most a ttl after it.
	granted := time.Now()
	time.Sleep(time.Until(s.pastExpiry(granted)))
	lb := mustTry(t, b, name, longTTL)
	defer release(t, lb)
	renewed := time.Now()
	if err := la.Renew(ctxT(t)); !errors.Is(err, fence.ErrLost) {
		t.Errorf("expired holder's Renew: err = %v, want ErrLost", err)
	}
	// Past the ttl the stale renewal would have set on the backend.
	time.Sleep(time.Until(s.pastExpiry(renewed)))
	lc, err := a.TryAcquire(ctxT(t), name, longTTL)
	if !errors.Is(err, fence.ErrHeld) {
		if lc != nil {
			_ = lc.Release(context.Background())
		}
		t.Fatalf("%v after the expired holder's Renew, a third client got %v, want ErrHeld: the stale Renew shortened the new holder's lease", time.Since(renewed), err)
	}
	if err := lb.Context().Err(); err != nil {
		t.Errorf("the new holder's context is done: %v", context.Cause(lb.Context()))
	}
	if err := lb.Renew(ctxT(t)); err != nil {
		t.Errorf("the new holder's Renew after the stale Renew: %v", err)
	}
}

// testLateRenew: a Renew asked for after the lease's context is
// done returns ErrLost and must not hold the name on the backend again, for
// nobody: another acquirer is granted well before a new ttl could run out. (A
// Renew that is sent whatever the lease's local state reaches the backend
// while the lease is still live there, inside the drift margin, and extends
// it: the holder believes it holds nothing and nobody can take the name.)
func (s AcquirerSuite) testLateRenew(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("laterenew")
	// Long enough that "granted within half a ttl of the Renew" tells a free
	// name (expired by the backend about when the local deadline passed, plus
	// its clock's granularity and its ExpiryLag) from one the Renew held for
	// a new ttl.
	ttl := max(2*s.ShortTTL, 2*time.Second, 3*s.ExpiryLag)
	la := mustTry(t, a, name, ttl)
	select {
	case <-la.Context().Done():
	case <-time.After(ttl + 30*time.Second):
		t.Fatalf("the context of a %v lease is not done after %v", ttl, ttl+30*time.Second)
	}
	renewed := time.Now()
	if err := la.Renew(ctxT(t)); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew after the lease's context was done: err = %v, want ErrLost", err)
	}
	bound := renewed.Add(ttl / 2)
	for {
		// The grant is what is checked; its lease is long enough that a
		// loaded machine still releases it before it ends.
		lb, err := b.TryAcquire(ctxT(t), name, longTTL)
		if err == nil {
			release(t, lb)
			return
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("TryAcquire after the late Renew: %v", err)
		}
		if time.Now().After(bound) {
			t.Fatalf("%v after a Renew of an ended %v lease, the name is still held: the late Renew held it on the backend again", time.Since(renewed), ttl)
		}
		time.Sleep(10 * time.Millisecond) // a poll, not a synchronisation
	}
}

// testNoGrantWhileLive is the core promise: the holder's context ends before
// anyone else can be granted the name. A second acquirer polls TryAcquire from
// the grant until the first lease's context is done; a grant while that
// context is live fails (a backend whose lease is shorter than the ttl, e.g. a
// ttl rounded down, does that).
func (s AcquirerSuite) testNoGrantWhileLive(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	// A grant that took longer than the ttl (a loaded machine) leaves no
	// time to try the name while the lease is live: the case then proved
	// nothing, and runs again on a lease twice as long.
	for ttl, try := s.ShortTTL, 1; ; ttl, try = 2*ttl, try+1 {
		tries, took := s.noGrantWhileLive(t, a, b, ttl)
		if tries > 0 {
			t.Logf("%d TryAcquire before the first %v lease's local deadline, %v after its request", tries, ttl, took)
			return
		}
		if try == 3 {
			t.Fatalf("the first lease's context was done before any TryAcquire (%v after the grant request of a %v lease, the third try): the case proved nothing; raise ShortTTL", took, ttl)
		}
		t.Logf("the first lease's context was done before any TryAcquire (%v after the grant request of a %v lease): trying with %v", took, ttl, 2*ttl)
	}
}

// noGrantWhileLive is one try of testNoGrantWhileLive with leases of ttl. It
// returns how many TryAcquire b made while a's lease was live, and when the
// lease's context was done after its grant request.
func (s AcquirerSuite) noGrantWhileLive(t *testing.T, a, b fence.Acquirer, ttl time.Duration) (int, time.Duration) {
	t.Helper()
	name := Name("core")
	before := time.Now()
	la := mustTry(t, a, name, ttl)
	defer func() { _ = la.Release(context.Background()) }()
	giveUp := before.Add(ttl + 10*time.Second)
	tries := 0
	for la.Context().Err() == nil {
		if time.Now().After(giveUp) {
			t.Fatalf("the context of a %v lease is not done after %v", ttl, time.Since(before))
		}
		l, err := b.TryAcquire(ctxT(t), name, ttl)
		tries++
		// ErrLost: the backend granted the name, but confirmed it only
		// after the new lease's local deadline (a slow machine), and gave
		// it back. It is judged as a grant, made no later than now.
		if late := errors.Is(err, fence.ErrLost); err == nil || late {
			at := time.Since(before)
			live := la.Context().Err() == nil
			if !late {
				_ = l.Release(context.Background())
			}
			// Only a grant before the ttl has passed since the first request was
			// sent is certain to overlap: later, a late local timer is possible.
			if live && at < ttl {
				t.Fatalf("a second acquirer was granted %q (%s) %v after the first grant of a %v lease, while the first lease's context was live: the backend's lease is shorter than the holder's local deadline", name, grantOf(l, err), at, ttl)
			}
			if live {
				select {
				case <-la.Context().Done():
				case <-time.After(time.Second):
					t.Fatalf("a second acquirer was granted %q %v after the first grant, and the first lease's context was still live a second later", name, at)
				}
			}
			break
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("TryAcquire while the first lease is held: %v, want ErrHeld", err)
		}
		time.Sleep(max(2*time.Millisecond, ttl/100)) // paces the polling; not a synchronisation
	}
	return tries, time.Since(before)
}

// grantOf describes a TryAcquire's grant: its token, or the late grant's
// error.
func grantOf(l fence.Lease, err error) string {
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("token %d", l.Token())
}

// testTokensExhausted: a counter at MaxToken-1 grants MaxToken once; the next
// grant is refused with ErrTokensExhausted (never a wrapped or invalid token),
// by TryAcquire and by Acquire, and the refusal grants nothing.
func (s AcquirerSuite) testTokensExhausted(t *testing.T) {
	a, b := s.New(t), s.NewOther(t)
	name := Name("exhausted")
	switch bumper, ok := a.(fence.Bumper); {
	case s.SetCounter != nil:
		s.SetCounter(t, name, fence.MaxToken-1)
	case ok:
		if err := bumper.Bump(ctxT(t), name, fence.MaxToken-1); err != nil {
			t.Fatalf("Bump(%q, %d): %v", name, fence.MaxToken-1, err)
		}
	default:
		t.Skipf("fencetest: the harness has no SetCounter and %T is no fence.Bumper: ErrTokensExhausted is not tested", a)
	}
	l := mustTry(t, a, name, longTTL)
	if l.Token() != fence.MaxToken {
		t.Errorf("grant after a counter at %d: token %d, want %d", fence.MaxToken-1, l.Token(), fence.MaxToken)
	}
	release(t, l)
	for _, op := range []struct {
		n string
		f func(context.Context, string, time.Duration) (fence.Lease, error)
	}{{"TryAcquire", a.TryAcquire}, {"Acquire", b.Acquire}} {
		ctx, cancel := context.WithTimeout(ctxT(t), 5*time.Second)
		l, err := op.f(ctx, name, longTTL)
		cancel()
		if !errors.Is(err, fence.ErrTokensExhausted) {
			if l != nil {
				t.Errorf("%s after the token %d was granted: a lease with token %d, want ErrTokensExhausted", op.n, fence.MaxToken, l.Token())
				_ = l.Release(context.Background())
			} else {
				t.Errorf("%s after the token %d was granted: err = %v, want ErrTokensExhausted", op.n, fence.MaxToken, err)
			}
			continue
		}
		if l != nil {
			t.Errorf("%s returned a lease together with ErrTokensExhausted", op.n)
		}
	}
}
