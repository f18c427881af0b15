package sqlfence_test

// Review 8 (commit d021308): the handoff to a head that is inside an attempt
// of its own (wakeup.Line.Offer, Hand and the take-back timer), against the
// real PostgreSQL server.

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// stmtGate holds the first statement that match accepts after arm, until
// open is closed or the statement's context ends.
type stmtGate struct {
	match   func(sql string) bool
	armed   atomic.Bool
	seen    atomic.Int64 // the statements match accepted, armed or not
	started chan struct{}
	open    chan struct{}
	once    sync.Once
}

func newStmtGate(match func(string) bool) *stmtGate {
	return &stmtGate{match: match, started: make(chan struct{}), open: make(chan struct{})}
}

func (g *stmtGate) release() { g.once.Do(func() { close(g.open) }) }

// gateTracer runs each of its gates on every statement a connection starts.
type gateTracer []*stmtGate

func (tr gateTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	for _, g := range tr {
		if !g.match(d.SQL) {
			continue
		}
		g.seen.Add(1)
		if g.armed.CompareAndSwap(true, false) {
			close(g.started)
			select {
			case <-g.open:
			case <-ctx.Done():
			}
		}
	}
	return ctx
}

func (gateTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func isGrantStmt(sql string) bool {
	return strings.Contains(sql, "INSERT INTO") && strings.Contains(sql, "RETURNING token")
}

func isHandoffStmt(sql string) bool { return strings.HasPrefix(sql, "WITH g AS (UPDATE") }

// waitUntil waits up to d for f to report true, polling an observable state.
func waitUntil(t *testing.T, d time.Duration, what string, f func() bool) {
	t.Helper()
	for end := time.Now().Add(d); !f(); {
		if time.Now().After(end) {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(2 * time.Millisecond) // polling a state
	}
}

// lineStacks returns the stacks of the goroutines that are inside the
// line's code, for a failure's evidence.
func lineStacks() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "internal/wakeup") {
			out = append(out, g)
		}
	}
	return strings.Join(out, "\n\n")
}

// waitRowFree waits until check shows name not held (a lease expired on the
// server).
func waitRowFree(t *testing.T, check *sqlfence.Acquirer, name string) {
	t.Helper()
	waitUntil(t, 10*time.Second, "the row to expire on the server", func() bool {
		info, err := check.Inspect(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		return !info.Held
	})
}

// TestHandoffSecondOfferWhileHeadTries checks the promise of Hand ("never
// blocks: one offer at a time, and each outcome is received before the next
// offer") and Release's, that a release returns, now that Offer also offers
// to a head inside an attempt of its own.
//
// The head's attempt is stuck in its grant statement (a slow connection,
// well under the stall limit). A release through the acquirer of a lease
// that had expired on the server offers to that head, finds nothing to hand
// over (ErrLost) and hands it an empty outcome, which waits in the head's
// channel until its attempt ends. The lock is free, so a TryAcquire through
// the same acquirer is granted; its Release offers to the same head again
// (still trying, still young), grants it the lock, and Hand sends the second
// outcome into the full channel while holding the place's mutex. The head's
// attempt, when it ends, needs that mutex (Trying(false)) before it can
// drain the channel: Release and the head hang for ever, and so would the
// waiters behind the head (HeadStalled takes the same mutex).
func TestHandoffSecondOfferWhileHeadTries(t *testing.T) {
	ctx := context.Background()
	grant := newStmtGate(isGrantStmt)
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, gateTracer{grant})), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	t.Cleanup(grant.release) // before the pool closes
	sqlfence.SetLineStall(a, time.Minute)
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("review8-second-offer")

	l1, err := a.TryAcquire(ctx, name, 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	grant.armed.Store(true)
	hctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	head := goAcquire(hctx, a, name, time.Minute)
	<-grant.started // the head is inside its first attempt
	if !sqlfence.LineHeadTrying(a, name) {
		t.Fatal("the head is not inside an attempt")
	}
	waitRowFree(t, check, name)
	if err := l1.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Release of a lease expired on the server: %v, want ErrLost", err)
	}
	l2, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatalf("TryAcquire of the free lock while the head's attempt is stuck: %v", err)
	}
	released := make(chan error, 1)
	go func() { released <- l2.Release(ctx) }()
	select {
	case err := <-released:
		if err != nil {
			t.Fatalf("the second release: %v", err)
		}
	case <-time.After(5 * time.Second):
		grant.release()
		select {
		case <-head:
			t.Fatal("the second release through the acquirer did not return within 5s while the head was inside its attempt")
		case <-time.After(5 * time.Second):
		}
		t.Fatalf("the second release through the acquirer did not return within 5s while the head was inside its attempt (an empty handoff already waited in its channel: Hand blocks on the full channel holding the place's mutex); the head, unstuck, did not return either 5s later (deadlock: its attempt waits for that mutex); line %d; goroutines in the line:\n%s", sqlfence.LineLen(a, name), lineStacks())
	}
	grant.release()
	r := within(t, head, 10*time.Second, "the head after its attempt ended")
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.l.Release(ctx)
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() {
		t.Fatalf("the row: %+v, %v; want held by the head's token %d", info, err, r.l.Token())
	}
}

// TestHandoffLateGrantYields checks ErrYield's promise (wakeup.ErrYield,
// Acquire: "Granted past its local deadline and given back: try again, after
// the others of the line and a full backoff delay"): a head whose grant
// comes back past its local deadline lets the waiters behind it go first.
//
// The head's grant statement is held up longer than the head's ttl; the
// lock is free, so the grant lands late. tryAcquire gives it back
// (giveBackLate → Release), and that release, through the same acquirer,
// now offers to the head of the line, which is the head itself, inside the
// very attempt that is giving the grant back (a young attempt: the stall
// limit is a minute). The release hands the lock straight back to the head;
// its attempt then yields (moves it behind the next waiter), but it takes
// the handoff from its channel and returns a lease at once, ahead of the
// waiter it yielded to, which is still waiting.
func TestHandoffLateGrantYields(t *testing.T) {
	ctx := context.Background()
	grant, handoffs := newStmtGate(isGrantStmt), newStmtGate(isHandoffStmt)
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, gateTracer{grant, handoffs})), &sqlfence.AcquirerOptions{
		Backoff: fence.Backoff{Min: 20 * time.Millisecond, Max: 50 * time.Millisecond, MaxWait: time.Minute}, DisableNotify: true})
	t.Cleanup(grant.release)
	sqlfence.SetLineStall(a, time.Minute)
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("review8-late-yield")
	const ttl = 200 * time.Millisecond

	// Another acquirer holds the lock, so the head's release is not a
	// handoff and the second waiter joins behind a head stuck in its grant.
	other, err := check.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	grant.armed.Store(true)
	head := goAcquire(ctx, a, name, ttl)
	<-grant.started
	next := goAcquire(ctx, a, name, time.Minute)
	waitLine(t, a, name, 2)
	if err := other.Release(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * ttl) // the scenario: the head's grant statement is held up past its ttl
	grant.release()

	// The head's grant lands late and is given back; the next waiter is to
	// be granted before the head.
	var first string
	var rh, rn acquired
	select {
	case rh = <-head:
		first = "head"
	case rn = <-next:
		first = "next"
	case <-time.After(10 * time.Second):
		t.Fatalf("neither waiter granted 10s after the late grant (line %d)", sqlfence.LineLen(a, name))
	}
	if first == "head" {
		if rh.err != nil {
			t.Fatalf("the head: %v", rh.err)
		}
		info, _ := check.Inspect(ctx, name)
		n := handoffs.seen.Load()
		_ = rh.l.Release(ctx)
		rn = within(t, next, 10*time.Second, "the next waiter")
		if rn.err == nil {
			_ = rn.l.Release(ctx)
		}
		t.Fatalf("the head whose grant came back past its ttl was granted first (token %d; row %+v; %d handoff statements ran, none released through the acquirer but the head's own give-back) while the waiter behind it still waited: it did not yield (its own give-back handed the lock back to it)", rh.l.Token(), info, n)
	}
	if rn.err != nil {
		t.Fatalf("the next waiter: %v", rn.err)
	}
	_ = rn.l.Release(ctx)
	rh = within(t, head, 10*time.Second, "the head after the next waiter's release")
	if rh.err != nil {
		t.Fatal(rh.err)
	}
	_ = rh.l.Release(ctx)
}

// TestHandoffOwnGrantDuringOffer checks that an offer to a head inside an
// attempt cannot leave two holders or a grant held by nobody: the head's own
// grant lands while the handoff statement is on its way (the released lease
// had expired on the server). The head returns its own grant, which the row
// shows; the release reports ErrLost (it held nothing) and hands nothing.
func TestHandoffOwnGrantDuringOffer(t *testing.T) {
	ctx := context.Background()
	grant, handoff := newStmtGate(isGrantStmt), newStmtGate(isHandoffStmt)
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, gateTracer{grant, handoff})), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	t.Cleanup(grant.release)
	t.Cleanup(handoff.release)
	sqlfence.SetLineStall(a, time.Minute)
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("review8-own-grant")
	l1, err := a.TryAcquire(ctx, name, 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	grant.armed.Store(true)
	head := goAcquire(ctx, a, name, time.Minute)
	<-grant.started
	waitRowFree(t, check, name)
	handoff.armed.Store(true)
	released := make(chan error, 1)
	go func() { released <- l1.Release(ctx) }()
	<-handoff.started // offered: the handoff statement is on its way
	grant.release()
	r := within(t, head, 10*time.Second, "the head whose own grant landed during the offer")
	if r.err != nil {
		t.Fatal(r.err)
	}
	handoff.release()
	if err := <-released; !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Release of a lease expired on the server (the head was granted meanwhile): %v, want ErrLost", err)
	}
	defer r.l.Release(ctx)
	if r.l.Context().Err() != nil {
		t.Fatalf("the head's lease is already done: %v", context.Cause(r.l.Context()))
	}
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() {
		t.Fatalf("the row: %+v, %v; want held by the head's own token %d", info, err, r.l.Token())
	}
	if n := sqlfence.LineLen(a, name); n != 0 {
		t.Fatalf("line has %d waiters after every Acquire returned", n)
	}
}

// TestHandoffTakeBackRace checks the take-back timer ("a handoff it has not
// taken within the stall limit is taken back and settled") against the head
// taking the handoff at about the same moment: the head's attempt is stuck
// while the release hands it the lock, and is let go at about the stall
// limit. Whatever wins, the head returns a lease that is live and that the
// row shows as its holder (not one the timer released), the release returns
// nil, and nothing is left held when the head releases.
func TestHandoffTakeBackRace(t *testing.T) {
	ctx := context.Background()
	const stall = 60 * time.Millisecond
	takenBack := 0
	defer func() { t.Logf("the timer took the handoff back in %d of 12 iterations", takenBack) }()
	for i := range 12 {
		grant := newStmtGate(isGrantStmt)
		plain := newStmtGate(func(sql string) bool { return strings.Contains(sql, "SET expires_at = 0") })
		a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, gateTracer{grant, plain})), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
		sqlfence.SetLineStall(a, stall)
		check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
		name := fencetest.Name("review8-take-back")
		l1, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		grant.armed.Store(true)
		head := goAcquire(ctx, a, name, time.Minute)
		<-grant.started
		if err := l1.Release(ctx); err != nil {
			t.Fatalf("iteration %d: the release: %v", i, err)
		}
		// Let the head's attempt go at about the stall limit after the hand.
		time.Sleep(stall - 15*time.Millisecond + time.Duration(i)*3*time.Millisecond)
		grant.release()
		r := within(t, head, 10*time.Second, "the head")
		if r.err != nil {
			t.Fatalf("iteration %d: the head: %v", i, r.err)
		}
		if r.l.Context().Err() != nil {
			t.Fatalf("iteration %d: the head returned a lease already done: %v", i, context.Cause(r.l.Context()))
		}
		info, err := check.Inspect(ctx, name)
		if err != nil || !info.Held || info.Token != r.l.Token() {
			t.Fatalf("iteration %d: the row: %+v, %v; want held by the head's token %d", i, info, err, r.l.Token())
		}
		if plain.seen.Load() > 0 { // the timer's abandon released the handed lease
			takenBack++
		}
		if err := r.l.Release(ctx); err != nil {
			t.Fatalf("iteration %d: the head's release: %v", i, err)
		}
		if info, err := check.Inspect(ctx, name); err != nil || info.Held {
			t.Fatalf("iteration %d: the row after the head's release: %+v, %v", i, info, err)
		}
	}
}
