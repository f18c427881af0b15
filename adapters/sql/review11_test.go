package sqlfence_test

// Review 11: the recovery watchers of commits 4075261 (watchGrant: a grant
// statement in flight when its Acquire's context ended) and c6f0f01
// (settleHandoff), against the real PostgreSQL and MySQL/MariaDB servers.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
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
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
)

var slowNet atomic.Int64

// slowConn delays the one write that carries match (once armed) by delay,
// as a network that retransmits it would: the client's Write returns at
// once, the bytes reach the server later, and a Close meanwhile takes
// effect only after them (a socket's close sends what it queued first).
type slowConn struct {
	net.Conn
	d       *slowDialer
	mu      sync.Mutex
	pending chan struct{}
}

func (c *slowConn) pend() chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.pending
}

type slowDialer struct {
	target string
	match  []byte
	delay  time.Duration
	armed  atomic.Bool
	fired  atomic.Int64
}

func (c *slowConn) Write(b []byte) (int, error) {
	if c.pend() == nil && c.d.armed.Load() && faultnet.Carries(b, string(c.d.match)) && c.d.armed.CompareAndSwap(true, false) {
		c.d.fired.Add(1)
		ch := make(chan struct{})
		c.mu.Lock()
		c.pending = ch
		c.mu.Unlock()
		buf := append([]byte(nil), b...)
		go func() {
			time.Sleep(c.d.delay)
			_, _ = c.Conn.Write(buf)
			close(ch)
		}()
		return len(b), nil
	}
	if ch := c.pend(); ch != nil {
		<-ch
	}
	return c.Conn.Write(b)
}

func (c *slowConn) Close() error {
	if ch := c.pend(); ch != nil {
		// The client sees its socket closed at once (reads fail); the
		// delayed bytes still go out, then the close.
		_ = c.Conn.SetReadDeadline(time.Now())
		go func() { <-ch; time.Sleep(100 * time.Millisecond); c.Conn.Close() }()
		return nil
	}
	return c.Conn.Close()
}

func (d *slowDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var nd net.Dialer
	c, err := nd.DialContext(ctx, "tcp", d.target)
	if err != nil {
		return nil, err
	}
	return &slowConn{Conn: c, d: d}, nil
}

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

// delayedGrant runs the scenario on an acquirer whose first connection goes
// through a proxy that is partitioned just before the grant: the grant's
// request is held in the network for 5s, past the context's end (300ms),
// the give-back's read and the 2s the watcher watches at least; then it is
// delivered and the server runs it (the client closed its socket, which
// does not withdraw bytes already sent).
func delayedGrant(t *testing.T, d *slowDialer, a, other *sqlfence.Acquirer, name string) {
	ctx := context.Background()
	// The row exists, free.
	l, err := other.TryAcquire(ctx, name, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// a's connections have the grant prepared (pgx caches it per connection).
	for i := 0; i < 3; i++ {
		l, err := a.TryAcquire(ctx, name+"-warm", time.Second)
		if err != nil {
			t.Fatal(err)
		}
		_ = l.Release(ctx)
	}
	d.armed.Store(true)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = a.TryAcquire(cctx, name, time.Minute)
	cancel()
	t.Logf("cancelled TryAcquire: %v", err)
	if !errors.Is(err, fence.ErrHeld) {
		t.Logf("(not ErrHeld: the caller was told the outcome is unknown)")
	}
	time.Sleep(d.delay + time.Second)
	info, ierr := other.Inspect(ctx, name)
	t.Logf("after the delayed request: Inspect %+v %v; delayed writes %d", info, ierr, d.fired.Load())
	got := grantedWithin(t, other, name, 10*time.Second, "a grant request delayed 5s in the network after the cancelled TryAcquire returned")
	_ = got.Release(ctx)
}

// TestDelayedGrantPastWatchMySQL: KNOWN FAILURE (real gap; skipped):
// watchGrant stops once a read completes after 2s (acquirer.go, watchGrant:
// `time.Since(start) >= grantWatch`), so a grant request still on the
// network after that (a TCP retransmission, a congested link) lands later
// and holds the row for its whole ttl (1 minute here) with nobody to release
// it, after TryAcquire said "not granted" (ErrHeld).
func TestDelayedGrantPastWatchMySQL(t *testing.T) {
	// Open defect (HAZARDS 6), see the README's "not guaranteed": closing
	// it needs the give-back to wait until the server's session that got
	// the statement has ended (MySQL's CONNECTION_ID, PostgreSQL's backend
	// PID), or a mark the give-back leaves that refuses the grant.
	t.Skip("open defect: a grant request delayed in the network past watchGrant's 2s lands after it and holds the row for its ttl (HAZARDS 6)")
	_, fdb := openMySQL(t, "")
	other := newAcquirerOn(t, fdb, nil)
	name := fmt.Sprintf("watch-delayed-my-%d", time.Now().UnixNano())
	d := &slowDialer{target: mysqlAddr(t), match: []byte(name), delay: 5 * time.Second}
	cfg, err := mysql.ParseDSN(testenv.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	netName := fmt.Sprintf("watch-%d", slowNet.Add(1))
	mysql.RegisterDialContext(netName, func(ctx context.Context, addr string) (net.Conn, error) { return d.dial(ctx, "tcp", addr) })
	cfg.Net = netName
	db, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	a := newAcquirerOn(t, sqlfence.MySQL(db), &sqlfence.AcquirerOptions{Owner: "watch-cancelled"})
	delayedGrant(t, d, a, other, name)
}

// TestDelayedGrantPastWatchPostgres: as TestDelayedGrantPastWatchMySQL, with a
// pgx pool. KNOWN FAILURE (same gap): pgx's cancel request reaches the
// server before the delayed statement and cancels nothing; TryAcquire says
// "not granted" and the grant lands 5s later, held for its 1-minute ttl.
func TestDelayedGrantPastWatchPostgres(t *testing.T) {
	// Open defect (HAZARDS 6), see the README's "not guaranteed": closing
	// it needs the give-back to wait until the server's session that got
	// the statement has ended (MySQL's CONNECTION_ID, PostgreSQL's backend
	// PID), or a mark the give-back leaves that refuses the grant.
	t.Skip("open defect: a grant request delayed in the network past watchGrant's 2s lands after it and holds the row for its ttl (HAZARDS 6)")
	direct := pgPool(t, pgOpts{})
	other := newAcquirerOn(t, sqlfence.Pgx(direct), &sqlfence.AcquirerOptions{DisableNotify: true})
	name := fmt.Sprintf("watch-delayed-pg-%d", time.Now().UnixNano())
	d := &slowDialer{target: pgTarget(t), match: []byte(name), delay: 5 * time.Second}
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DialFunc = d.dial
	cfg.ConnConfig.Fallbacks = nil
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	a := newAcquirerOn(t, sqlfence.Pgx(pool), &sqlfence.AcquirerOptions{Owner: "watch-cancelled", DisableNotify: true})
	delayedGrant(t, d, a, other, name)
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
	l, err := b.TryAcquire(ctx, name, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	first := l.Token()
	_ = l.Release(ctx)

	tx := lockRowMySQL(t, raw, name)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = a.TryAcquire(cctx, name, time.Minute)
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
	l, err := a.TryAcquire(ctx, name, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = l.Release(ctx)
	before := grantWatchers()
	tx := lockRowMySQL(t, raw, name)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err = a.TryAcquire(cctx, name, time.Minute)
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
