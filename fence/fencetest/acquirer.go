// Package fencetest holds the conformance suites that every fencekit adapter runs
// against a real backend, in the manner of gocloud.dev's drivertest: the adapter
// supplies a constructor, the suite supplies a flat list of subtests that assert
// the documented contract of package fence.
package fencetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// AcquirerSuite is the conformance suite for a fence.Acquirer.
type AcquirerSuite struct {
	// New returns an acquirer on a live backend. Tests use fresh random lock names,
	// so one backend may serve every test. Required.
	New func(t *testing.T) fence.Acquirer

	// ShortTTL is the lease length of tests that wait for a lease to expire; it must
	// be at least the backend's minimum ttl. Default: 150ms.
	ShortTTL time.Duration

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
}

// Name returns a fresh random lock name with prefix, for tests that share a backend.
func Name(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

// Run runs every test of the suite as a subtest of t.
func (s AcquirerSuite) Run(t *testing.T) {
	if s.New == nil {
		t.Fatal("fencetest: AcquirerSuite.New is nil")
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
		{"ExpiredReleaseDoesNotFreeNextHolder", s.testExpiredRelease},
		{"ReleaseTwice", s.testReleaseTwice},
		{"RenewExtends", s.testRenewExtends},
		{"ContextDoneAfterRelease", s.testContextAfterRelease},
		{"ContextDoneAfterLoss", s.testContextAfterLoss},
		{"HoldRunsAndReleases", s.testHold},
		{"BadInput", s.testBadInput},
		{"ExtremeTTLs", s.testExtremeTTLs},
		{"NilContext", s.testNilContext},
	}
	for _, tc := range tests {
		t.Run(tc.name, tc.fn)
	}
}

const longTTL = 30 * time.Second

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
	l, err := a.TryAcquire(ctxT(t), name, ttl)
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
func (s AcquirerSuite) testMutualExclusion(t *testing.T) {
	a := s.New(t)
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
	a := s.New(t)
	name := Name("expiry")
	l1 := mustTry(t, a, name, s.ShortTTL)
	time.Sleep(s.ShortTTL + s.ShortTTL/2)
	l2 := mustTry(t, a, name, longTTL)
	defer release(t, l2)
	if l2.Token() <= l1.Token() {
		t.Fatalf("re-grant after expiry: token %d not larger than expired grant's %d", l2.Token(), l1.Token())
	}
}

func (s AcquirerSuite) testTryAcquireHeld(t *testing.T) {
	a := s.New(t)
	name := Name("held")
	l := mustTry(t, a, name, longTTL)
	defer release(t, l)
	// No deadline on ctx: an acquirer that waited instead of answering at once
	// would wait its whole maximum wait.
	start := time.Now()
	l2, err := a.TryAcquire(context.Background(), name, longTTL)
	if !errors.Is(err, fence.ErrHeld) {
		if l2 != nil {
			_ = l2.Release(context.Background())
		}
		t.Fatalf("TryAcquire on a held lease: err = %v, want ErrHeld", err)
	}
	if l2 != nil {
		t.Errorf("TryAcquire returned a lease together with ErrHeld")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("TryAcquire on a held lease waited %v instead of answering at once", d)
	}
}

func (s AcquirerSuite) testNamesIndependent(t *testing.T) {
	a := s.New(t)
	la := mustTry(t, a, Name("a"), longTTL)
	defer release(t, la)
	lb := mustTry(t, a, Name("b"), longTTL)
	release(t, lb)
}

func (s AcquirerSuite) testAcquireWaitsForRelease(t *testing.T) {
	a := s.New(t)
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
	l2, err := a.Acquire(ctx, name, longTTL)
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

func (s AcquirerSuite) testAcquireGivesUp(t *testing.T) {
	a := s.New(t)
	name := Name("giveup")
	l := mustTry(t, a, name, longTTL)
	defer release(t, l)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	l2, err := a.Acquire(ctx, name, longTTL)
	if err == nil {
		_ = l2.Release(context.Background())
		t.Fatal("Acquire granted a held lease")
	}
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Acquire past its deadline: err = %v, want ErrHeld joined with context.DeadlineExceeded", err)
	}
}

func (s AcquirerSuite) testAcquireCancelled(t *testing.T) {
	a := s.New(t)
	name := Name("cancel")
	l := mustTry(t, a, name, longTTL)
	defer release(t, l)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	_, err := a.Acquire(ctx, name, longTTL)
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled Acquire: err = %v, want ErrHeld joined with context.Canceled", err)
	}
}

// testExpiredRelease is the lesson's plain-DEL bug: A's lease expires, B takes the
// lock, A "releases". A's release must report the loss and leave B's lease alone.
func (s AcquirerSuite) testExpiredRelease(t *testing.T) {
	a := s.New(t)
	name := Name("plaindel")
	la := mustTry(t, a, name, s.ShortTTL)
	time.Sleep(s.ShortTTL + s.ShortTTL/2)
	lb := mustTry(t, a, name, longTTL)
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
	a := s.New(t)
	name := Name("renew")
	l := mustTry(t, a, name, s.ShortTTL)
	defer release(t, l)
	end := time.Now().Add(3 * s.ShortTTL)
	for time.Now().Before(end) {
		time.Sleep(s.ShortTTL / 3)
		if err := l.Renew(ctxT(t)); err != nil {
			t.Fatalf("Renew: %v", err)
		}
	}
	if err := l.Context().Err(); err != nil {
		t.Fatalf("context of a renewed lease is done: %v", context.Cause(l.Context()))
	}
	l2, err := a.TryAcquire(ctxT(t), name, longTTL)
	if !errors.Is(err, fence.ErrHeld) {
		if l2 != nil {
			_ = l2.Release(context.Background())
		}
		t.Fatalf("TryAcquire after renewals kept the lease past 3 ttl: err = %v, want ErrHeld", err)
	}
}

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
	granted := time.Now()
	l := mustTry(t, a, Name("ctxloss"), s.ShortTTL)
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
	time.Sleep(time.Until(granted.Add(s.ShortTTL + s.ShortTTL/2)))
	if err := l.Release(context.Background()); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Release after expiry: %v, want ErrLost", err)
	}
}

func (s AcquirerSuite) testHold(t *testing.T) {
	a := s.New(t)
	name := Name("hold")
	var token fence.Token
	err := fence.Hold(ctxT(t), a, name, s.ShortTTL, func(ctx context.Context, l fence.Lease) error {
		token = l.Token()
		// Outlive the ttl several times: the watchdog must keep the lease.
		select {
		case <-time.After(3 * s.ShortTTL):
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		l2, err := a.TryAcquire(context.Background(), name, longTTL)
		if !errors.Is(err, fence.ErrHeld) {
			if l2 != nil {
				_ = l2.Release(context.Background())
			}
			t.Errorf("while Hold renewed the lease, TryAcquire got %v, want ErrHeld", err)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("Hold: %v", err)
	}
	l := mustTry(t, a, name, longTTL)
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
	for _, c := range cases {
		for _, op := range []struct {
			n string
			f func(context.Context, string, time.Duration) (fence.Lease, error)
		}{{"Acquire", a.Acquire}, {"TryAcquire", a.TryAcquire}} {
			l, err := op.f(ctx, c.name, c.ttl)
			if !errors.Is(err, fence.ErrInvalid) {
				if l != nil {
					_ = l.Release(context.Background())
				}
				t.Errorf("%s with %s: err = %v, want ErrInvalid", op.n, c.what, err)
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
	a, b := s.New(t), s.New(t)
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
	a := s.New(t)
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
	if _, err := a.TryAcquire(ctxT(t), name, longTTL); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("after the refused calls: %v, want ErrHeld", err)
	}
	release(t, l)
}
