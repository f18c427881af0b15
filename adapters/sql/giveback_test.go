package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
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
	"github.com/go-sql-driver/mysql"
)

// The give-back of an attempt's grants (giveBack, watchGrant): when Acquire
// returns an error matching fence.ErrHeld (and not ErrUnknown), no grant of
// that attempt may be live afterwards, also when giveBack's release reports
// ErrLost.

// TestGiveBackInFlightStress: TestAcquireEndsWithAGrantInFlight's
// scenario many times over, with latencies and waits that put the grant's
// landing, giveBack's read and watchGrant's read in every order. After each
// Acquire that says ErrHeld (not ErrUnknown), the name must be free for
// another acquirer's TryAcquire at once, or, when a grant statement landed
// after Acquire returned, once watchGrant gave it back (within 3s).
func TestGiveBackInFlightStress(t *testing.T) {
	ctx := context.Background()
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			a := newAcquirerOn(t, p.db, nil)
			other := newAcquirerOn(t, p.direct, nil)
			for i := 0; i < 3; i++ {
				l := mustGrant(t, ctx, a, fencetest.Name("gbwarm"), time.Minute)
				_ = l.Release(ctx)
			}
			var held, late, unknown, granted int
			for i := 0; i < 24; i++ {
				name := fencetest.Name("gbstress")
				if i%2 == 1 {
					// An existing, free row (a grant takes over an expired one).
					l := mustGrant(t, ctx, other, name, time.Minute)
					_ = l.Release(ctx)
				}
				lat := time.Duration(5+rand.IntN(60)) * time.Millisecond
				wait := time.Duration(2+rand.IntN(int(2*lat/time.Millisecond))) * time.Millisecond
				p.proxy.Latency(lat, lat+time.Duration(rand.IntN(10))*time.Millisecond)
				wctx, cancel := context.WithTimeout(ctx, wait)
				got, err := a.Acquire(wctx, name, time.Minute)
				cancel()
				p.proxy.Latency(0, 0)
				switch {
				case err == nil:
					granted++
					_ = got.Release(ctx)
					continue
				case errors.Is(err, fence.ErrUnknown):
					unknown++
					continue
				case !errors.Is(err, fence.ErrHeld):
					t.Fatalf("iteration %d: Acquire: %v, want ErrHeld or ErrUnknown", i, err)
				}
				held++
				// A grant statement still on the network when giveBack read
				// the row lands after Acquire returned; watchGrant gives it
				// back in the background (it reads the row for 2s, 10ms
				// doubling). Since MySQL's statements go in one round trip
				// (inlined arguments) that happens here about once in 15 runs. So the
				// name must be free within that bound, not at once.
				start := time.Now()
				for {
					l, terr := other.TryAcquire(ctx, name, time.Minute)
					if terr == nil {
						_ = l.Release(ctx)
						if d := time.Since(start); d > 50*time.Millisecond {
							late++
							t.Logf("iteration %d (latency %v, wait %v): free %v after Acquire returned %v", i, lat, wait, d.Round(time.Millisecond), err)
						}
						break
					}
					if time.Since(start) > 3*time.Second {
						info, _ := other.Inspect(ctx, name)
						t.Errorf("iteration %d (latency %v, wait %v): Acquire returned %v (ErrHeld, not ErrUnknown), yet the name is not free 3s later: TryAcquire %v; Inspect %+v", i, lat, wait, err, terr, info)
						break
					}
					time.Sleep(5 * time.Millisecond) // polling observable state
				}
			}
			t.Logf("ErrHeld %d (of which freed late, by watchGrant: %d), ErrUnknown %d, granted %d", held, late, unknown, granted)
		})
	}
}

// gbDialer wraps every connection of a MySQL handle and orchestrates, by
// the bytes each write carries and the goroutine that writes them (its
// stack: tryAcquire, giveBack, watchGrant), one Acquire of name:
//
//   - A, the attempt's first grant, is held in the network (the client's
//     read fails at once: a lost reply, ambiguous, so the attempt runs the
//     grant again as the same owner);
//   - B, the attempt's second grant, reaches the server and grants (token
//     T); its reply does not come back before the context ends;
//   - giveBack and watchGrant both read the row (owner, T); watchGrant
//     releases T first;
//   - A is then delivered: the row was free, so it grants T+1 to the same
//     owner; then giveBack's release of T is sent: it finds nothing (ErrLost);
//   - watchGrant's next reads are slow (held until the test looked).
type gbDialer struct {
	target string
	name   string
	armed  atomic.Bool

	grants      atomic.Int64
	deliverA    chan struct{}
	aWritten    chan struct{}
	gbRead      chan struct{}
	watchRel    chan struct{}
	holdWatch   atomic.Bool
	unhold      chan struct{}
	gbReleaseAt atomic.Bool // giveBack's release was sent after A
	onceGB      sync.Once
	onceWR      sync.Once
	onceDeliver sync.Once
	onceUnhold  sync.Once
	log         func(string, ...any)
}

func newGBDialer(target, name string, log func(string, ...any)) *gbDialer {
	return &gbDialer{target: target, name: name, deliverA: make(chan struct{}), aWritten: make(chan struct{}),
		gbRead: make(chan struct{}), watchRel: make(chan struct{}), unhold: make(chan struct{}), log: log}
}

// logUntilEnd is t.Logf until t's cleanups run, and nothing after: the
// dialer's goroutines deliver requests held in the network, and may do so
// after the test has ended (logging then is a data race with its end).
func logUntilEnd(t *testing.T) func(string, ...any) {
	var mu sync.Mutex
	ended := false
	t.Cleanup(func() {
		mu.Lock()
		ended = true
		mu.Unlock()
	})
	return func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if !ended {
			t.Logf(format, args...)
		}
	}
}

func (d *gbDialer) deliver() { d.onceDeliver.Do(func() { close(d.deliverA) }) }
func (d *gbDialer) release() { d.onceUnhold.Do(func() { close(d.unhold) }) }
func (d *gbDialer) dial(ctx context.Context, addr string) (net.Conn, error) {
	var nd net.Dialer
	c, err := nd.DialContext(ctx, "tcp", d.target)
	if err != nil {
		return nil, err
	}
	return &gbConn{Conn: c, d: d, closed: make(chan struct{})}, nil
}

type gbConn struct {
	net.Conn
	d         *gbDialer
	mu        sync.Mutex
	pending   chan struct{}
	stall     atomic.Bool
	closed    chan struct{}
	closeOnce sync.Once
}

func stackOf() string {
	buf := make([]byte, 64<<10)
	return string(buf[:runtime.Stack(buf, false)])
}

func wait(ch <-chan struct{}, d time.Duration) bool {
	select {
	case <-ch:
		return true
	case <-time.After(d):
		return false
	}
}

func (c *gbConn) Write(b []byte) (int, error) {
	d := c.d
	if !d.armed.Load() || !faultnet.Carries(b, d.name) {
		return c.Conn.Write(b)
	}
	st := stackOf()
	s := string(b)
	switch {
	case strings.Contains(s, "INSERT INTO") && strings.Contains(st, ".tryAcquire("):
		switch d.grants.Add(1) {
		case 1: // A: held in the network, the client's read fails at once
			d.log("grant A held in the network")
			ch := make(chan struct{})
			c.mu.Lock()
			c.pending = ch
			c.mu.Unlock()
			buf := append([]byte(nil), b...)
			go func() {
				<-d.deliverA
				_, _ = c.Conn.Write(buf)
				d.log("grant A delivered")
				close(ch)
				close(d.aWritten)
			}()
			_ = c.Conn.SetReadDeadline(time.Now())
			return len(b), nil
		case 2: // B: lands, its reply stalls until the context ends
			d.log("grant B sent")
			c.stall.Store(true)
		}
	case strings.Contains(s, "FOR UPDATE") && strings.Contains(st, ".giveBack("):
		n, err := c.Conn.Write(b)
		d.log("giveBack's read sent")
		go func() { time.Sleep(30 * time.Millisecond); d.onceGB.Do(func() { close(d.gbRead) }) }()
		return n, err
	case strings.Contains(s, "FOR UPDATE") && strings.Contains(st, ".watchGrant(") && d.holdWatch.Load():
		d.log("watchGrant's read held")
		select {
		case <-d.unhold:
		case <-c.closed:
			return 0, net.ErrClosed
		}
	case strings.Contains(s, "expires_at = 0 WHERE") && strings.Contains(st, ".watchGrant("):
		wait(d.gbRead, 1500*time.Millisecond)
		n, err := c.Conn.Write(b)
		d.log("watchGrant's release sent")
		go func() { time.Sleep(30 * time.Millisecond); d.onceWR.Do(func() { close(d.watchRel) }) }()
		return n, err
	case strings.Contains(s, "expires_at = 0 WHERE") && strings.Contains(st, ".giveBack("):
		if wait(d.watchRel, 1500*time.Millisecond) {
			d.holdWatch.Store(true)
			d.deliver()
			if wait(d.aWritten, time.Second) {
				time.Sleep(100 * time.Millisecond) // A runs on the server
				d.gbReleaseAt.Store(true)
			}
		}
		d.log("giveBack's release sent")
	}
	if ch := c.pend(); ch != nil {
		<-ch
	}
	return c.Conn.Write(b)
}

func (c *gbConn) pend() chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.pending
}

func (c *gbConn) Read(b []byte) (int, error) {
	if c.stall.Load() {
		select {
		case <-c.closed:
		case <-time.After(3 * time.Second):
		}
		return 0, net.ErrClosed
	}
	return c.Conn.Read(b)
}

func (c *gbConn) Close() error {
	c.closeOnce.Do(func() { close(c.closed) })
	if ch := c.pend(); ch != nil {
		_ = c.Conn.SetReadDeadline(time.Now())
		go func() { <-ch; time.Sleep(100 * time.Millisecond); c.Conn.Close() }()
		return nil
	}
	return c.Conn.Close()
}

var gbNet atomic.Int64

// TestGiveBackSecondGrantOfTheAttempt: an attempt whose first grant
// (A) had a lost reply runs it again (B) as the same owner. B lands (token
// T) and the context ends before its reply. watchGrant releases T first;
// A, delayed in the network, then lands on the free row and grants T+1 to
// the same owner; giveBack's release of T finds nothing: ErrLost. If
// giveBack counted that as "given back", Acquire would return ErrHeld
// while the attempt's grant T+1 is live (for its whole ttl if watchGrant's
// reads are slow or its watch ended); ErrUnknown is the true answer. The
// guarantee: ErrHeld means no grant of the
// attempt is live.
func TestGiveBackSecondGrantOfTheAttempt(t *testing.T) {
	for _, bells := range []bool{false, true} {
		t.Run(fmt.Sprintf("bells=%v", bells), func(t *testing.T) {
			ctx := context.Background()
			_, fdb := openMySQL(t, "")
			other := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{DisableNotify: true})
			name := fencetest.Name("gbsecond")
			d := newGBDialer(mysqlAddr(t), name, logUntilEnd(t))
			cfg, err := mysql.ParseDSN(testenv.MySQLDSN())
			if err != nil {
				t.Fatal(err)
			}
			netName := fmt.Sprintf("giveback-%d-%d", os.Getpid(), gbNet.Add(1))
			mysql.RegisterDialContext(netName, d.dial)
			cfg.Net = netName
			db, err := sql.Open("mysql", cfg.FormatDSN())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			a := newAcquirerOn(t, sqlfence.MySQL(db), &sqlfence.AcquirerOptions{Owner: "giveback-attempt", DisableNotify: !bells})
			t.Cleanup(func() { d.deliver(); d.release() })
			// The row exists, free; a's pool has connections.
			l := mustGrant(t, ctx, other, name, time.Second)
			_ = l.Release(ctx)
			for i := 0; i < 3; i++ {
				l := mustGrant(t, ctx, a, name+"-warm", time.Second)
				_ = l.Release(ctx)
			}
			d.armed.Store(true)
			wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			got, err := a.Acquire(wctx, name, time.Minute)
			cancel()
			info, ierr := other.Inspect(ctx, name)
			d.release()
			t.Logf("Acquire: %v; right after, Inspect: %+v %v", err, info, ierr)
			if err == nil {
				_ = got.Release(ctx)
				t.Fatalf("granted: the scenario was not reached")
			}
			if !d.gbReleaseAt.Load() {
				t.Skipf("scenario not reached (giveBack's release was not sent after grant A landed); Acquire: %v", err)
			}
			if errors.Is(err, fence.ErrHeld) && !errors.Is(err, fence.ErrUnknown) && ierr == nil && info.Held && info.Owner == a.Owner() {
				t.Errorf("Acquire returned %v (ErrHeld, not ErrUnknown: \"holds nothing\"), yet right after the name is held by the attempt's owner (token %d, %v left): giveBack took its release's ErrLost (token T released by watchGrant) as proof that the attempt holds nothing, while its other grant (T+1) is live", err, info.Token, info.TimeLeft)
			}
			// Cleanup: watchGrant, its reads no longer held, gives it back.
			end := time.Now().Add(5 * time.Second)
			for {
				l, err := other.TryAcquire(ctx, name, time.Second)
				if err == nil {
					_ = l.Release(ctx)
					break
				}
				if time.Now().After(end) {
					t.Logf("cleanup: still held after 5s: %v", err)
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
		})
	}
}

// TestAcquireEndsWithAGrantInFlight: an Acquire whose context ends while its
// grant statement is on a slow link (faultnet latency above the wait) reads
// the row, gives back a grant that landed, and returns what any wait that
// ran out returns: fence.ErrHeld joined with the context's error, not
// fence.ErrUnknown (the conformance suite's AcquireGivesUpAtDeadline and
// AcquireCancelled failed so on PostgreSQL on a loaded machine). On a free
// name the grant lands after the context ended: the name must be free
// within seconds afterwards, not held for the minute's ttl.
func TestAcquireEndsWithAGrantInFlight(t *testing.T) {
	ctx := context.Background()
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			a := newAcquirerOn(t, p.db, nil)
			other := newAcquirerOn(t, p.direct, nil)
			warm := fencetest.Name("inflight")
			l, err := a.TryAcquire(ctx, warm, time.Minute) // connects and prepares
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			held, free := fencetest.Name("inflight"), fencetest.Name("inflight")
			h := mustGrant(t, ctx, other, held, time.Minute)
			defer h.Release(ctx)
			for _, name := range []string{held, free} {
				p.proxy.Latency(60*time.Millisecond, 60*time.Millisecond)
				wctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
				got, err := a.Acquire(wctx, name, time.Minute)
				cancel()
				p.proxy.Latency(0, 0)
				if err == nil {
					_ = got.Release(ctx)
					t.Fatalf("%s: granted within a 20ms wait over a 60ms link", name)
				}
				if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, fence.ErrUnknown) {
					t.Fatalf("Acquire whose context ended with its grant in flight (name held: %v): %v, want ErrHeld joined with DeadlineExceeded (and not ErrUnknown)", name == held, err)
				}
			}
			// A grant statement still on the link when the Acquire's read
			// settled the row lands after it; the Acquire's watcher gives
			// it back within its watch (grantWatch, 2s), so the name is
			// free within seconds, not held for the minute's ttl.
			wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			start := time.Now()
			l, err = other.Acquire(wctx, free, time.Minute)
			cancel()
			if err != nil {
				t.Fatalf("the free name after an Acquire gave up with its grant in flight: still held after %v (%v), want it free (the grant given back)", time.Since(start), err)
			}
			t.Logf("the free name was granted %v after the Acquire gave up", time.Since(start))
			_ = l.Release(ctx)
		})
	}
}

// The recovery watchers, watchGrant (a grant statement in flight when its
// Acquire's context ended) and settleHandoff, against the real PostgreSQL and MySQL/MariaDB servers.

// grantedWithin waits up to d for name to be granted to a (the lock free);
// it fails the test with what Inspect shows when it is not.
func grantedWithin(t *testing.T, a *sqlfence.Acquirer, name string, d time.Duration, what string) fence.Lease {
	t.Helper()
	end := time.Now().Add(d)
	for {
		l, err := a.TryAcquire(context.Background(), name, 5*time.Second)
		if err == nil {
			return l
		}
		if time.Now().After(end) {
			info, ierr := a.Inspect(context.Background(), name)
			t.Fatalf("%s: the lock is not free %v later (last TryAcquire: %v); Inspect: %+v %v", what, d, err, info, ierr)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestGrantWatcherSparesOthersMySQL: a TryAcquire's grant waits behind an
// operator's row lock when its context ends; its give-back read times out
// behind the same lock (ErrUnknown), so the watcher runs. Meanwhile the same
// acquirer's next Acquire and an Acquire of another Acquirer with the same Owner option
// wait for the lock. After the operator commits, the cancelled grant lands
// and must be given back; the winner must then keep the lock (the watcher
// must not release it), the loser must get it after the winner's release,
// and tokens must grow.
func TestGrantWatcherSparesOthersMySQL(t *testing.T) {
	raw, fdb := openMySQL(t, "")
	ctx := context.Background()
	opts := &sqlfence.AcquirerOptions{Owner: "watch-same"}
	a := newAcquirerOn(t, fdb, opts)
	_, fdb2 := openMySQL(t, "")
	b := newAcquirerOn(t, fdb2, &sqlfence.AcquirerOptions{Owner: "watch-same"})
	name := fmt.Sprintf("watch-spare-%d", time.Now().UnixNano())
	l := mustGrant(t, ctx, b, name, time.Second)
	first := l.Token()
	_ = l.Release(ctx)

	tx := lockRowMySQL(t, raw, name)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err := a.TryAcquire(cctx, name, time.Minute)
	cancel()
	t.Logf("cancelled TryAcquire: %v", err)

	wctx, wcancel := context.WithTimeout(ctx, 90*time.Second)
	defer wcancel()
	chA := goAcquire(wctx, a, name, 30*time.Second)
	chB := goAcquire(wctx, b, name, 30*time.Second)
	time.Sleep(time.Second)
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	var win, lose <-chan acquired
	var r acquired
	select {
	case r = <-chA:
		win, lose = chA, chB
	case r = <-chB:
		win, lose = chB, chA
	case <-time.After(15 * time.Second):
		info, _ := b.Inspect(ctx, name)
		t.Fatalf("nobody granted 15s after the operator's commit; Inspect: %+v", info)
	}
	t.Logf("winner: a? %v", win == chA)
	if r.err != nil {
		t.Fatalf("first Acquire: %v", r.err)
	}
	if r.l.Token() <= first {
		t.Fatalf("token %d not above %d", r.l.Token(), first)
	}
	// The watcher runs for at least 2s and reads on: the winner keeps its
	// lock all that time.
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		info, err := b.Inspect(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if !info.Held || info.Token != r.l.Token() {
			t.Fatalf("the winner's lease (token %d) was taken from it: Inspect %+v", r.l.Token(), info)
		}
		if r.l.Context().Err() != nil {
			t.Fatalf("the winner's lease ended: %v", context.Cause(r.l.Context()))
		}
	}
	select {
	case r2 := <-lose:
		t.Fatalf("granted while the winner held: %+v", r2)
	default:
	}
	if err := r.l.Release(ctx); err != nil {
		t.Fatalf("winner's Release: %v", err)
	}
	r2 := within(t, lose, 10*time.Second, "the other waiter after the winner's release")
	if r2.err != nil {
		t.Fatalf("second Acquire: %v", r2.err)
	}
	if r2.l.Token() <= r.l.Token() {
		t.Fatalf("token %d not above %d", r2.l.Token(), r.l.Token())
	}
	time.Sleep(3 * time.Second)
	info, _ := b.Inspect(ctx, name)
	if !info.Held || info.Token != r2.l.Token() {
		t.Fatalf("the second lease (token %d) was taken: Inspect %+v", r2.l.Token(), info)
	}
	if err := r2.l.Release(ctx); err != nil {
		t.Fatalf("second Release: %v", err)
	}
}

// grantWatchers counts goroutines running watchGrant or settleHandoff.
func grantWatchers() int {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	return strings.Count(string(buf), "sqlfence.(*Acquirer).watchGrant") + strings.Count(string(buf), "sqlfence.(*Acquirer).settleHandoff")
}

// TestGrantWatcherLongLockWaitMySQL: the DSN raises innodb_lock_wait_timeout to
// 120s (a setting the library does not control). A cancelled grant waits
// behind an operator's row lock held for 65s: it lands after watchGrant's
// one-minute cap. Were it to fail: grantWatchMax (acquirer.go) assumes
// MySQL's default 50s lock wait. It passes on MariaDB 10.11 (the statement
// of a closed connection does not land after the wait). Also checks that
// the watcher goroutine ended.
func TestGrantWatcherLongLockWaitMySQL(t *testing.T) {
	if os.Getenv("FENCEKIT_LONG_TESTS") == "" {
		t.Skip("about 70s of waiting for a row lock: run with FENCEKIT_LONG_TESTS=1 (it passes on MariaDB 10.11)")
	}
	raw, fdb := openMySQL(t, "innodb_lock_wait_timeout=120")
	ctx := context.Background()
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Owner: "watch-long"})
	name := fmt.Sprintf("watch-long-%d", time.Now().UnixNano())
	l := mustGrant(t, ctx, a, name, time.Second)
	_ = l.Release(ctx)
	before := grantWatchers()
	tx := lockRowMySQL(t, raw, name)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err := a.TryAcquire(cctx, name, time.Minute)
	cancel()
	t.Logf("cancelled TryAcquire: %v", err)
	time.Sleep(65 * time.Second)
	if n := grantWatchers(); n > before {
		t.Errorf("%d watcher goroutines still running 65s after the cancel (before: %d)", n, before)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	got := grantedWithin(t, a, name, 10*time.Second, "a grant that waited 65s for an operator's row lock (innodb_lock_wait_timeout=120)")
	_ = got.Release(ctx)
}
