package sqlfence_test

import (
	"context"
	crand "crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
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
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/linetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// lineDialects returns one handle per dialect, each with its lease table.
func lineDialects(t *testing.T) map[string]*sqlfence.DB {
	_, sq := openSQLite(t)
	newSQLiteAcquirer(t, sq) // creates the table
	_, my := openMySQL(t, "")
	return map[string]*sqlfence.DB{
		"sqlite":   sq,
		"postgres": sqlfence.Pgx(pgPool(t, pgOpts{})),
		"mysql":    my,
	}
}

// waitLine waits until n Acquire calls of a wait in name's line.
func waitLine(t *testing.T, a *sqlfence.Acquirer, name string, n int) {
	t.Helper()
	linetest.Wait(t, func(name string) int { return sqlfence.LineLen(a, name) }, name, n)
}

// TestAcquireLineOrder: the waiting Acquire calls of one acquirer are granted
// in the order they began, and a holder that releases and asks again joins at
// the back (linetest.Order).
func TestAcquireLineOrder(t *testing.T) {
	for dialect, fdb := range lineDialects(t) {
		t.Run(dialect, func(t *testing.T) {
			a := newAcquirerOn(t, fdb, nil)
			if err := a.CreateTable(context.Background()); err != nil {
				t.Fatal(err)
			}
			// A grant statement slower than wakeup.Stall on a loaded machine lets
			// the waiters behind the head try out of turn, by design (an order such as
			// [0 4 1 2 3 -1] was seen on PostgreSQL); the order itself is what is checked here.
			sqlfence.SetLineStall(a, time.Minute)
			linetest.Order(t, a, func(name string) int { return sqlfence.LineLen(a, name) }, time.Minute)
		})
	}
}

// TestAcquireLineWaiterGivesUp: a waiter whose context ends leaves the line,
// and when it was the head the next waiter is granted as soon as the lock is
// released, not after a stall.
func TestAcquireLineWaiterGivesUp(t *testing.T) {
	ctx := context.Background()
	for dialect, fdb := range lineDialects(t) {
		t.Run(dialect, func(t *testing.T) {
			// The head tries when it joins and when a release through a
			// pokes it, never on a timer: the cancel below then comes
			// while it waits, not during a grant statement. (A grant
			// statement cancelled in flight can land after the give-back's
			// read: watchGrant gives it back, but within its polling, not
			// at once; TestLineCancelAtGrant. On a loaded machine this
			// most likely left the next waiter on MySQL ungranted for
			// 20s.)
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: time.Minute, Max: time.Minute}})
			name := fencetest.Name("line")
			h := mustGrant(t, ctx, a, name, time.Minute)
			hctx, cancel := context.WithCancel(ctx)
			headDone := make(chan error, 1)
			go func() {
				_, err := a.Acquire(hctx, name, time.Minute)
				headDone <- err
			}()
			waitLine(t, a, name, 1)
			next := make(chan fence.Lease, 1)
			nextErr := make(chan error, 1)
			go func() {
				l, err := a.Acquire(ctx, name, time.Minute)
				if err != nil {
					nextErr <- err
					return
				}
				next <- l
			}()
			waitLine(t, a, name, 2)
			for end := time.Now().Add(10 * time.Second); sqlfence.LineHeadTrying(a, name); {
				if time.Now().After(end) {
					t.Fatal("the head's first attempt did not end within 10s")
				}
				time.Sleep(5 * time.Millisecond) // polling the line's state
			}
			cancel()
			if err := <-headDone; !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) {
				t.Fatalf("head whose context was cancelled: %v, want ErrHeld and context.Canceled", err)
			}
			waitLine(t, a, name, 1)
			if err := h.Release(ctx); err != nil {
				t.Fatal(err)
			}
			// The lock is free once the release's statement has committed:
			// timed from there, not from its start (loaded run l1 this
			// session: 514ms from the release's start, most of it the
			// statement itself on a loaded machine). A waiter left behind a
			// head that had gone waits out its Stall timer (0.5-1s) or a
			// Backoff of a minute.
			released := time.Now()
			select {
			case l := <-next:
				took := time.Since(released)
				if took > 500*time.Millisecond {
					t.Fatalf("the new head was granted %v after the release: it waited as a waiter behind a head that had left", took)
				}
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
			case err := <-nextErr:
				t.Fatal(err)
			case <-time.After(20 * time.Second):
				t.Fatal("the waiter behind a head that gave up was never granted")
			}
			if n := sqlfence.LineLen(a, name); n != 0 {
				t.Fatalf("line has %d waiters after every Acquire returned", n)
			}
		})
	}
}

// TestAcquireLineMaxWait: a waiter behind the head gives up at the acquirer's
// MaxWait, as any wait does, with ErrHeld and the maximum wait named.
func TestAcquireLineMaxWait(t *testing.T) {
	ctx := context.Background()
	_, fdb := openSQLite(t)
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: fence.Backoff{MaxWait: 300 * time.Millisecond}})
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("line")
	h := mustGrant(t, ctx, a, name, time.Minute)
	defer h.Release(ctx)
	errs := make(chan error, 2)
	for i := range 2 {
		go func() {
			_, err := a.Acquire(ctx, name, time.Minute)
			errs <- err
		}()
		waitLine(t, a, name, i+1)
	}
	for range 2 {
		err := <-errs
		if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Acquire past MaxWait: %v, want ErrHeld and DeadlineExceeded", err)
		}
		if want := fmt.Sprint(300 * time.Millisecond); !strings.Contains(err.Error(), want) {
			t.Fatalf("Acquire past MaxWait: %q does not name the maximum wait %s", err, want)
		}
	}
}

// The in-process waiter line of the SQL acquirer under faults: each asserts a promise of Acquire's doc comment or the README
// against the real servers.

// acquired is the outcome of one Acquire call run in its own goroutine.
type acquired struct {
	l   fence.Lease
	err error
	at  time.Time
}

// goAcquire runs a.Acquire in a goroutine of its own.
func goAcquire(ctx context.Context, a *sqlfence.Acquirer, name string, ttl time.Duration) <-chan acquired {
	return goLease(func() (fence.Lease, error) { return a.Acquire(ctx, name, ttl) })
}

// goLease runs grant in a goroutine of its own; the channel gets what it
// returned, and when.
func goLease(grant func() (fence.Lease, error)) <-chan acquired {
	ch := make(chan acquired, 1)
	go func() {
		l, err := grant()
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

// leaseWithin waits up to d for ch, as within, and fails the test when
// the call it waits for returned an error.
func leaseWithin(t *testing.T, ch <-chan acquired, d time.Duration, what string) acquired {
	t.Helper()
	r := within(t, ch, d, what)
	if r.err != nil {
		t.Fatalf("%s: %v", what, r.err)
	}
	return r
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
			h := mustGrant(t, ctx, a, name, time.Minute)
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
			err := h.Release(ctx)
			if !errors.Is(err, fence.ErrUnknown) {
				t.Fatalf("Release with 4 lost replies: %v, want ErrUnknown (the test did not test it)", err)
			}
			released := time.Now()
			// The row is free, or already held by the head, poked by the
			// release: not by h's token.
			if info, err := check.Inspect(ctx, name); err != nil || (info.Held && info.Token == h.Token()) {
				t.Fatalf("the row after the release whose replies were lost: %+v, %v; want it released (it landed)", info, err)
			}
			r := leaseWithin(t, head, 30*time.Second, "the head (not poked: it sleeps its backoff of up to an hour)")
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
			h := mustGrant(t, ctx, a, name, time.Minute)
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
			r1 := leaseWithin(t, head, 2*time.Second, "the head, unstuck, after a release through its acquirer")
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
	h := mustGrant(t, ctx, a, name, time.Minute)
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
			first := mustGrant(t, ctx, a, name, ttl)
			prevGranted := time.Now() // at or after the grant
			var chans []<-chan acquired
			for i := range 3 {
				chans = append(chans, goAcquire(ctx, a, name, ttl))
				waitLine(t, a, name, i+1)
			}
			prev := first.Token()
			for i, ch := range chans {
				r := leaseWithin(t, ch, 10*time.Second, fmt.Sprintf("waiter %d", i))
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
				h := mustGrant(t, ctx, a, name, time.Minute)
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
				l := mustGrant(t, ctx, a, n, time.Minute)
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
			r := leaseWithin(t, w, 2*time.Second, "a waiter after the leaks test")
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
	h := mustGrant(t, ctx, other, name, time.Minute)
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

// panickerGrant marks the context of a grant statement, so that its end is
// counted.
type panickerGrant struct{}

func (p *panicker) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "INSERT INTO") && strings.Contains(d.SQL, "RETURNING token") {
		if p.armed.CompareAndSwap(true, false) {
			panic("test: the driver panics in the head's grant")
		}
		return context.WithValue(ctx, panickerGrant{}, true)
	}
	return ctx
}

// TraceQueryEnd counts a grant statement once it has ended: a statement
// still on its way could run after a release sent later on another
// connection, and be granted.
func (p *panicker) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(panickerGrant{}) != nil {
		p.grants.Add(1)
	}
}

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
	h := mustGrant(t, ctx, a, name, time.Minute)
	headPanic := make(chan any, 1)
	go func() {
		defer func() { headPanic <- recover() }()
		l, err := a.Acquire(ctx, name, time.Minute)
		t.Errorf("the head returned %v, %v; want a panic", l, err)
	}()
	waitLine(t, a, name, 1)
	deadline := time.Now().Add(10 * time.Second)
	for pk.grants.Load() < 2 { // the holder's grant and the head's first attempt, ended
		if time.Now().After(deadline) {
			t.Fatal("the head never tried")
		}
		time.Sleep(time.Millisecond)
	}
	waitHeadIdle(t, a, name) // its first attempt found the name held
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
	r := leaseWithin(t, w2, 30*time.Second, "the waiter behind a head that panicked")
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
				h := mustGrant(t, ctx, a, name, time.Minute)
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

// TestLineShortMaxWaitFreeLock (an unknown outcome is never reported as definite; nobody keeps a free lock from the others): Acquire of a free
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
	takePgx(pool, 4)(t)()
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
			h := mustGrant(t, ctx, a, name, time.Minute)
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

// listenerPids returns the pids of the sessions named app that listen for
// releases, read on a connection of the test's own.
func listenerPids(t *testing.T, c *pgx.Conn, app string) []int32 {
	t.Helper()
	rows, err := c.Query(context.Background(), "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN fencekit_release'", app)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// TestWaiterWokenAfterListenerKilled (nobody keeps a free lock from the others): the session that listens
// for releases on a waiter's behalf is ended by the server
// (pg_terminate_backend) while the waiter waits. A release by another
// process, made while the listener reconnects or after it listens again,
// still wakes the waiter: it is granted long before its next poll (a
// backoff of 20s here), never after a whole poll interval or ttl.
func TestWaiterWokenAfterListenerKilled(t *testing.T) {
	direct, err := pgx.Connect(context.Background(), testenv.PostgresURL())
	if err != nil {
		testenv.Missing(t, "PostgreSQL at "+testenv.PostgresURL(), err)
	}
	t.Cleanup(func() { direct.Close(context.Background()) })
	for _, style := range []string{"pgx", "database-sql"} {
		for _, when := range []string{"while it reconnects", "after it listens again"} {
			t.Run(style+"/"+when, func(t *testing.T) {
				sp := smallPgPool(t, style, 2)
				wa := newAcquirerOn(t, sp.newDB(), &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 20 * time.Second, Max: 20 * time.Second}})
				holder := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil) // another process: its release reaches the waiter only by NOTIFY
				name := fencetest.Name("listener-killed")
				ctx := context.Background()
				l := mustGrant(t, ctx, holder, name, time.Minute)
				wctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				got := goLease(func() (fence.Lease, error) { return wa.Acquire(wctx, name, time.Minute) })
				waitListening(t, sp.app, 1)
				old := listenerPids(t, direct, sp.app)
				if _, err := direct.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN fencekit_release'", sp.app); err != nil {
					t.Fatal(err)
				}
				if when == "after it listens again" {
					for deadline := time.Now().Add(30 * time.Second); ; {
						pids := listenerPids(t, direct, sp.app)
						if len(pids) > 0 && fmt.Sprint(pids) != fmt.Sprint(old) {
							break
						}
						if time.Now().After(deadline) {
							t.Fatalf("no new listening session 30s after the old one (%v) was ended", old)
						}
						time.Sleep(10 * time.Millisecond) // polling the server's view
					}
				}
				released := time.Now()
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-got
				if r.err != nil {
					t.Fatalf("waiter: %v", r.err)
				}
				if d := r.at.Sub(released); d > 10*time.Second {
					t.Errorf("waiter granted %v after the release, with its listener ended %s: it was not woken, it polled", d, when)
				}
				_ = r.l.Release(ctx)
			})
		}
	}
}

// TestWaiterArrivingAsListenerCloses (nobody keeps a free lock from the others): the last waiter of a *DB
// is granted, so its listening session closes; at once another waiter
// arrives (a new session is opened) and the lock it waits for is released
// by another process before that session listens. The release is not lost
// between the two sessions: the new waiter is granted long before its next
// poll (20s).
func TestWaiterArrivingAsListenerCloses(t *testing.T) {
	for _, style := range []string{"pgx", "database-sql"} {
		t.Run(style, func(t *testing.T) {
			sp := smallPgPool(t, style, 2)
			wa := newAcquirerOn(t, sp.newDB(), &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 20 * time.Second, Max: 20 * time.Second}})
			holder := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
			ctx := context.Background()
			first, second := fencetest.Name("closing-1"), fencetest.Name("closing-2")
			l1 := mustGrant(t, ctx, holder, first, time.Minute)
			l2 := mustGrant(t, ctx, holder, second, time.Minute)
			wctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			got1 := make(chan error, 1)
			go func() {
				l, err := wa.Acquire(wctx, first, time.Minute)
				if err == nil {
					_ = l.Release(ctx)
				}
				got1 <- err
			}()
			waitListening(t, sp.app, 1)
			if err := l1.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-got1; err != nil {
				t.Fatalf("first waiter: %v", err)
			}
			// The listener is closing now: the next waiter opens another.
			got2 := make(chan error, 1)
			go func() {
				l, err := wa.Acquire(wctx, second, time.Minute)
				if err == nil {
					_ = l.Release(ctx)
				}
				got2 <- err
			}()
			released := time.Now()
			if err := l2.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-got2; err != nil {
				t.Fatalf("second waiter: %v", err)
			}
			if d := time.Since(released); d > 10*time.Second {
				t.Errorf("second waiter granted %v after the release made while its listener opened: the release was missed, it polled", d)
			}
		})
	}
}

// smallPool is a handle on the test server whose pool has room for size
// connections, with a way to take them all (take) and give them back.
type smallPool struct {
	app   string              // application_name of every connection, to find them on the server
	newDB func() *sqlfence.DB // another sqlfence handle on the same pool
	// take holds every connection of the pool until the returned func runs.
	take func(t *testing.T) func()
}

func randomSuffix() string {
	var b [6]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// smallPgPool opens a pool of size connections on the test PostgreSQL
// server: a *pgxpool.Pool with MaxConns (style "pgx") or a *sql.DB with
// SetMaxOpenConns (style "database-sql").
func smallPgPool(t *testing.T, style string, size int) smallPool {
	t.Helper()
	app := "fencekit-smallpool-" + randomSuffix()
	ctx := context.Background()
	switch style {
	case "pgx":
		p := pgPool(t, pgOpts{params: map[string]string{"application_name": app}, maxConns: int32(size)})
		return smallPool{app: app, newDB: func() *sqlfence.DB { return sqlfence.Pgx(p) }, take: takePgx(p, size)}
	default:
		cc, err := pgx.ParseConfig(testenv.PostgresURL())
		if err != nil {
			t.Fatal(err)
		}
		cc.RuntimeParams["application_name"] = app
		db := stdlib.OpenDB(*cc)
		db.SetMaxOpenConns(size)
		if err := db.PingContext(ctx); err != nil {
			db.Close()
			testenv.Missing(t, "PostgreSQL at "+testenv.PostgresURL(), err)
		}
		t.Cleanup(func() { db.Close() })
		pgStd(t) // the default tables
		return smallPool{app: app, newDB: func() *sqlfence.DB { return sqlfence.Postgres(db) }, take: takeStd(db, size)}
	}
}

// takePgx takes all size connections of p; the function it returns gives
// them back.
func takePgx(p *pgxpool.Pool, size int) func(t *testing.T) func() {
	return takeConns(size, p.Acquire, (*pgxpool.Conn).Release)
}

// takeStd takes all size connections of db; the function it returns closes
// them.
func takeStd(db *sql.DB, size int) func(t *testing.T) func() {
	return takeConns(size, db.Conn, func(c *sql.Conn) { c.Close() })
}

// takeConns takes size connections with take; the function it returns gives
// each back with give.
func takeConns[C any](size int, take func(context.Context) (C, error), give func(C)) func(t *testing.T) func() {
	return func(t *testing.T) func() {
		var cs []C
		for range size {
			c, err := take(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			cs = append(cs, c)
		}
		return func() {
			for _, c := range cs {
				give(c)
			}
		}
	}
}

// waitListening waits until at least n sessions named app listen for
// releases on the server, read on a connection of the test's own.
func waitListening(t *testing.T, app string, n int) {
	t.Helper()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	for deadline := time.Now().Add(30 * time.Second); ; {
		var got int
		if err := c.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN fencekit_release'", app).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions listening after 30s, want %d", got, n)
		}
		time.Sleep(10 * time.Millisecond) // polling the server's view; not a synchronisation with the code under test
	}
}

// TestWaitersLeaveSmallPoolToHolder: Acquire calls that wait (on three
// handles over one pool, each of which listens for releases) never take the
// connections that the holder's Renew and Release and a fenced Write need,
// on pools of 1, 2 and 3 connections; each waiter is then granted in turn.
func TestWaitersLeaveSmallPoolToHolder(t *testing.T) {
	for _, style := range []string{"pgx", "database-sql"} {
		for _, size := range []int{1, 2, 3} {
			t.Run(fmt.Sprintf("%s/%d", style, size), func(t *testing.T) {
				sp := smallPgPool(t, style, size)
				holdWhileWaiting(t, size, sp.newDB, func(*testing.T, []*sqlfence.Acquirer, string) {
					// Every handle that can listen on this pool does (before,
					// each took a connection of the pool to listen on).
					waitListening(t, sp.app, min(smallPoolWaiters, size))
				})
			})
		}
	}
}

// TestMySQLWaitersLeaveSmallPoolToHolder is TestWaitersLeaveSmallPoolToHolder
// on MariaDB, whose waiters pin connections for their bells: at most a
// quarter of SetMaxOpenConns, none below 4, so never all of them.
func TestMySQLWaitersLeaveSmallPoolToHolder(t *testing.T) {
	for _, size := range []int{1, 3, 4, 8} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			db, _ := openMySQL(t, "")
			db.SetMaxOpenConns(size)
			holdWhileWaiting(t, size, func() *sqlfence.DB { return sqlfence.MySQL(db) }, func(t *testing.T, waiters []*sqlfence.Acquirer, name string) {
				// Each waiter is in its line, and on a pool with room for
				// bells (the holder's grant took the first pin) a ringer
				// holds a pinned connection.
				wantPins := 0
				if size/4 > 1 {
					wantPins = 1
				}
				for deadline := time.Now().Add(30 * time.Second); ; {
					pins, lined := 0, 0
					for _, wa := range waiters {
						pins += sqlfence.BellPinned(wa)
						lined += sqlfence.LineLen(wa, name)
					}
					if lined == len(waiters) && pins >= wantPins {
						return
					}
					if time.Now().After(deadline) {
						t.Fatalf("after 30s %d waiters in line with %d pins, want %d with %d", lined, pins, len(waiters), wantPins)
					}
					time.Sleep(10 * time.Millisecond) // polling the waiters' state; nothing waits on this loop
				}
			})
		})
	}
}

const smallPoolWaiters = 3

// holdWhileWaiting holds a lease on a handle of newDB while three waiters,
// each on a handle of its own, wait for it; once ready says they all wait,
// the holder renews, writes and releases, each within a generous bound, and
// each waiter is then granted in turn with a larger token.
func holdWhileWaiting(t *testing.T, size int, newDB func() *sqlfence.DB, ready func(t *testing.T, waiters []*sqlfence.Acquirer, name string)) {
	hdb := newDB()
	ha := newAcquirerOn(t, hdb, nil)
	w := newWriterOn(t, hdb, nil)
	name := "smallpool-" + randomSuffix()
	ctx := context.Background()
	l := mustGrant(t, ctx, ha, name, time.Minute)
	type result struct {
		l   fence.Lease
		err error
	}
	got := make(chan result, smallPoolWaiters)
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var waiters []*sqlfence.Acquirer
	for range smallPoolWaiters {
		wa := newAcquirerOn(t, newDB(), nil)
		waiters = append(waiters, wa)
		go func() {
			l, err := wa.Acquire(wctx, name, time.Minute)
			got <- result{l, err}
		}()
	}
	ready(t, waiters, name)

	step := func(what string, f func(ctx context.Context) error) {
		t.Helper()
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := f(sctx); err != nil {
			t.Fatalf("%s while %d waiters wait on a pool of %d: %v", what, smallPoolWaiters, size, err)
		}
	}
	step("renew", l.Renew)
	step("write", func(ctx context.Context) error { return w.Write(ctx, name, []byte("v"), l.Token()) })
	step("release", l.Release)
	last := l.Token()
	for i := range smallPoolWaiters {
		r := <-got
		if r.err != nil {
			t.Fatalf("waiter %d: %v", i, r.err)
		}
		if r.l.Token() <= last {
			t.Fatalf("waiter %d granted token %d, not above %d", i, r.l.Token(), last)
		}
		last = r.l.Token()
		step("waiter's release", r.l.Release)
	}
}

// notSentHandle is a handle whose every connection the test can take, so
// that a call's context ends while it waits for one.
type notSentHandle struct {
	fdb  *sqlfence.DB
	take func(t *testing.T) func()
}

// TestStatementNotSentIsNotUnknown: a call whose context ends while it waits
// for a connection of a full pool sent nothing, and says so: its error
// matches the context's, never fence.ErrUnknown, and nothing changed.
func TestStatementNotSentIsNotUnknown(t *testing.T) {
	handles := map[string]func(t *testing.T) notSentHandle{
		"pgx": func(t *testing.T) notSentHandle {
			sp := smallPgPool(t, "pgx", 1)
			return notSentHandle{sp.newDB(), sp.take}
		},
		"database-sql": func(t *testing.T) notSentHandle {
			sp := smallPgPool(t, "database-sql", 1)
			return notSentHandle{sp.newDB(), sp.take}
		},
		"mysql": func(t *testing.T) notSentHandle {
			db, fdb := openMySQL(t, "")
			db.SetMaxOpenConns(1)
			return notSentHandle{fdb, takeStd(db, 1)}
		},
		"sqlite": func(t *testing.T) notSentHandle {
			db, err := sqlfence.OpenSQLite(filepath.Join(t.TempDir(), "f.db"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			db.SetMaxOpenConns(1)
			return notSentHandle{sqlfence.SQLite(db), takeStd(db, 1)}
		},
	}
	for style, open := range handles {
		t.Run(style, func(t *testing.T) {
			h := open(t)
			ctx := context.Background()
			w := newWriterOn(t, h.fdb, nil)
			a := newAcquirerOn(t, h.fdb, nil)
			s, err := sqlfence.NewIdempotencyStore(h.fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, create := range []func(context.Context) error{w.CreateTable, a.CreateTable, s.CreateTable} {
				if err := create(ctx); err != nil {
					t.Fatal(err)
				}
			}
			name, key := "notsent-"+randomSuffix(), "notsent-"+randomSuffix()
			l := mustGrant(t, ctx, a, name, time.Minute)
			claimed, _, err := s.Begin(ctx, key+"-claimed", "fp", "me", time.Minute)
			if err != nil {
				t.Fatal(err)
			}

			giveBack := h.take(t)
			calls := []struct {
				what string
				f    func(ctx context.Context) error
			}{
				{"write", func(ctx context.Context) error { return w.Write(ctx, key, []byte("v"), l.Token()) }},
				{"delete", func(ctx context.Context) error { return w.Delete(ctx, key+"-deleted", l.Token()) }},
				{"renew", l.Renew},
				{"try acquire", func(ctx context.Context) error {
					_, err := a.TryAcquire(ctx, name+"-other", time.Minute)
					return err
				}},
				{"bump", func(ctx context.Context) error { return a.Bump(ctx, name+"-bumped", fence.MaxToken-1) }},
				{"idempotency begin", func(ctx context.Context) error {
					_, _, err := s.Begin(ctx, key, "fp", "me", time.Minute)
					return err
				}},
				{"idempotency update", func(ctx context.Context) error {
					_, err := s.Update(ctx, claimed.Key, idempotency.Claimed, claimed.Fence, idempotency.Change{State: idempotency.Released, Fence: claimed.Fence})
					return err
				}},
				{"idempotency get", func(ctx context.Context) error {
					_, err := s.Get(ctx, key)
					return err
				}},
				{"release", l.Release}, // last: the lease ends locally whatever the outcome
			}
			for _, c := range calls {
				cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
				err := c.f(cctx)
				cancel()
				if err == nil || errors.Is(err, fence.ErrUnknown) || !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("%s that waited for a connection until its context ended: %v; want the context's error, not fence.ErrUnknown", c.what, err)
				}
			}
			giveBack()

			// Nothing was sent: nothing changed.
			if _, _, err := w.Read(ctx, key); !errors.Is(err, fence.ErrNotFound) {
				t.Errorf("read of the key written: %v, want fence.ErrNotFound", err)
			}
			if info, err := a.Inspect(ctx, name); err != nil || !info.Held || info.Token != l.Token() {
				t.Errorf("inspect after the release that was not sent: %+v, %v; want held with token %d", info, err, l.Token())
			}
			if info, err := a.Inspect(ctx, name+"-other"); !errors.Is(err, fence.ErrNotFound) {
				t.Errorf("inspect of the name tried: %+v, %v; want fence.ErrNotFound", info, err)
			}
			if _, err := s.Get(ctx, key); !errors.Is(err, fence.ErrNotFound) {
				t.Errorf("idempotency get of the key begun: %v, want fence.ErrNotFound", err)
			}
			if rec, err := s.Get(ctx, claimed.Key); err != nil || rec.State != idempotency.Claimed {
				t.Errorf("idempotency get of the key updated: %+v, %v; want it claimed still", rec, err)
			}
		})
	}
}
