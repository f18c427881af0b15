package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/jackc/pgx/v5"
)

// Late grants: a grant that comes back past its local deadline is given
// back (TryAcquire returns ErrLost, Acquire tries again; SQLite's context
// errors become ErrUnknown). Every test runs against the real
// servers (SQLite files, PostgreSQL, MariaDB/MySQL).
//
// Making every grant late, deterministically: an acquirer whose Drift is
// its ttl less 1µs has a local deadline 1µs after the grant's request was
// sent, so each grant it makes comes back late (any statement takes more
// than 1µs) and is given back, while the row's server-side ttl is long
// enough to see whether the give-back happened.

// alwaysLate is an acquirer on db whose every grant of ttl comes back past
// its local deadline (Drift = ttl - 1µs).
func alwaysLate(t *testing.T, db *sqlfence.DB, ttl time.Duration, b fence.Backoff) *sqlfence.Acquirer {
	t.Helper()
	return newAcquirerOn(t, db, &sqlfence.AcquirerOptions{Drift: ttl - time.Microsecond, Backoff: b})
}

func counterOf(t *testing.T, a *sqlfence.Acquirer, name string) fence.Token {
	t.Helper()
	info, err := a.Inspect(context.Background(), name)
	if err != nil {
		t.Fatalf("Inspect %q: %v", name, err)
	}
	return info.Counter
}

// TestLateGrantsPacedByBackoff (nobody keeps a free lock from the others, the Backoff promise): when
// every grant comes back late, a waiting Acquire must still pace its
// attempts with its Backoff (here Min 100ms, Max 200ms: about 10 attempts
// in a second, 40 at the very most), and give up at its deadline with an
// error matching ErrHeld and DeadlineExceeded, leaving the name free. The
// give-back's own Release pokes the head of the acquirer's line (and on
// PostgreSQL notifies its listener): if the head is woken by its own
// give-back it tries again at once, in a loop, hammering the database with a
// grant and a release per round trip. The row's counter counts the grants.
func TestLateGrantsPacedByBackoff(t *testing.T) {
	for dname, db := range lineDialects(t) {
		t.Run(dname, func(t *testing.T) {
			ctx := context.Background()
			const ttl = 10 * time.Second
			name := fencetest.Name("late-pace")
			normal := newAcquirerOn(t, db, nil)
			l := mustGrant(t, ctx, normal, name, ttl)
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			// A counter far above the clock, so that each grant adds one (a
			// PostgreSQL grant takes the larger of the counter + 1 and the clock).
			if err := normal.Bump(ctx, name, fence.Token(time.Now().UnixMicro())+1e12); err != nil {
				t.Fatal(err)
			}
			before := counterOf(t, normal, name)

			a := alwaysLate(t, db, ttl, fence.Backoff{Min: 100 * time.Millisecond, Max: 200 * time.Millisecond})
			wctx, cancel := context.WithTimeout(ctx, time.Second)
			start := time.Now()
			l, err := a.Acquire(wctx, name, ttl)
			took := time.Since(start)
			cancel()
			if err == nil {
				l.Release(ctx)
				t.Fatalf("Acquire granted a lease whose grant came back past its 1µs local deadline")
			}
			grants := counterOf(t, normal, name) - before
			t.Logf("Acquire: %v after %v, %d grants (each given back)", err, took, grants)
			if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Acquire giving up: %v; want ErrHeld and DeadlineExceeded", err)
			}
			if grants > 40 {
				t.Errorf("Acquire made %d grants (each one given back) in %v with a Backoff of Min 100ms, Max 200ms: "+
					"it does not pause between late grants (the give-back's own Release wakes it), at most about 10 expected", grants, took)
			}
			if info, err := normal.Inspect(ctx, name); err != nil || info.Held {
				t.Errorf("after Acquire gave up: %+v, %v; want the name free (every late grant given back)", info, err)
			}
		})
	}
}

// TestLateDefaultDriftShortTTL (inputs at the limits): with the default Drift (1% of
// the ttl plus 2ms) a ttl of 1ms or 2ms is accepted, yet its local deadline
// lies before the grant's request: every grant comes back late and is given
// back. TryAcquire then can never grant, and Acquire on a name nobody holds
// waits its whole context and reports ErrHeld (the name was free all along),
// after granting and giving back the name over and over. Either such a ttl
// is refused with ErrInvalid naming the ttl (as for a Drift set in the
// options), or it is granted.
func TestLateDefaultDriftShortTTL(t *testing.T) {
	ctx := context.Background()
	_, db := openSQLite(t)
	a := newSQLiteAcquirer(t, db)
	for _, ttl := range []time.Duration{time.Millisecond, 2 * time.Millisecond} {
		name := fencetest.Name("short-ttl")
		l, err := a.TryAcquire(ctx, name, ttl)
		var ie *fence.InvalidError
		switch {
		case err == nil:
			l.Release(ctx)
		case errors.As(err, &ie):
		default:
			t.Errorf("TryAcquire(%v) on a free name with the default Drift: %v; want ErrInvalid naming the ttl, or a lease", ttl, err)
		}
		wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		start := time.Now()
		l, err = a.Acquire(wctx, name, ttl)
		took := time.Since(start)
		cancel()
		switch {
		case err == nil:
			l.Release(ctx)
		case errors.As(err, &ie):
		default:
			info, _ := a.Inspect(ctx, name)
			t.Errorf("Acquire(%v) on a name nobody holds, default Drift: %v after %v (the counter reached %d: granted and given back again and again); "+
				"want ErrInvalid naming the ttl, or a lease", ttl, err, took, info.Counter)
		}
	}
}

// TestLateHeldNameNeverLost: an acquirer whose grants would all come
// back late, asking for a name another acquirer holds, gets ErrHeld (never
// ErrLost: fence.Acquirer allows ErrLost only for a grant it made); its
// Acquire gives up with ErrHeld and DeadlineExceeded; and the holder's lease
// is untouched (still renewable, its token on the row).
func TestLateHeldNameNeverLost(t *testing.T) {
	for dname, db := range lineDialects(t) {
		t.Run(dname, func(t *testing.T) {
			ctx := context.Background()
			const ttl = 10 * time.Second
			name := fencetest.Name("late-held")
			holder := newAcquirerOn(t, db, nil)
			h := mustGrant(t, ctx, holder, name, time.Minute)
			defer h.Release(ctx)
			a := alwaysLate(t, db, ttl, fence.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond})
			l, err := a.TryAcquire(ctx, name, ttl)
			if err == nil || !errors.Is(err, fence.ErrHeld) || errors.Is(err, fence.ErrLost) {
				if l != nil {
					l.Release(ctx)
				}
				t.Errorf("TryAcquire of a name another holds: %v, %v; want ErrHeld only", l, err)
			}
			wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			l, err = a.Acquire(wctx, name, ttl)
			cancel()
			if err == nil || !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, fence.ErrLost) {
				if l != nil {
					l.Release(ctx)
				}
				t.Errorf("Acquire of a name another holds: %v, %v; want ErrHeld and DeadlineExceeded", l, err)
			}
			if err := h.Renew(ctx); err != nil {
				t.Errorf("the holder's Renew after the other's attempts: %v", err)
			}
			if info, err := holder.Inspect(ctx, name); err != nil || !info.Held || info.Token != h.Token() {
				t.Errorf("the row after the other's attempts: %+v, %v; want held with token %d", info, err, h.Token())
			}
		})
	}
}

// TestLateTokensAfterGiveBacks: grants that came back late and were
// given back still advance the counter: the next real grant's token is
// larger than every token handed out (and given back) before, and the name
// is free after each give-back.
func TestLateTokensAfterGiveBacks(t *testing.T) {
	for dname, db := range lineDialects(t) {
		t.Run(dname, func(t *testing.T) {
			ctx := context.Background()
			const ttl = 10 * time.Second
			name := fencetest.Name("late-tokens")
			normal := newAcquirerOn(t, db, nil)
			a := alwaysLate(t, db, ttl, fence.Backoff{})
			var last fence.Token
			for i := 0; i < 3; i++ {
				l, err := a.TryAcquire(ctx, name, ttl)
				if l != nil || !errors.Is(err, fence.ErrLost) || errors.Is(err, fence.ErrHeld) {
					t.Fatalf("TryAcquire #%d whose grant came back late: %v, %v; want a nil lease and ErrLost", i, l, err)
				}
				info, err := normal.Inspect(ctx, name)
				if err != nil || info.Held {
					t.Fatalf("after give-back #%d: %+v, %v; want the name free", i, info, err)
				}
				if info.Counter <= last {
					t.Fatalf("counter %d after give-back #%d, was %d", info.Counter, i, last)
				}
				last = info.Counter
			}
			l := mustGrant(t, ctx, normal, name, ttl)
			defer l.Release(ctx)
			if l.Token() <= last {
				t.Errorf("token %d granted after tokens up to %d were given back", l.Token(), last)
			}
		})
	}
}

// lateTracer delays (start) or holds (end) chosen grant statements of a pgx
// pool on the client's side, as a slow network would: a grant whose send is
// delayed is made after its local deadline; a grant whose reply is held has
// been applied by the server and is confirmed only when released.
type lateTracer struct {
	// delayTTL: grants with this ttl (ms) are delayed by delay before they are sent.
	delayTTL int64
	delay    time.Duration
	// holdName: the first grant of this name, once applied, has its reply
	// held until release is closed; held is closed when it is.
	holdName string
	armed    atomic.Bool
	held     chan struct{}
	release  chan struct{}
}

type holdKey struct{}

func isGrant(sql string) bool {
	return strings.Contains(sql, "INSERT INTO") && strings.Contains(sql, "RETURNING token")
}

func (lt *lateTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "WITH g AS (UPDATE") && len(d.Args) == 4 {
		// A handoff grants the head with its ttl, the 4th argument: as
		// slow as the head's own grants.
		if ms, ok := d.Args[3].(int64); ok && lt.delayTTL != 0 && ms == lt.delayTTL {
			time.Sleep(lt.delay)
		}
		return ctx
	}
	if !isGrant(d.SQL) || len(d.Args) < 3 {
		return ctx
	}
	if ms, ok := d.Args[2].(int64); ok && lt.delayTTL != 0 && ms == lt.delayTTL {
		time.Sleep(lt.delay)
	}
	if n, ok := d.Args[0].(string); ok && lt.holdName != "" && n == lt.holdName && lt.armed.CompareAndSwap(true, false) {
		return context.WithValue(ctx, holdKey{}, true)
	}
	return ctx
}

func (lt *lateTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if ctx.Value(holdKey{}) == nil {
		return
	}
	close(lt.held)
	<-lt.release
}

// TestLateGrantAfterTakeover (nobody keeps a free lock from the others, Release is token-checked):
// a grant is applied on PostgreSQL and its reply is held past the lease's
// ttl; meanwhile the row expires on the server and another acquirer takes
// the name over. When the late reply arrives, TryAcquire must return ErrLost
// with a nil lease, and its give-back must not free the new holder's grant.
func TestLateGrantAfterTakeover(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("late-takeover")
	tr := &lateTracer{holdName: name, held: make(chan struct{}), release: make(chan struct{})}
	tr.armed.Store(true)
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, tr)), nil)
	other := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	const ttl = 300 * time.Millisecond
	got := goLease(func() (fence.Lease, error) { return a.TryAcquire(ctx, name, ttl) })
	<-tr.held // the grant was applied; its reply is held
	var first fence.Token
	for {
		info, err := other.Inspect(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if first == 0 {
			if !info.Held || info.Owner != a.Owner() {
				t.Fatalf("the row while the grant's reply is held: %+v; want held by %s", info, a.Owner())
			}
			first = info.Token
		}
		if !info.Held {
			break // expired on the server
		}
		time.Sleep(20 * time.Millisecond)
	}
	h := mustGrant(t, ctx, other, name, time.Minute)
	defer h.Release(ctx)
	close(tr.release)
	r := <-got
	if r.l != nil || !errors.Is(r.err, fence.ErrLost) {
		if r.l != nil {
			r.l.Release(ctx)
		}
		t.Errorf("TryAcquire whose grant (token %d) was confirmed after another took over: %v, %v; want a nil lease and ErrLost", first, r.l, r.err)
	}
	if err := h.Renew(ctx); err != nil {
		t.Errorf("the new holder's Renew after the late grant was given back: %v (its grant was freed)", err)
	}
	if info, err := other.Inspect(ctx, name); err != nil || !info.Held || info.Token != h.Token() {
		t.Errorf("the row after the late grant was given back: %+v, %v; want held by the new holder, token %d", info, err, h.Token())
	}
}

// TestLateHeadLeavesFreeLockToLine (one slow participant
// must not keep a free lock from the others): in one acquirer's line on
// PostgreSQL, the head asks for a 100ms lease and each of its grants (its
// own, and the handoffs of releases through the acquirer) is sent 150ms late
// (a slow path: every one comes back past its local deadline and is given
// back), so it can never be granted; the waiter behind it asks for
// a 1-minute lease on the same name, which nobody holds. The waiter must be
// granted well before the head gives up (head's wait 6s, waiter's 4s):
// the head's attempts never stall for the line's 1s, and the name is free
// between them.
func TestLateHeadLeavesFreeLockToLine(t *testing.T) {
	ctx := context.Background()
	tr := &lateTracer{delayTTL: 100, delay: 150 * time.Millisecond}
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, tr)), nil)
	name := fencetest.Name("late-head")
	hctx, hcancel := context.WithTimeout(ctx, 6*time.Second)
	defer hcancel()
	head := goAcquire(hctx, a, name, 100*time.Millisecond)
	waitLine(t, a, name, 1)
	wctx, wcancel := context.WithTimeout(ctx, 4*time.Second)
	defer wcancel()
	start := time.Now()
	w := goAcquire(wctx, a, name, time.Minute)
	r := within(t, w, 10*time.Second, "the waiter behind a head whose grants come back late")
	if r.err != nil {
		info, _ := a.Inspect(ctx, name)
		t.Errorf("the waiter (1-minute lease) behind a head whose every grant comes back late: %v after %v, on a name nobody holds (%+v); "+
			"want granted while the head waits on", r.err, r.at.Sub(start), info)
	} else {
		r.l.Release(ctx)
	}
	hcancel()
	if h := within(t, head, 10*time.Second, "the head"); h.err == nil {
		h.l.Release(ctx)
		t.Errorf("the head was granted a 100ms lease whose grants are sent 150ms late")
	}
}

// TestLateGrantGivenBackPostgres: a grant sent after its 300ms
// lease's local deadline (the request waits 400ms on the client's side)
// comes back late: TryAcquire returns ErrLost with a nil lease, and the name
// is free at once (not held for the ttl): another acquirer is granted, with
// a larger token.
func TestLateGrantGivenBackPostgres(t *testing.T) {
	ctx := context.Background()
	tr := &lateTracer{delayTTL: 300, delay: 400 * time.Millisecond}
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, tr)), nil)
	other := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("late-pg")
	l, err := a.TryAcquire(ctx, name, 300*time.Millisecond)
	if l != nil || !errors.Is(err, fence.ErrLost) {
		if l != nil {
			l.Release(ctx)
		}
		t.Fatalf("TryAcquire whose grant came back late: %v, %v; want a nil lease and ErrLost", l, err)
	}
	given := counterOf(t, other, name)
	h, err := other.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		info, _ := other.Inspect(ctx, name)
		t.Fatalf("another acquirer right after the late grant was given back: %v (%+v)", err, info)
	}
	defer h.Release(ctx)
	if h.Token() <= given {
		t.Errorf("token %d granted after token %d was given back", h.Token(), given)
	}
}

// TestLateGrantThroughPartitionMySQL: on MariaDB/MySQL, a grant whose
// request is held by a partition for twice its ttl (then delivered) comes
// back late: TryAcquire returns ErrLost with a nil lease, and the name is free
// right after.
func TestLateGrantThroughPartitionMySQL(t *testing.T) {
	ctx := context.Background()
	_, direct := openMySQL(t, "")
	p := faultnet.Start(t, mysqlAddr(t))
	a := newAcquirerOn(t, sqlfence.MySQL(proxiedMySQL(t, p)), nil)
	other := newAcquirerOn(t, direct, nil)
	const ttl = 500 * time.Millisecond
	// Warm the connection (the dial goes through the proxy).
	warm := fencetest.Name("late-my-warm")
	if l, err := a.TryAcquire(ctx, warm, ttl); err != nil {
		t.Fatal(err)
	} else {
		l.Release(ctx)
	}
	name := fencetest.Name("late-my")
	p.Partition()
	got := goLease(func() (fence.Lease, error) { return a.TryAcquire(ctx, name, ttl) })
	time.Sleep(2 * ttl) // the fault: the request waits this long in the network
	p.Heal()
	r := <-got
	if r.l != nil || !errors.Is(r.err, fence.ErrLost) {
		if r.l != nil {
			r.l.Release(ctx)
		}
		t.Fatalf("TryAcquire whose request was held %v by a partition: %v, %v; want a nil lease and ErrLost", 2*ttl, r.l, r.err)
	}
	h, err := other.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		info, _ := other.Inspect(ctx, name)
		t.Fatalf("another acquirer right after the late grant was given back: %v (%+v)", err, info)
	}
	h.Release(ctx)
}

// nthCarrying matches the n-th client chunk that carries s (1-based).
func nthCarrying(s string, n int64) func([]byte) bool {
	var seen atomic.Int64
	return func(b []byte) bool {
		return faultnet.Carries(b, s) && seen.Add(1) == n
	}
}

// TestLateGiveBackReleaseReplyLost (an unknown outcome is never reported as definite; nobody keeps a free lock from the others): a grant comes back
// late and the reply to its give-back Release is lost (the release landed).
// TryAcquire must return ErrLost with a nil lease (never a lease, never a
// bare transport error), and the name must be free: the give-back recognises
// its own applied release.
func TestLateGiveBackReleaseReplyLost(t *testing.T) {
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			const ttl = 10 * time.Second
			a := alwaysLate(t, p.db, ttl, fence.Backoff{})
			other := newAcquirerOn(t, p.direct, nil)
			name := fencetest.Name("late-lostrel")
			// The first chunk carrying the name is the grant, the second
			// the give-back's release.
			var l fence.Lease
			err := lose(t, p.proxy, nthCarrying(name, 2), func() error {
				var err error
				l, err = a.TryAcquire(ctx, name, ttl)
				return err
			})
			if l != nil || !errors.Is(err, fence.ErrLost) {
				if l != nil {
					l.Release(ctx)
				}
				t.Fatalf("TryAcquire of a late grant whose give-back's reply was lost: %v, %v; want a nil lease and ErrLost", l, err)
			}
			if info, err := other.Inspect(ctx, name); err != nil || info.Held {
				t.Errorf("after the give-back whose reply was lost: %+v, %v; want the name free", info, err)
			}
		})
	}
}

// TestLateGiveBackReleaseFails: a grant comes back late and every attempt
// of its give-back Release is dropped before the server sees it. TryAcquire
// must still return ErrLost with a nil lease (the grant holds nothing for the
// caller); the row then stays held until its ttl, and must still carry the
// given-back token (no other grant was made).
func TestLateGiveBackReleaseFails(t *testing.T) {
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			const ttl = 10 * time.Second
			owner := fencetest.Name("late-owner")
			a := newAcquirerOn(t, p.db, &sqlfence.AcquirerOptions{Owner: owner, Drift: ttl - time.Microsecond})
			other := newAcquirerOn(t, p.direct, nil)
			name := fencetest.Name("late-droprel")
			// The grant's request carries the name and the owner; the
			// give-back's release carries the name only: every release
			// attempt is dropped.
			var dropped atomic.Int64
			for i := 0; i < 20; i++ {
				p.proxy.DropRequest(func(b []byte) bool {
					if faultnet.Carries(b, name) && !faultnet.Carries(b, owner) {
						dropped.Add(1)
						return true
					}
					return false
				})
			}
			l, err := a.TryAcquire(ctx, name, ttl)
			if dropped.Load() == 0 {
				t.Fatalf("the give-back's release was never dropped (TryAcquire: %v): the test did not test it", err)
			}
			if l != nil || !errors.Is(err, fence.ErrLost) {
				if l != nil {
					l.Release(ctx)
				}
				t.Fatalf("TryAcquire of a late grant whose give-back failed: %v, %v; want a nil lease and ErrLost", l, err)
			}
			t.Logf("TryAcquire: %v", err)
			info, ierr := other.Inspect(ctx, name)
			if ierr != nil {
				t.Fatal(ierr)
			}
			if info.Held && info.Owner != a.Owner() {
				t.Errorf("the row after a failed give-back: %+v; want held by %s (the given-back grant) or free", info, a.Owner())
			}
		})
	}
}

// TestLateGuardsAfterGiveBack: with AdvanceGuards, a late grant advances
// the guard row in the same step and is then given back. The next real
// grant's token must pass the guard (the guard was not left above it), and
// the given-back token must be rejected by it.
func TestLateGuardsAfterGiveBack(t *testing.T) {
	ctx := context.Background()
	raw, db := openSQLite(t)
	newSQLiteAcquirer(t, db)
	g := mustGuards(t, db)
	if err := g.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	const ttl = 10 * time.Second
	late := newAcquirerOn(t, db, &sqlfence.AcquirerOptions{AdvanceGuards: g, Drift: ttl - time.Microsecond})
	normal := newAcquirerOn(t, db, &sqlfence.AcquirerOptions{AdvanceGuards: g})
	name := fencetest.Name("late-guard")
	if l, err := late.TryAcquire(ctx, name, ttl); l != nil || !errors.Is(err, fence.ErrLost) {
		t.Fatalf("TryAcquire of a late guarded grant: %v, %v; want a nil lease and ErrLost", l, err)
	}
	given := counterOf(t, normal, name)
	l, err := normal.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after the late guarded grant was given back: %v", err)
	}
	defer l.Release(ctx)
	if err := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, l.Token()) }); err != nil {
		t.Errorf("Guard with the new holder's token %d after a give-back of token %d: %v", l.Token(), given, err)
	}
	err = sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, given) })
	if !errors.Is(err, fence.ErrStale) {
		t.Errorf("Guard with the given-back token %d after token %d: %v; want ErrStale", given, l.Token(), err)
	}
}
