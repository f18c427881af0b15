package sqlfence_test

// Review tests of the in-process waiter line of the SQL acquirer (commit
// ade9964): each asserts a promise of Acquire's doc comment or the README
// against the real servers.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// acquired is the outcome of one Acquire call run in its own goroutine.
type acquired struct {
	l   fence.Lease
	err error
	at  time.Time
}

func goAcquire(ctx context.Context, a *sqlfence.Acquirer, name string, ttl time.Duration) <-chan acquired {
	ch := make(chan acquired, 1)
	go func() {
		l, err := a.Acquire(ctx, name, ttl)
		ch <- acquired{l, err, time.Now()}
	}()
	return ch
}

// within waits up to d for ch; it fails the test when nothing came.
func within(t *testing.T, ch <-chan acquired, d time.Duration, what string) acquired {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(d):
		t.Fatalf("%s: nothing after %v", what, d)
		return acquired{}
	}
}

// observe arms a proxy matcher that never faults: it counts the client chunks
// that carry s.
func observe(p *faultnet.Proxy, s string) *atomic.Int64 {
	var n atomic.Int64
	p.DropRequest(func(b []byte) bool {
		if faultnet.Carries(b, s) {
			n.Add(1)
		}
		return false
	})
	return &n
}

// TestLineUnknownReleasePokesHead: a release through the acquirer
// lands on the server but its replies are lost (4 times: Release returns
// ErrUnknown). The lock is free; the head of the acquirer's line must try at
// once (README: "a release through that acquirer lets the head try at once"),
// not after its backoff. The backoff is an hour (idleHead), so a head that
// was not poked waits a random 0-60 minutes: the 10s the test allows a
// poked head (a loaded machine's grant statement can take over a second) is
// met by an unpoked one in under 0.3% of runs.
func TestLineUnknownReleasePokesHead(t *testing.T) {
	ctx := context.Background()
	targets := map[string]func(t *testing.T, p *faultnet.Proxy) (*sqlfence.DB, *sqlfence.DB){
		"mysql": func(t *testing.T, p *faultnet.Proxy) (*sqlfence.DB, *sqlfence.DB) {
			_, direct := openMySQL(t, "")
			return sqlfence.MySQL(proxiedMySQL(t, p)), direct
		},
		"postgres-disablenotify": func(t *testing.T, p *faultnet.Proxy) (*sqlfence.DB, *sqlfence.DB) {
			direct := sqlfence.Pgx(pgPool(t, pgOpts{}))
			return sqlfence.Pgx(proxiedPool(t, p, 0)), direct
		},
	}
	for dialect, open := range targets {
		t.Run(dialect, func(t *testing.T) {
			target := mysqlAddr(t)
			if strings.HasPrefix(dialect, "postgres") {
				target = pgTarget(t)
			}
			px := faultnet.Start(t, target)
			db, direct := open(t, px)
			owner := "line-" + fencetest.Name("o")
			a := newAcquirerOn(t, db, &sqlfence.AcquirerOptions{Owner: owner, DisableNotify: true, Backoff: idleHead})
			// The release that releases only: a handoff whose replies are
			// lost is TestHandoffLostReplies.
			sqlfence.DisableHandoff(a)
			check := newAcquirerOn(t, direct, nil)
			if err := check.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			name := fencetest.Name("line-unknown-release")
			grants := observe(px, owner) // each grant statement carries the owner
			h, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			before := grants.Load()
			head := goAcquire(ctx, a, name, time.Minute)
			waitLine(t, a, name, 1)
			waitHeadIdle(t, a, name) // its first attempt found the row held
			if grants.Load() == before {
				t.Fatal("the head's first attempt did not pass through the proxy")
			}
			for range 4 {
				px.LoseReply(carrying(name))
			}
			err = h.Release(ctx)
			if !errors.Is(err, fence.ErrUnknown) {
				t.Fatalf("Release with 4 lost replies: %v, want ErrUnknown (the test did not test it)", err)
			}
			released := time.Now()
			// The row is free, or already held by the head, poked by the
			// release: not by h's token.
			if info, err := check.Inspect(ctx, name); err != nil || (info.Held && info.Token == h.Token()) {
				t.Fatalf("the row after the release whose replies were lost: %+v, %v; want it released (it landed)", info, err)
			}
			r := within(t, head, 30*time.Second, "the head (not poked: it sleeps its backoff of up to an hour)")
			if r.err != nil {
				t.Fatal(r.err)
			}
			defer r.l.Release(ctx)
			if took := r.at.Sub(released); took > 10*time.Second {
				t.Fatalf("the head was granted %v after a release through its acquirer that landed (reported ErrUnknown): it was not poked, it slept its backoff", took.Round(time.Millisecond))
			}
		})
	}
}

// blocker is a pgx tracer that holds the first grant statement started after
// arm until release is closed or the statement's context ends: a head whose
// one attempt is stuck (a dead connection, a slow server).
type blocker struct {
	armed   atomic.Bool
	started chan struct{}
	release chan struct{}
}

func (b *blocker) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "INSERT INTO") && strings.Contains(d.SQL, "RETURNING token") && b.armed.CompareAndSwap(true, false) {
		close(b.started)
		select {
		case <-b.release:
		case <-ctx.Done():
		}
	}
	return ctx
}

func (b *blocker) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// tracedPool is a pgx pool on the test database whose connections run tr.
func tracedPool(t *testing.T, tr pgx.QueryTracer) *pgxpool.Pool {
	pgPool(t, pgOpts{}) // the default tables
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tr
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// TestLineStuckHead: the head's one attempt is stuck; a release through
// the acquirer pokes only that head. The waiters behind it must be granted
// within a few seconds, one after the other, and the head too once it is
// unstuck; the line is empty at the end.
func TestLineStuckHead(t *testing.T) {
	for _, notify := range []bool{true, false} {
		t.Run(fmt.Sprintf("notify=%v", notify), func(t *testing.T) {
			ctx := context.Background()
			b := &blocker{started: make(chan struct{}), release: make(chan struct{})}
			a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, b)), &sqlfence.AcquirerOptions{DisableNotify: !notify})
			name := fencetest.Name("line-stuck")
			h, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			b.armed.Store(true)
			head := goAcquire(ctx, a, name, time.Minute)
			<-b.started
			w2 := goAcquire(ctx, a, name, time.Minute)
			waitLine(t, a, name, 2)
			w3 := goAcquire(ctx, a, name, time.Minute)
			waitLine(t, a, name, 3)
			if err := h.Release(ctx); err != nil {
				t.Fatal(err)
			}
			// Behind a stuck head the others ask in no particular order.
			first := func() acquired {
				select {
				case r := <-w2:
					w2 = nil
					return r
				case r := <-w3:
					w3 = nil
					return r
				case <-time.After(5 * time.Second):
					t.Fatalf("the waiters behind a stuck head: none granted 5s after a release (line %d)", sqlfence.LineLen(a, name))
					return acquired{}
				}
			}
			r2 := first()
			if r2.err != nil {
				t.Fatal(r2.err)
			}
			if err := r2.l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			r3 := first()
			if r3.err != nil {
				t.Fatal(r3.err)
			}
			close(b.release) // the head's attempt goes on: the lock is held
			time.Sleep(200 * time.Millisecond)
			if err := r3.l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			r1 := within(t, head, 2*time.Second, "the head, unstuck, after a release through its acquirer")
			if r1.err != nil {
				t.Fatal(r1.err)
			}
			if !(r1.l.Token() > r3.l.Token() && r3.l.Token() > r2.l.Token()) {
				t.Fatalf("tokens %d, %d, %d not increasing", r2.l.Token(), r3.l.Token(), r1.l.Token())
			}
			_ = r1.l.Release(ctx)
			if n := sqlfence.LineLen(a, name); n != 0 {
				t.Fatalf("line has %d waiters after every Acquire returned", n)
			}
		})
	}
}

// TestLineStuckHeadMaxWait: a head stuck in one attempt and the waiters
// behind it give up at MaxWait with ErrHeld, DeadlineExceeded and the maximum
// wait named.
func TestLineStuckHeadMaxWait(t *testing.T) {
	ctx := context.Background()
	b := &blocker{started: make(chan struct{}), release: make(chan struct{})}
	defer close(b.release)
	const maxWait = 1500 * time.Millisecond
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, b)), &sqlfence.AcquirerOptions{Backoff: fence.Backoff{MaxWait: maxWait}})
	name := fencetest.Name("line-stuck-maxwait")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Release(ctx)
	b.armed.Store(true)
	start := time.Now()
	chans := []<-chan acquired{goAcquire(ctx, a, name, time.Minute)}
	<-b.started
	chans = append(chans, goAcquire(ctx, a, name, time.Minute))
	waitLine(t, a, name, 2)
	for i, ch := range chans {
		r := within(t, ch, maxWait+5*time.Second, fmt.Sprintf("waiter %d", i))
		if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.DeadlineExceeded) {
			t.Fatalf("waiter %d past MaxWait: %v, want ErrHeld and DeadlineExceeded", i, r.err)
		}
		if !strings.Contains(r.err.Error(), maxWait.String()) {
			t.Fatalf("waiter %d past MaxWait: %q does not name the maximum wait", i, r.err)
		}
		if took := r.at.Sub(start); took > maxWait+2*time.Second {
			t.Fatalf("waiter %d gave up after %v, MaxWait %v", i, took, maxWait)
		}
	}
	if n := sqlfence.LineLen(a, name); n != 0 {
		t.Fatalf("line has %d waiters after every Acquire returned", n)
	}
}

// TestLineExpiry: holders that never release; each lease expires on the
// server. The waiters in line are each granted within about the acquirer's
// Backoff.Max of the expiry, in arrival order.
func TestLineExpiry(t *testing.T) {
	ctx := context.Background()
	for dialect, fdb := range lineDialects(t) {
		t.Run(dialect, func(t *testing.T) {
			const bmax = 100 * time.Millisecond
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: bmax}, DisableNotify: true})
			if err := a.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			name := fencetest.Name("line-expiry")
			const ttl = 700 * time.Millisecond
			first, err := a.TryAcquire(ctx, name, ttl)
			if err != nil {
				t.Fatal(err)
			}
			prevGranted := time.Now() // at or after the grant
			var chans []<-chan acquired
			for i := range 3 {
				chans = append(chans, goAcquire(ctx, a, name, ttl))
				waitLine(t, a, name, i+1)
			}
			prev := first.Token()
			for i, ch := range chans {
				r := within(t, ch, 10*time.Second, fmt.Sprintf("waiter %d", i))
				if r.err != nil {
					t.Fatal(r.err)
				}
				if r.l.Token() <= prev {
					t.Fatalf("waiter %d token %d not above %d", i, r.l.Token(), prev)
				}
				prev = r.l.Token()
				late := r.at.Sub(prevGranted) - ttl
				if late > bmax+400*time.Millisecond {
					t.Errorf("waiter %d granted %v after the previous lease expired (Backoff.Max %v)", i, late.Round(time.Millisecond), bmax)
				}
				prevGranted = r.at
			}
		})
	}
}

// TestLineCancelAtGrant: the head's context is cancelled about when the
// lock is released to it. Whatever the head gets (a lease, or ErrHeld with
// context.Canceled), the next waiter is granted at once after the head's
// lease is released or the head gave up: no grant is leaked, no waiter is
// stuck.
func TestLineCancelAtGrant(t *testing.T) {
	ctx := context.Background()
	for dialect, fdb := range lineDialects(t) {
		t.Run(dialect, func(t *testing.T) {
			a := newAcquirerOn(t, fdb, nil)
			if err := a.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			var got, gaveUp int
			for i := range 40 {
				name := fencetest.Name("line-cancel")
				h, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				hctx, cancel := context.WithCancel(ctx)
				head := goAcquire(hctx, a, name, time.Minute)
				waitLine(t, a, name, 1)
				next := goAcquire(ctx, a, name, time.Minute)
				waitLine(t, a, name, 2)
				go func() { // cancel about when the release reaches the head
					time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
					cancel()
				}()
				if err := h.Release(ctx); err != nil {
					t.Fatal(err)
				}
				r := within(t, head, 10*time.Second, "the cancelled head")
				cancel()
				done := time.Now()
				if r.err == nil {
					got++
					if err := r.l.Release(ctx); err != nil {
						t.Fatal(err)
					}
				} else {
					gaveUp++
					if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
						t.Fatalf("run %d: the cancelled head: %v, want a lease or ErrHeld and context.Canceled", i, r.err)
					}
				}
				var rn acquired
				select {
				case rn = <-next:
				case <-time.After(3 * time.Second):
					info, ierr := a.Inspect(ctx, name)
					t.Fatalf("run %d: the waiter behind a head that was cancelled (head: %v) not granted in 3s: a grant leaked; line %d; the row: %+v, %v",
						i, r.err, sqlfence.LineLen(a, name), info, ierr)
				}
				if rn.err != nil {
					t.Fatal(rn.err)
				}
				if took := rn.at.Sub(done); took > time.Second {
					t.Fatalf("run %d: the next waiter was granted %v after the head returned (head granted: %v)", i, took, r.err == nil)
				}
				_ = rn.l.Release(ctx)
				if n := sqlfence.LineLen(a, name); n != 0 {
					t.Fatalf("run %d: line has %d waiters", i, n)
				}
			}
			t.Logf("head granted %d, gave up %d", got, gaveUp)
		})
	}
}

// TestLineNoLeaks: many waits that give up (cancelled, or past their
// deadline, head or not) leave no place in the line and no goroutine behind.
func TestLineNoLeaks(t *testing.T) {
	ctx := context.Background()
	for dialect, fdb := range lineDialects(t) {
		t.Run(dialect, func(t *testing.T) {
			a := newAcquirerOn(t, fdb, nil)
			if err := a.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			names := []string{fencetest.Name("leak"), fencetest.Name("leak"), fencetest.Name("leak")}
			var holds []fence.Lease
			for _, n := range names {
				l, err := a.TryAcquire(ctx, n, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				holds = append(holds, l)
			}
			runtime.GC()
			base := runtime.NumGoroutine()
			var wg sync.WaitGroup
			for i := range 150 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					c, cancel := context.WithTimeout(ctx, time.Duration(50+rand.IntN(400))*time.Millisecond)
					defer cancel()
					_, err := a.Acquire(c, names[i%len(names)], time.Minute)
					if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
						t.Errorf("Acquire of a held lock past its deadline: %v", err)
					}
				}()
			}
			wg.Wait()
			for _, n := range names {
				if k := sqlfence.LineLen(a, n); k != 0 {
					t.Fatalf("line of %s has %d waiters after every Acquire returned", n, k)
				}
			}
			deadline := time.Now().Add(5 * time.Second)
			for runtime.NumGoroutine() > base+2 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if g := runtime.NumGoroutine(); g > base+2 {
				t.Fatalf("%d goroutines, %d before the waits", g, base)
			}
			// The line still works: a waiter is granted on release.
			w := goAcquire(ctx, a, names[0], time.Minute)
			waitLine(t, a, names[0], 1)
			for _, l := range holds {
				_ = l.Release(ctx)
			}
			r := within(t, w, 2*time.Second, "a waiter after the leaks test")
			if r.err != nil {
				t.Fatal(r.err)
			}
			_ = r.l.Release(ctx)
		})
	}
}

// TestLineTwoAcquirersNotify: two acquirers on one PostgreSQL handle,
// each with a line for one name, and a holder on another handle. Releases
// wake the heads through LISTEN/NOTIFY; the Backoff is long, so a waiter that
// hears nothing would sleep (up to an hour). Every waiter is granted within
// 10s of the release before it (a loaded machine's statements can take over
// a second each).
func TestLineTwoAcquirersNotify(t *testing.T) {
	ctx := context.Background()
	shared := sqlfence.Pgx(pgPool(t, pgOpts{}))
	other := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	slow := &sqlfence.AcquirerOptions{Backoff: idleHead}
	a1, a2 := newAcquirerOn(t, shared, slow), newAcquirerOn(t, shared, slow)
	name := fencetest.Name("line-two")
	h, err := other.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	c := []<-chan acquired{goAcquire(ctx, a1, name, time.Minute)}
	waitLine(t, a1, name, 1)
	c = append(c, goAcquire(ctx, a2, name, time.Minute))
	waitLine(t, a2, name, 1)
	c = append(c, goAcquire(ctx, a1, name, time.Minute))
	waitLine(t, a1, name, 2)
	c = append(c, goAcquire(ctx, a2, name, time.Minute))
	waitLine(t, a2, name, 2)
	waitHeadIdle(t, a1, name) // the heads' first attempts found it held
	waitHeadIdle(t, a2, name)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	for range c {
		var r acquired
		select {
		case r = <-c[0]:
		case r = <-c[1]:
		case r = <-c[2]:
		case r = <-c[3]:
		case <-time.After(30 * time.Second):
			t.Fatalf("no waiter granted 30s after a release (heads subscribed: %d, %d in line)", sqlfence.LineLen(a1, name), sqlfence.LineLen(a2, name))
		}
		if r.err != nil {
			t.Fatal(r.err)
		}
		if took := r.at.Sub(released); took > 10*time.Second {
			t.Fatalf("a waiter granted %v after the release before it", took.Round(time.Millisecond))
		}
		if err := r.l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		released = time.Now()
	}
}

// panicker is a pgx tracer that counts grant statements and panics in the
// first one started after arm (a driver or hook that panics).
type panicker struct {
	grants atomic.Int64
	armed  atomic.Bool
}

func (p *panicker) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "INSERT INTO") && strings.Contains(d.SQL, "RETURNING token") {
		if p.armed.CompareAndSwap(true, false) {
			panic("test: the driver panics in the head's grant")
		}
		p.grants.Add(1)
	}
	return ctx
}

func (p *panicker) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// panickyPool is a pgx pool on the test database whose connections run tr,
// a tracer that panics in a statement. It is not closed: pgxpool's Close
// waits for the connection the panic leaked.
func panickyPool(t *testing.T, tr pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	pgPool(t, pgOpts{}) // the default tables
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return pool
}

// TestLineHeadPanics: the head's attempt panics and its caller recovers.
// The head leaves the line, and the waiter behind it is granted at once (the
// lock was just released); the line is empty afterwards.
func TestLineHeadPanics(t *testing.T) {
	ctx := context.Background()
	pk := &panicker{}
	pool := panickyPool(t, pk)
	a := newAcquirerOn(t, sqlfence.Pgx(pool), &sqlfence.AcquirerOptions{DisableNotify: true, Backoff: idleHead})
	// The head's own attempt panics: the release releases only (a panic in
	// a handoff is TestHandoffPanicFreesHead).
	sqlfence.DisableHandoff(a)
	name := fencetest.Name("line-panic")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	headPanic := make(chan any, 1)
	go func() {
		defer func() { headPanic <- recover() }()
		l, err := a.Acquire(ctx, name, time.Minute)
		t.Errorf("the head returned %v, %v; want a panic", l, err)
	}()
	waitLine(t, a, name, 1)
	deadline := time.Now().Add(10 * time.Second)
	for pk.grants.Load() < 2 { // the holder's grant and the head's first attempt
		if time.Now().After(deadline) {
			t.Fatal("the head never tried")
		}
		time.Sleep(time.Millisecond)
	}
	w2 := goAcquire(ctx, a, name, time.Minute)
	waitLine(t, a, name, 2)
	pk.armed.Store(true)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case v := <-headPanic:
		if v == nil {
			t.Fatal("the head did not panic")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the head was not poked by the release")
	}
	panicked := time.Now()
	r := within(t, w2, 30*time.Second, "the waiter behind a head that panicked")
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.l.Release(ctx)
	if took := r.at.Sub(panicked); took > 10*time.Second {
		t.Fatalf("the waiter behind a head that panicked was granted %v after the panic", took)
	}
	if n := sqlfence.LineLen(a, name); n != 0 {
		t.Fatalf("line has %d waiters", n)
	}
}

// TestLineManyNames: one acquirer, many names, each with a line of
// waiters that release and ask again: every name's waiters are granted in
// arrival order, and a release of one name never wakes another name's line
// (the Backoff is long: a waiter that is not poked sleeps up to an hour).
func TestLineManyNames(t *testing.T) {
	ctx := context.Background()
	for dialect, fdb := range lineDialects(t) {
		t.Run(dialect, func(t *testing.T) {
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{DisableNotify: true, Backoff: idleHead})
			if err := a.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			const names, waiters = 8, 3
			var wg sync.WaitGroup
			errs := make(chan error, names*(waiters+1))
			for range names {
				name := fencetest.Name("line-many")
				h, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				var mu sync.Mutex
				var order []int
				var chans []<-chan acquired
				for w := range waiters {
					chans = append(chans, goAcquire(ctx, a, name, time.Minute))
					waitLine(t, a, name, w+1)
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					time.Sleep(time.Duration(rand.IntN(50)) * time.Millisecond)
					if err := h.Release(ctx); err != nil {
						errs <- err
						return
					}
					for range waiters {
						var r acquired
						var w int
						select {
						case r = <-chans[0]:
						case r = <-chans[1]:
							w = 1
						case r = <-chans[2]:
							w = 2
						case <-time.After(30 * time.Second):
							errs <- fmt.Errorf("%s: no waiter granted 30s after a release (line %d)", name, sqlfence.LineLen(a, name))
							return
						}
						if r.err != nil {
							errs <- r.err
							return
						}
						mu.Lock()
						order = append(order, w)
						mu.Unlock()
						if err := r.l.Release(ctx); err != nil {
							errs <- err
							return
						}
					}
					if !(order[0] == 0 && order[1] == 1 && order[2] == 2) {
						errs <- fmt.Errorf("%s: grant order %v, want [0 1 2]", name, order)
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
		})
	}
}

// TestLineShortMaxWaitFreeLock (HAZARDS 3 and 6): Acquire of a free
// lock whose Backoff.MaxWait ends while its first grant statement is on its
// way (a slow network). Acquire now runs that first attempt under MaxWait
// (before the line it ran under the caller's context). When it gives up with
// ErrHeld, no grant of its own may be left on the row: the lock must be free
// for the next caller, not held by nobody for the ttl.
func TestLineShortMaxWaitFreeLock(t *testing.T) {
	ctx := context.Background()
	px := faultnet.Start(t, pgTarget(t))
	direct := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	pool := proxiedPool(t, px, 4)
	a := newAcquirerOn(t, sqlfence.Pgx(pool), &sqlfence.AcquirerOptions{Backoff: fence.Backoff{MaxWait: 40 * time.Millisecond}})
	// Warm the pool's connections up before the latency, so the read after a
	// cancelled grant needs no dial.
	var conns []*pgxpool.Conn
	for range 4 {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	px.Latency(time.Millisecond, 300*time.Millisecond)
	var granted, gaveUp int
	for i := range 10 {
		name := fencetest.Name("line-maxwait-free")
		l, err := a.Acquire(ctx, name, time.Minute)
		if err == nil {
			granted++
			_ = l.Release(ctx)
			continue
		}
		if errors.Is(err, fence.ErrUnknown) {
			continue // said so: a grant may be held
		}
		if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("run %d: Acquire of a free lock past MaxWait: %v", i, err)
		}
		if !strings.Contains(err.Error(), (40 * time.Millisecond).String()) {
			t.Errorf("run %d: Acquire past MaxWait: %q does not name the maximum wait", i, err)
		}
		gaveUp++
		time.Sleep(700 * time.Millisecond) // a statement still on its way lands
		info, ierr := direct.Inspect(ctx, name)
		if ierr == nil && info.Held {
			t.Fatalf("run %d: Acquire of a free lock returned %q (not granted), but the row is held by %s for %v: a grant leaked", i, err, info.Owner, info.TimeLeft.Round(time.Second))
		}
	}
	t.Logf("granted %d, gave up %d", granted, gaveUp)
}

// TestLineRowLockedHead: an operator's transaction holds the lease
// row's lock (SELECT ... FOR UPDATE) while the lock is free, so the head's
// grant waits on it, and the waiters behind it join in after a second. Once
// the transaction ends, every waiter is granted within a couple of seconds of
// the release before it, and the line empties.
func TestLineRowLockedHead(t *testing.T) {
	ctx := context.Background()
	_, myFdb := openMySQL(t, "")
	myRaw, _ := openMySQL(t, "")
	myWatch, _ := openMySQL(t, "")
	pgp := pgPool(t, pgOpts{})
	pgWatch := pgPool(t, pgOpts{}) // not the acquirer's pool: the waiters may take all of its connections
	cases := map[string]struct {
		fdb     *sqlfence.DB
		lock    func(t *testing.T, name string) (unlock func())
		waiting string // counts the statements waiting on a row lock
	}{
		"postgres": {sqlfence.Pgx(pgp), func(t *testing.T, name string) func() {
			tx, err := pgp.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var n int
			if err := tx.QueryRow(ctx, "SELECT count(*) FROM (SELECT 1 FROM fence_leases WHERE name = $1 FOR UPDATE) s", name).Scan(&n); err != nil || n != 1 {
				t.Fatal(n, err)
			}
			return func() { _ = tx.Rollback(ctx) }
		}, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO %fence_leases%'"},
		"mysql": {myFdb, func(t *testing.T, name string) func() {
			tx, err := myRaw.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			var n int
			if err := tx.QueryRowContext(ctx, "SELECT count(*) FROM (SELECT 1 FROM fence_leases WHERE name = ? FOR UPDATE) s", name).Scan(&n); err != nil || n != 1 {
				t.Fatal(n, err)
			}
			return func() { _ = tx.Rollback() }
		}, "SELECT count(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE '%fence_leases%' AND INFO NOT LIKE '%PROCESSLIST%' AND INFO NOT LIKE '%FOR UPDATE%'"},
	}
	for dialect, c := range cases {
		t.Run(dialect, func(t *testing.T) {
			a := newAcquirerOn(t, c.fdb, nil)
			if err := a.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			name := fencetest.Name("line-rowlock")
			h, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.Release(ctx); err != nil {
				t.Fatal(err)
			}
			unlock := c.lock(t, name)
			t.Cleanup(unlock) // also when the test fails: its pool's Close waits for the transaction's connection
			var chans []<-chan acquired
			for i := range 3 {
				chans = append(chans, goAcquire(ctx, a, name, time.Minute))
				waitLine(t, a, name, i+1)
			}
			released0 := time.Now()
			// The head is stuck over a second: the others ask too, and wait
			// on the row lock with it.
			deadline := time.Now().Add(20 * time.Second)
			for {
				var n int
				var err error
				if dialect == "postgres" {
					err = pgWatch.QueryRow(ctx, c.waiting).Scan(&n)
				} else {
					err = myWatch.QueryRowContext(ctx, c.waiting).Scan(&n)
				}
				if err != nil {
					t.Fatal(err)
				}
				if n >= 3 {
					break
				}
				if time.Now().After(deadline) {
					if dialect == "postgres" {
						rows, _ := pgWatch.Query(ctx, "SELECT coalesce(wait_event_type,''), left(query, 40) FROM pg_stat_activity WHERE datname = 'test'")
						for rows.Next() {
							var a, b string
							_ = rows.Scan(&a, &b)
							t.Logf("%q %q", a, b)
						}
						rows.Close()
					}
					for i, ch := range chans {
						select {
						case r := <-ch:
							t.Logf("waiter %d: %v at %v", i, r.err, r.at.Sub(released0))
						default:
						}
					}
					t.Fatalf("%d statements wait on the row lock, want the head's and both others'", n)
				}
				time.Sleep(10 * time.Millisecond)
			}
			unlock()
			released := time.Now()
			left := map[int]bool{0: true, 1: true, 2: true}
			for range 3 {
				var r acquired
				var w int
				select {
				case r = <-chans[0]:
				case r = <-chans[1]:
					w = 1
				case r = <-chans[2]:
					w = 2
				case <-time.After(5 * time.Second):
					info, _ := a.Inspect(ctx, name)
					t.Fatalf("no waiter granted 5s after the release before (left %v, line %d, row %+v)", left, sqlfence.LineLen(a, name), info)
				}
				if r.err != nil {
					t.Fatal(r.err)
				}
				delete(left, w)
				if took := r.at.Sub(released); took > 2*time.Second {
					t.Errorf("waiter %d granted %v after the release before it", w, took.Round(time.Millisecond))
				}
				if err := r.l.Release(ctx); err != nil {
					t.Fatal(err)
				}
				released = time.Now()
			}
			if n := sqlfence.LineLen(a, name); n != 0 {
				t.Fatalf("line has %d waiters", n)
			}
		})
	}
}
