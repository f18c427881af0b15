package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
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
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/go-sql-driver/mysql"
)

// openMySQL opens the test MySQL or MariaDB server with extra DSN parameters
// (such as "clientFoundRows=true"), and creates the package's tables on it.
func openMySQL(t testing.TB, params string) (*sql.DB, *sqlfence.DB) {
	t.Helper()
	db, err := sql.Open("mysql", withParams(testenv.MySQLDSN(), params))
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = db.PingContext(ctx)
		cancel()
	}
	if err != nil {
		testenv.Missing(t, "MySQL or MariaDB at "+testenv.MySQLDSN(), err)
	}
	t.Cleanup(func() { db.Close() })
	fdb := sqlfence.MySQL(db)
	mysqlSetup(t, fdb)
	return db, fdb
}

// mysqlSetup creates the default tables once per test binary.
func mysqlSetup(t testing.TB, fdb *sqlfence.DB) {
	t.Helper()
	ctx := context.Background()
	w, _ := sqlfence.NewWriter(fdb, nil)
	a, _ := sqlfence.NewAcquirer(fdb, nil)
	s, _ := sqlfence.NewIdempotencyStore(fdb, nil)
	g, _ := sqlfence.NewGuards(fdb, nil)
	for _, f := range []func() error{func() error { return w.CreateTable(ctx) }, func() error { return a.CreateTable(ctx) }, func() error { return s.CreateTable(ctx) }, func() error { return g.CreateTable(ctx) }} {
		if err := f(); err != nil {
			t.Fatal(err)
		}
	}
}

// faultyMySQL returns an idempotency store on the test MySQL or MariaDB server,
// reached through a fault proxy, with openMySQL's extra DSN parameters.
func faultyMySQL(t *testing.T, params string) (idempotency.Store, *faultnet.Proxy) {
	px := faultnet.Start(t, mysqlAddr(t))
	db := mysqlDB(t, px.Addr(), params)
	s, err := sqlfence.NewIdempotencyStore(sqlfence.MySQL(db), nil)
	if err != nil {
		t.Fatal(err)
	}
	return s, px
}

// questions returns the statements the session of db (one connection) has sent.
func questions(t *testing.T, db *sql.DB) int64 { t.Helper(); return sessionStatus(t, db, "Questions") }

// sessionStatus reads one of the session's status counters.
func sessionStatus(t *testing.T, db *sql.DB, counter string) int64 {
	t.Helper()
	var name string
	var n int64
	if err := db.QueryRow("SHOW SESSION STATUS LIKE '"+counter+"'").Scan(&name, &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestMySQLRoundTrips counts the statements the server received (its session
// counter, on one connection): acquire + release are 2, a write to an existing
// key is 1, to a new key 2 (3 for a writer's first, which reads the type of
// its key column); idempotency.Do is 5 on a fresh key, 2 on a replay.
func TestMySQLRoundTrips(t *testing.T) {
	db, fdb := openMySQL(t, "")
	db.SetMaxOpenConns(1)
	ctx := context.Background()
	a, _ := sqlfence.NewAcquirer(fdb, nil)
	w, _ := sqlfence.NewWriter(fdb, nil)
	count := func(what string, want int64, f func() error) {
		t.Helper()
		idle := questions(t, db)
		idle = questions(t, db) - idle // the SHOW itself
		prepared := sessionStatus(t, db, "Com_stmt_prepare")
		before := questions(t, db)
		if err := f(); err != nil {
			t.Fatal(err)
		}
		if n := questions(t, db) - before - idle; n != want {
			t.Errorf("%s sent %d statements, want %d", what, n, want)
		}
		// Each in one round trip: its arguments written into it (see
		// mysqlInline), not prepared first.
		if n := sessionStatus(t, db, "Com_stmt_prepare") - prepared; n != 0 {
			t.Errorf("%s prepared %d statements, want 0 (a round trip each)", what, n)
		}
	}
	acquireRelease := func(name string) func() error {
		return func() error {
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				return err
			}
			return l.Release(ctx)
		}
	}
	count("an acquirer's first acquire + release (its name column's type, read once; the grant; the release)", 3, acquireRelease(fencetest.Name("rt")))
	count("acquire + release", 2, acquireRelease(fencetest.Name("rt")))
	count("a writer's first write, to a new key (its key column's type, read once; UPDATE; the upsert)", 3,
		func() error { return w.Write(ctx, fencetest.Name("rt"), []byte("v"), 1) })
	key := fencetest.Name("rt")
	count("a write to a new key (UPDATE, then the upsert)", 2, func() error { return w.Write(ctx, key, []byte("v"), 1) })
	count("a write to an existing key", 1, func() error { return w.Write(ctx, key, []byte("v2"), 2) })
	count("an equal token writing the same bytes", 1, func() error { return w.Write(ctx, key, []byte("v2"), 2) })
	// idempotency.Do: claim (1), arm and complete (each the compare-and-set and
	// a read of the record it wrote: 2) on a fresh key; the claim and a read on
	// a replay.
	s, _ := sqlfence.NewIdempotencyStore(fdb, nil)
	ik := fencetest.Name("rt")
	effect := func(context.Context, string) ([]byte, error) { return []byte("ok"), nil }
	count("a store's first idempotency.Do, on a fresh key (its key column's type, read once; then as below)", 6, func() error {
		_, err := idempotency.Do(ctx, s, fencetest.Name("rt"), "fp", effect, nil)
		return err
	})
	count("idempotency.Do on a fresh key", 5, func() error { _, err := idempotency.Do(ctx, s, ik, "fp", effect, nil); return err })
	count("idempotency.Do on a replay", 2, func() error { _, err := idempotency.Do(ctx, s, ik, "fp", effect, nil); return err })
}

// TestMySQLDeadlockRetried: two guarded transactions take two guard rows in
// opposite orders, so InnoDB kills one of them (1213); RunTx runs it again and
// both commit.
func TestMySQLDeadlockRetried(t *testing.T) {
	db, fdb := openMySQL(t, "")
	g := mustGuards(t, fdb)
	ctx := context.Background()
	a, b := fencetest.Name("dl"), fencetest.Name("dl")
	for _, n := range []string{a, b} { // the rows exist, so each guard locks one
		if err := sqlfence.RunTx(ctx, db, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, n, 1) }); err != nil {
			t.Fatal(err)
		}
	}
	var attempts [2]atomic.Int32
	start := make(chan struct{})
	var firstRows sync.WaitGroup // both first attempts hold their first row
	firstRows.Add(2)
	var wg sync.WaitGroup
	for i, order := range [][2]string{{a, b}, {b, a}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			err := sqlfence.RunTx(ctx, db, nil, func(tx *sql.Tx) error {
				n := attempts[i].Add(1)
				if err := g.Guard(ctx, tx, order[0], 2); err != nil {
					return err
				}
				if n == 1 {
					firstRows.Done()
					firstRows.Wait() // both hold their first row: the next guard deadlocks
				}
				return g.Guard(ctx, tx, order[1], 2)
			})
			if err != nil {
				t.Errorf("transaction %d: %v", i, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if n := attempts[0].Load() + attempts[1].Load(); n < 3 {
		t.Errorf("%d attempts in all: the deadlock did not happen, or was not retried", n)
	}
	t.Logf("attempts: %d and %d", attempts[0].Load(), attempts[1].Load())
}

// TestMySQLGuardsDialect: an acquirer refuses AdvanceGuards made on a database
// of another dialect (their statements would not run on its database), both
// ways, and GuardPgx on MySQL Guards is refused. TestAdvanceOnGrant runs
// AdvanceGuards on MySQL.
func TestMySQLGuardsDialect(t *testing.T) {
	_, fdb := openMySQL(t, "")
	_, lite := openSQLite(t)
	if _, err := sqlfence.NewAcquirer(fdb, &sqlfence.AcquirerOptions{AdvanceGuards: mustGuards(t, lite)}); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("SQLite Guards on a MySQL acquirer: %v, want ErrInvalid", err)
	}
	if _, err := sqlfence.NewAcquirer(lite, &sqlfence.AcquirerOptions{AdvanceGuards: mustGuards(t, fdb)}); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("MySQL Guards on a SQLite acquirer: %v, want ErrInvalid", err)
	}
	ctx := context.Background()
	tx, err := pgPool(t, pgOpts{}).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := mustGuards(t, fdb).GuardPgx(ctx, tx, fencetest.Name("g"), 1); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("GuardPgx on MySQL Guards: %v, want ErrInvalid", err)
	}
}

// TestMySQLInspectAndBump: Inspect and Bump on MySQL, and a counter at the top
// refuses to grant.
func TestMySQLInspectAndBump(t *testing.T) {
	ctx := context.Background()
	_, fdb := openMySQL(t, "")
	a, _ := sqlfence.NewAcquirer(fdb, nil)
	name := fencetest.Name("bump")
	l := mustGrant(t, ctx, a, name, time.Minute)
	info, err := a.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != l.Token() || info.TimeLeft <= 50*time.Second {
		t.Fatalf("Inspect of a held lock: %+v, %v", info, err)
	}
	if err := a.Bump(ctx, name, l.Token()+100); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("Bump while held: %v, want ErrHeld", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.Bump(ctx, name, l.Token()+100); err != nil {
		t.Fatal(err)
	}
	if err := a.Bump(ctx, name, l.Token()+50); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Bump downwards: %v, want ErrInvalid", err)
	}
	l2, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil || l2.Token() != l.Token()+101 {
		t.Fatalf("grant after the bump: %v, %v; want token %d", l2, err, l.Token()+101)
	}
	_ = l2.Release(ctx)
	if err := a.Bump(ctx, name, fence.MaxToken); err != nil {
		t.Fatal(err)
	}
	if _, err := a.TryAcquire(ctx, name, time.Minute); !errors.Is(err, fence.ErrTokensExhausted) {
		t.Errorf("TryAcquire at MaxToken: %v, want ErrTokensExhausted", err)
	}
}

// BenchmarkMySQLWrite compares, on one MySQL or MariaDB server in one run, a
// fenced write (subject, one upsert) with a plain UPDATE of the same row
// storing a changed value (baseline), interleaved. The target is
// fenced/plain <= 1.10. Both commit with the server's own durability setting
// (innodb_flush_log_at_trx_commit), which is global, not per session.
func BenchmarkMySQLWrite(b *testing.B) {
	db, fdb := openMySQL(b, "")
	w := newWriterOn(b, fdb, nil)
	key := fencetest.Name("bench")
	pairWrites(b, w, key, func(ctx context.Context, value []byte) (int64, error) {
		return rowsAffected(db.ExecContext(ctx, "UPDATE fence_values SET value = ? WHERE `key` = ?", value, key))
	})
}

// BenchmarkMySQLAcquireRelease measures an uncontended TryAcquire + Release
// (two statements, see TestMySQLRoundTrips) next to a plain SELECT 1 (benchutil.AcquireRelease).
func BenchmarkMySQLAcquireRelease(b *testing.B) {
	db, fdb := openMySQL(b, "")
	a := newAcquirerOn(b, fdb, nil)
	benchutil.AcquireRelease(b, a, func(ctx context.Context) error { _, err := db.ExecContext(ctx, "SELECT 1"); return err })
}

// BenchmarkMySQLHandoff measures the time from the start of a holder's Release
// to the grant of an Acquire already waiting (p50, p90): /same-acquirer, whose
// Release lets the head of its line try at once, and /other-acquirer (as
// another process would see it): MySQL has no notifications, so that waiter
// polls with the acquirer's Backoff (the zero fence.Backoff: Min 1ms, Max
// 100ms).
func BenchmarkMySQLHandoff(b *testing.B) {
	_, fdb := openMySQL(b, "")
	a := newAcquirerOn(b, fdb, nil)
	other := newAcquirerOn(b, fdb, nil)
	b.Run("same-acquirer", func(b *testing.B) { benchutil.Handoff(b, a, a, fencetest.Name("handoff")) })
	b.Run("other-acquirer", func(b *testing.B) { benchutil.Handoff(b, a, other, fencetest.Name("handoff")) })
}

// TestMySQLEmptyStringIsNull: MariaDB's EMPTY_STRING_IS_NULL session mode
// (set by a user in the DSN) turns an empty string into NULL. An empty value
// must still read back as empty (not as deleted), Bump must work, and empty
// fingerprints, owners and results must be stored as empty.
func TestMySQLEmptyStringIsNull(t *testing.T) {
	ctx := context.Background()
	db, fdb := openMySQL(t, "sql_mode="+url.QueryEscape("'STRICT_TRANS_TABLES,EMPTY_STRING_IS_NULL'"))
	var mode string
	if err := db.QueryRowContext(ctx, "SELECT @@SESSION.sql_mode").Scan(&mode); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(mode, "EMPTY_STRING_IS_NULL") {
		t.Skipf("the server does not have EMPTY_STRING_IS_NULL (MariaDB only): sql_mode %q", mode)
	}
	w := newWriterOn(t, fdb, nil)
	key := fencetest.Name("empty")
	for _, tok := range []fence.Token{1, 2} { // a new key (upsert), then an existing one (update)
		if err := w.Write(ctx, key, []byte{}, tok); err != nil {
			t.Fatalf("Write of an empty value: %v", err)
		}
		if v, got, err := w.Read(ctx, key); err != nil || len(v) != 0 || got != tok {
			t.Fatalf("Read of an empty value = %q, %d, %v; want empty, %d", v, got, err, tok)
		}
	}
	a := newAcquirerOn(t, fdb, nil)
	name := fencetest.Name("empty-bump")
	if err := a.Bump(ctx, name, fence.MaxToken-10); err != nil {
		t.Fatalf("Bump of a new name: %v", err)
	}
	l, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil || l.Token() != fence.MaxToken-9 {
		t.Fatalf("grant after the bump: %v, %v; want token %d", l, err, fence.MaxToken-9)
	}
	_ = l.Release(ctx)
	s, err := sqlfence.NewIdempotencyStore(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	ik := fencetest.Name("empty-idem")
	rec, claimed, err := s.Begin(ctx, ik, "", "", time.Minute)
	if err != nil || !claimed {
		t.Fatalf("Begin with an empty fingerprint and owner: %v, %v", claimed, err)
	}
	done, err := s.Update(ctx, ik, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Completed, Fence: rec.Fence, Result: []byte{}, Retention: time.Hour})
	if err != nil || done.State != idempotency.Completed || done.Fingerprint != "" || done.Owner != "" || len(done.Result) != 0 {
		t.Fatalf("complete with an empty result = %+v, %v", done, err)
	}
}

// TestMySQLSessionTimeZone: the lease and idempotency clocks are UTC counts,
// whatever time zone the session has: the lease row's expiry, read on a
// connection in UTC, is the grant's instant plus its ttl, and Inspect sees the
// time left the grant asked for.
func TestMySQLSessionTimeZone(t *testing.T) {
	ctx := context.Background()
	utc, _ := openMySQL(t, "time_zone="+url.QueryEscape("'+00:00'"))
	for _, zone := range []string{"'+05:00'", "'-09:30'", "SYSTEM"} {
		t.Run(zone, func(t *testing.T) {
			_, fdb := openMySQL(t, "time_zone="+url.QueryEscape(zone))
			a := newAcquirerOn(t, fdb, nil)
			name := fencetest.Name("tz")
			before := time.Now()
			l := mustGrant(t, ctx, a, name, time.Hour)
			after := time.Now()
			t.Cleanup(func() { _ = l.Release(context.Background()) })
			var expires int64
			if err := utc.QueryRowContext(ctx, "SELECT expires_at FROM fence_leases WHERE name = ?", name).Scan(&expires); err != nil {
				t.Fatal(err)
			}
			// The server's clock is this machine's: allow the round trip and a
			// second of scheduling, far below the zone's hours.
			lo, hi := before.Add(time.Hour-time.Second).UnixMilli(), after.Add(time.Hour+time.Second).UnixMilli()
			if expires < lo || expires > hi {
				t.Errorf("expires_at %d is %v from the grant plus its ttl", expires, time.Duration(expires-before.Add(time.Hour).UnixMilli())*time.Millisecond)
			}
			info, err := a.Inspect(ctx, name)
			if err != nil || info.TimeLeft < time.Hour-5*time.Second || info.TimeLeft > time.Hour {
				t.Errorf("Inspect = %+v, %v; want about an hour left", info, err)
			}
			s, _ := sqlfence.NewIdempotencyStore(fdb, nil)
			rec, _, err := s.Begin(ctx, fencetest.Name("tz"), "f", "o", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if f := int64(rec.Fence); f < before.UnixMicro()-1e6 || f > time.Now().UnixMicro()+1e6 {
				t.Errorf("idempotency fence %d is not the clock in microseconds (%d)", f, before.UnixMicro())
			}
		})
	}
}

// TestMySQLSessionTimeZoneDST: the clock is right in the hour that a zone
// with daylight saving repeats. Each handle freezes its session's clock with
// MariaDB's timestamp variable (NOW and UTC_TIMESTAMP both read it) at an
// instant of America/New_York's fall back on 2025-11-02, when 01:00-02:00
// local happens twice: first in EDT (05:00-06:00 UTC), then in EST
// (06:00-07:00 UTC). UNIX_TIMESTAMP(NOW()) maps 01:30 local to the EDT
// instant, so at 06:30 UTC it read an hour early: a new lease row's token and
// an idempotency fence an hour below the clock in microseconds, and a lease
// granted in the zone an hour short, free to a second acquirer in UTC at the
// same instant. It needs the server's time zone tables (scripts/test.sh loads
// them); without them it skips, and fails under CI.
func TestMySQLSessionTimeZoneDST(t *testing.T) {
	ctx := context.Background()
	plain, _ := openMySQL(t, "")
	// CONVERT_TZ is NULL for a zone the server does not know: it needs no
	// privilege on the mysql schema, unlike counting mysql.time_zone_name.
	var probe sql.NullString
	if err := plain.QueryRowContext(ctx, "SELECT CONVERT_TZ('2025-11-02 06:30:00', '+00:00', 'America/New_York')").Scan(&probe); err != nil {
		t.Fatal(err)
	}
	if !probe.Valid {
		const msg = "the server has no time zone tables (America/New_York is unknown): load them as root with mariadb-tzinfo-to-sql /usr/share/zoneinfo | mariadb mysql (scripts/test.sh does when they are empty)"
		testenv.SkipUnlessCI(t, msg)
	}
	if probe.String != "2025-11-02 01:30:00" {
		t.Fatalf("06:30 UTC on 2025-11-02 is %s in America/New_York, want 01:30 (EST, the second pass of the repeated hour)", probe.String)
	}
	for _, c := range []struct {
		name string
		at   time.Time
	}{
		{"first pass EDT", time.Date(2025, 11, 2, 5, 30, 0, 123456000, time.UTC)},
		{"second pass EST", time.Date(2025, 11, 2, 6, 30, 0, 123456000, time.UTC)},
	} {
		t.Run(c.name, func(t *testing.T) {
			frozen := fmt.Sprintf("timestamp=%d.%06d", c.at.Unix(), c.at.Nanosecond()/1000)
			_, ny := openMySQL(t, "time_zone="+url.QueryEscape("'America/New_York'")+"&"+frozen)
			_, utc := openMySQL(t, "time_zone="+url.QueryEscape("'+00:00'")+"&"+frozen)
			want := c.at.UnixMicro()
			a := newAcquirerOn(t, ny, nil)
			name := fencetest.Name("dst")
			l := mustGrant(t, ctx, a, name, time.Hour)
			t.Cleanup(func() { _ = l.Release(context.Background()) })
			// A new row's token starts at the clock in microseconds.
			if got := int64(l.Token()); got != want {
				t.Errorf("new lease row's token %d is %v from the clock in microseconds %d", got, time.Duration(got-want)*time.Microsecond, want)
			}
			// In UTC at the same instant the lease has its whole hour left,
			// and a second acquirer is refused.
			au := newAcquirerOn(t, utc, nil)
			if info, err := au.Inspect(ctx, name); err != nil || !info.Held || info.TimeLeft != time.Hour {
				t.Errorf("Inspect in UTC = %+v, %v; want held with exactly an hour left", info, err)
			}
			if l2, err := au.TryAcquire(ctx, name, time.Hour); !errors.Is(err, fence.ErrHeld) {
				if err == nil {
					_ = l2.Release(context.Background())
				}
				t.Errorf("second TryAcquire in UTC = %v, want ErrHeld: two holders", err)
			}
			// A new idempotency record's fence is the clock in microseconds.
			s, err := sqlfence.NewIdempotencyStore(ny, nil)
			if err != nil {
				t.Fatal(err)
			}
			rec, _, err := s.Begin(ctx, fencetest.Name("dst"), "f", "o", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if got := int64(rec.Fence); got != want {
				t.Errorf("idempotency fence %d is %v from the clock in microseconds %d", got, time.Duration(got-want)*time.Microsecond, want)
			}
		})
	}
}

// TestMySQLIdempotencyUpdateReadBackNotSent (an unknown outcome is never reported as definite): on MySQL an
// idempotency Update is a compare-and-set and then a read of the record it
// wrote, each on a connection of the pool. When the compare-and-set lands
// and the read gets no connection (another caller takes the pool's only
// connection in between, and the context ends while the read waits for it),
// the change was made: Update must return the record, or an error matching
// fence.ErrUnknown; never a definite "not sent" for a change that landed.
func TestMySQLIdempotencyUpdateReadBackNotSent(t *testing.T) {
	_, direct := openMySQL(t, "")
	ds := idemStore(t, direct)
	px := faultnet.Start(t, mysqlAddr(t))
	db := proxiedMySQL(t, px)
	db.SetMaxOpenConns(1)
	s, err := sqlfence.NewIdempotencyStore(sqlfence.MySQL(db), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := fencetest.Name("idem-readback")
	rec, claimed, err := s.Begin(ctx, key, "fp", "me", time.Minute)
	if err != nil || !claimed {
		t.Fatalf("Begin: %+v, %v, %v", rec, claimed, err)
	}

	// Every chunk takes 300ms each way: the compare-and-set is in flight
	// long enough for another caller to queue for the pool's connection.
	px.Latency(300*time.Millisecond, 300*time.Millisecond)
	uctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	type result struct {
		rec idempotency.Record
		err error
	}
	done := make(chan result, 1)
	waits := db.Stats().WaitCount
	go func() {
		r, err := s.Update(uctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
		done <- result{r, err}
	}()
	for db.Stats().InUse == 0 { // the compare-and-set has the connection
		select {
		case r := <-done:
			t.Fatalf("Update returned before it took a connection: %+v, %v", r.rec, r.err)
		case <-time.After(time.Millisecond): // polling the pool's state
		}
	}
	held := make(chan func(), 1)
	go func() {
		c, err := db.Conn(ctx) // queues for the connection the compare-and-set holds
		if err != nil {
			t.Error(err)
			held <- func() {}
			return
		}
		held <- func() { c.Close() }
	}()
	for db.Stats().WaitCount == waits {
		select {
		case r := <-done:
			t.Fatalf("Update returned before another caller queued for the pool: %+v, %v (the test did not test it)", r.rec, r.err)
		case <-time.After(time.Millisecond): // polling the pool's state
		}
	}
	r := <-done
	(<-held)()
	px.Latency(0, 0)

	got, gerr := ds.Get(ctx, key)
	if gerr != nil || got.State != idempotency.Armed {
		t.Fatalf("the record after Update: %+v, %v; want armed (the test did not test a change that landed)", got, gerr)
	}
	if r.err != nil && !errors.Is(r.err, fence.ErrUnknown) {
		t.Errorf("Update whose compare-and-set landed (the record is armed) and whose read-back got no connection: %v; want the record or an error matching fence.ErrUnknown", r.err)
	}
}

var userTableSeq atomic.Int64

// userTable creates a table of the test's own on MySQL whose key column
// (named col) has type keyType, and drops it after the test. It returns the
// table's name.
func userTable(t *testing.T, raw *sql.DB, col, keyType, rest string) string {
	t.Helper()
	return newUserTable(t, raw, func(name string) string {
		return fmt.Sprintf("CREATE TABLE %s (`%s` %s PRIMARY KEY%s)", name, col, keyType, rest)
	})
}

// newUserTable creates a table of the user's, with a name of its own, by the
// statement ddl returns for that name, and drops it at the end of the test;
// it skips the test when the server refuses the statement.
func newUserTable(t *testing.T, raw *sql.DB, ddl func(name string) string) string {
	t.Helper()
	name := fmt.Sprintf("user_keys_%d_%d", time.Now().UnixNano()%1e9, userTableSeq.Add(1))
	q := ddl(name)
	if _, err := raw.ExecContext(context.Background(), q); err != nil {
		t.Skipf("%s: %v", q, err)
	}
	t.Cleanup(func() { _, _ = raw.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+name) })
	return name
}

// paddingKeyTypes are key columns under which two different keys can share
// one row: trailing spaces ignored (PAD SPACE), stripped (CHAR), case
// folded, or padded with NUL bytes (BINARY).
var paddingKeyTypes = []string{
	"VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
	"VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci",
	"CHAR(100) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin",
	"VARCHAR(255) CHARACTER SET utf8mb3 COLLATE utf8mb3_nopad_bin",
	"BINARY(100)",
}

// exactKeyTypes compare keys byte for byte.
var exactKeyTypes = []string{
	"VARBINARY(1024)",
	"VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin",
}

// TestMySQLWriterRefusesPaddingKeyColumn: a Writer on a table whose key
// column does not compare bytes refuses every write with an error matching
// fence.ErrInvalid that names the column and says what to use, and writes
// nothing; on a column that compares bytes, "acct" and "acct " are two keys.
func TestMySQLWriterRefusesPaddingKeyColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	const rest = ", `value` LONGBLOB, fence BIGINT NOT NULL"
	for _, typ := range paddingKeyTypes {
		t.Run(typ, func(t *testing.T) {
			table := userTable(t, raw, "acct_key", typ, rest)
			w := newWriterOn(t, fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "acct_key"})
			checkKeyColumnRefusesWrite(t, w, "acct", typ, "VARBINARY")
			if err := w.Write(ctx, "acct ", []byte("b"), 200); !errors.Is(err, fence.ErrInvalid) {
				t.Errorf("second Write: %v, want ErrInvalid", err)
			}
			checkKeyColumnRefusesRest(t, raw, w, table, "acct")
		})
	}
	for _, typ := range exactKeyTypes {
		t.Run(typ, func(t *testing.T) {
			table := userTable(t, raw, "acct_key", typ, rest)
			w := newWriterOn(t, fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "acct_key"})
			checkKeyColumnKeepsKeysApart(t, w)
		})
	}
}

// checkKeyColumnRefusesWrite checks that w, on a user's key column acct_key
// of type typ that can make two keys one row, refuses a Write of key with an
// error matching fence.ErrInvalid that names the column and want, the type to
// use.
func checkKeyColumnRefusesWrite(t *testing.T, w *sqlfence.Writer, key, typ, want string) {
	t.Helper()
	err := w.Write(context.Background(), key, []byte("a"), 100)
	if !errors.Is(err, fence.ErrInvalid) || !strings.Contains(err.Error(), "acct_key") || !strings.Contains(err.Error(), want) {
		t.Fatalf("Write on a %s key column: %v, want ErrInvalid naming acct_key and %s", typ, err, want)
	}
	if testing.Verbose() {
		t.Log(err)
	}
}

// checkKeyColumnRefusesRest checks that w, on such a column of table, refuses
// Delete and Read of key with fence.ErrInvalid, and that table holds no row.
func checkKeyColumnRefusesRest(t *testing.T, raw *sql.DB, w *sqlfence.Writer, table, key string) {
	t.Helper()
	ctx := context.Background()
	if err := w.Delete(ctx, key, 300); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Delete: %v, want ErrInvalid", err)
	}
	if _, _, err := w.Read(ctx, key); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Read: %v, want ErrInvalid", err)
	}
	var n int
	if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&n); err != nil || n != 0 {
		t.Errorf("rows after refused writes: %d, %v; want none", n, err)
	}
}

// checkKeyColumnKeepsKeysApart checks that w, on a user's key column that
// compares bytes, keeps "acct", "acct " and "Acct" apart as three keys.
func checkKeyColumnKeepsKeysApart(t *testing.T, w *sqlfence.Writer) {
	t.Helper()
	ctx := context.Background()
	if err := w.Write(ctx, "acct", []byte("a"), 100); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, "acct ", []byte("b"), 5); err != nil {
		t.Errorf("Write to \"acct \" at 5: %v, want its own row", err)
	}
	if err := w.Write(ctx, "Acct", []byte("c"), 5); err != nil {
		t.Errorf("Write to \"Acct\" at 5: %v, want its own row", err)
	}
	if v, tok, err := w.Read(ctx, "acct"); err != nil || tok != 100 || string(v) != "a" {
		t.Errorf("Read acct: %q %d %v, want a at 100", v, tok, err)
	}
	var se *fence.StaleError
	if err := w.Write(ctx, "acct", []byte("x"), 99); !errors.As(err, &se) || se.Current != 100 {
		t.Errorf("stale Write: %v, want a StaleError at 100", err)
	}
}

// TestMySQLGuardsRefusePaddingNameColumn: Guard, and a grant that advances
// the guards, refuse a guard table whose name column does not compare bytes,
// with an error matching fence.ErrInvalid, and change nothing.
func TestMySQLGuardsRefusePaddingNameColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	table := userTable(t, raw, "name", "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin", ", fence BIGINT NOT NULL")
	g, err := sqlfence.NewGuards(fdb, &sqlfence.GuardOptions{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	err = sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, "acct", 100) })
	if !errors.Is(err, fence.ErrInvalid) || !strings.Contains(err.Error(), "name") || !strings.Contains(err.Error(), "VARBINARY") {
		t.Errorf("Guard on a utf8mb4_bin name column: %v, want ErrInvalid", err)
	}
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{AdvanceGuards: g, Table: "fence_leases"})
	if l, err := a.TryAcquire(ctx, "acct-"+table, time.Minute); !errors.Is(err, fence.ErrInvalid) {
		if err == nil {
			_ = l.Release(ctx)
		}
		t.Errorf("TryAcquire advancing a utf8mb4_bin guard table: %v, want ErrInvalid", err)
	}
	var n int
	if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&n); err != nil || n != 0 {
		t.Errorf("guard rows after refusals: %d, %v; want none", n, err)
	}
}

// TestMySQLKeyLongerThanUserKeyColumn: on a user's table whose VARBINARY key
// column is shorter than MaxKeyBytes, two keys that differ after the
// column's length are two keys, or a key too long for the column is refused
// with an error matching fence.ErrInvalid; outside strict mode the server
// would cut both to one row. (In strict mode the server's "Data too long"
// error is as good a refusal.)
func TestMySQLKeyLongerThanUserKeyColumn(t *testing.T) {
	ctx := context.Background()
	for _, params := range []string{"sql_mode=" + url.QueryEscape("''"), ""} {
		t.Run("params="+params, func(t *testing.T) {
			raw, fdb := openMySQL(t, params)
			for _, typ := range []string{"VARBINARY(16)", "VARCHAR(16) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin"} {
				t.Run(typ, func(t *testing.T) {
					table := userTable(t, raw, "k", typ, ", v LONGBLOB, f BIGINT NOT NULL")
					w := newWriterOn(t, fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "k", ValueColumn: "v", FenceColumn: "f"})
					a, b := "0123456789abcdef-account-a", "0123456789abcdef-account-b"
					errA := w.Write(ctx, a, []byte("a"), 100)
					if errA != nil && !refusedTooLong(errA) {
						t.Errorf("Write of a key longer than the column: %v, want nil or ErrInvalid", errA)
					}
					errB := w.Write(ctx, b, []byte("b"), 50)
					if errB != nil && !refusedTooLong(errB) {
						t.Errorf("Write of another key with the same first 16 bytes at a lower token: %v, want nil or ErrInvalid (another key)", errB)
					}
					if errA == nil {
						if v, tok, err := w.Read(ctx, a); err != nil || tok != 100 || string(v) != "a" {
							t.Errorf("Read of the first key: %q %d %v, want a at 100", v, tok, err)
						}
					}
					var n int
					if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table+" WHERE f = 50").Scan(&n); err != nil || (errB != nil && n != 0) {
						t.Errorf("rows at the refused write's token: %d, %v", n, err)
					}
				})
			}
		})
	}
}

// refusedTooLong reports an error that refuses a key too long for its
// column: fence.ErrInvalid, or the server's own "Data too long" (1406).
func refusedTooLong(err error) bool {
	var me *mysql.MySQLError
	return errors.Is(err, fence.ErrInvalid) || errors.As(err, &me) && me.Number == 1406
}

// TestMySQLGuardNameLongerThanUserColumn: the same for a guard table of the
// user's own whose VARBINARY name column is shorter than MaxKeyBytes: a
// guard on one name must not be stale because of another name.
func TestMySQLGuardNameLongerThanUserColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "sql_mode="+url.QueryEscape("''"))
	table := userTable(t, raw, "name", "VARBINARY(16)", ", fence BIGINT NOT NULL")
	g, err := sqlfence.NewGuards(fdb, &sqlfence.GuardOptions{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	a, b := "0123456789abcdef-lock-a", "0123456789abcdef-lock-b"
	errA := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, a, 100) })
	if errA != nil && !errors.Is(errA, fence.ErrInvalid) {
		t.Errorf("Guard of a name longer than the column: %v, want nil or ErrInvalid", errA)
	}
	errB := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, b, 50) })
	if errB != nil && !errors.Is(errB, fence.ErrInvalid) {
		t.Errorf("Guard of another name with the same first 16 bytes at a lower token: %v, want nil or ErrInvalid (another lock)", errB)
	}
}

// idempotencyColumns are the columns of the idempotency table after its key.
const idempotencyColumns = `, fingerprint BLOB NOT NULL, state BLOB NOT NULL, fence BIGINT NOT NULL, owner BLOB NOT NULL,
  lease_until BIGINT NOT NULL, started_at BIGINT NOT NULL, expires_at BIGINT, result LONGBLOB, result_dropped BIGINT NOT NULL DEFAULT 0`

// TestMySQLIdempotencyStoreRefusesPaddingKeyColumn: an idempotency table
// created ahead by the user (a migration) whose key column does not compare
// bytes is refused with an error matching fence.ErrInvalid, or its keys stay
// apart: "pay" and "pay " are two requests, whose effects both run.
func TestMySQLIdempotencyStoreRefusesPaddingKeyColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	for _, typ := range paddingKeyTypes[:2] {
		t.Run(typ, func(t *testing.T) {
			table := userTable(t, raw, "key", typ, idempotencyColumns)
			s, err := sqlfence.NewIdempotencyStore(fdb, &sqlfence.IdempotencyOptions{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			for _, key := range []string{"pay", "pay ", "PAY"} {
				ran := false
				r, err := idempotency.Do(ctx, s, key, "fp", func(context.Context, string) ([]byte, error) { ran = true; return []byte(key), nil }, nil)
				if errors.Is(err, fence.ErrInvalid) {
					continue
				}
				if err != nil || !ran || string(r.Value) != key {
					t.Errorf("Do(%q): ran %v, result %q, %v; want its own effect run (or ErrInvalid)", key, ran, r.Value, err)
				}
			}
		})
	}
}

// TestMySQLAcquirerRefusesPaddingNameColumn: a lease table created ahead by
// the user whose name column does not compare bytes is refused with an error
// matching fence.ErrInvalid, or its names stay apart: "job" and "job " and
// "JOB" are three locks.
func TestMySQLAcquirerRefusesPaddingNameColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	for _, typ := range paddingKeyTypes[:2] {
		t.Run(typ, func(t *testing.T) {
			table := userTable(t, raw, "name", typ, ", token BIGINT NOT NULL, owner BLOB NOT NULL, expires_at BIGINT NOT NULL")
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Table: table})
			for _, name := range []string{"job", "job ", "JOB"} {
				l, err := a.TryAcquire(ctx, name, time.Minute)
				if errors.Is(err, fence.ErrInvalid) {
					continue
				}
				if err != nil {
					t.Errorf("TryAcquire(%q) with the others held: %v, want its own lock (or ErrInvalid)", name, err)
					continue
				}
				t.Cleanup(func() { _ = l.Release(context.Background()) })
			}
		})
	}
}

// TestMySQLKeyColumnCheckedAfterTableRecreated: a Writer whose table was
// dropped and created again (a migration that re-creates it) with a key
// column that does not compare bytes refuses it from the first write that
// shows two keys in one row, at a lower or a higher token, as it refuses such
// a table on first use, rather than trusting the check of the old table; the
// other key's row is left as it was, and every later write is refused.
func TestMySQLKeyColumnCheckedAfterTableRecreated(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	const rest = ", v LONGBLOB, f BIGINT NOT NULL"
	table := userTable(t, raw, "k", "VARBINARY(255)", rest)
	w := newWriterOn(t, fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "k", ValueColumn: "v", FenceColumn: "f"})
	if err := w.Write(ctx, "acct", []byte("a"), 1); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"DROP TABLE " + table, "CREATE TABLE " + table + " (k VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PRIMARY KEY" + rest + ")"} {
		if _, err := raw.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	errA := w.Write(ctx, "acct", []byte("a"), 100)
	if errA != nil && !errors.Is(errA, fence.ErrInvalid) {
		t.Fatalf("Write of \"acct\" at 100 on the re-created table: %v, want nil or ErrInvalid", errA)
	}
	for _, tok := range []fence.Token{50, 200} {
		if err := w.Write(ctx, "acct ", []byte("b"), tok); !errors.Is(err, fence.ErrInvalid) ||
			!strings.Contains(err.Error(), "column k") || !strings.Contains(err.Error(), "VARBINARY") {
			t.Errorf("Write of \"acct \" at %d after \"acct\" at 100 (%v) on the re-created utf8mb4_bin table: %v, want ErrInvalid naming column k",
				tok, errA, err)
		}
	}
	if err := w.Write(ctx, "acct", []byte("c"), 300); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Write of \"acct\" after the table was refused: %v, want ErrInvalid", err)
	}
	var v []byte
	var f sql.NullInt64
	var n int
	if err := raw.QueryRowContext(ctx, "SELECT COUNT(*), MAX(v), MAX(f) FROM "+table).Scan(&n, &v, &f); err != nil {
		t.Fatal(err)
	}
	if want := (errA == nil); (n == 1) != want || want && (string(v) != "a" || f.Int64 != 100) {
		t.Errorf("rows after the refusals: %d, value %q at %v; want only \"acct\"'s own write (a at 100) if it was accepted", n, v, f)
	}
}

// TestMySQLNameLongerThanUserLeaseAndIdempotencyColumns: a lease table and
// an idempotency table of the user's own whose VARBINARY(16) key column is
// shorter than MaxKeyBytes refuse a longer name or key with an error
// matching fence.ErrInvalid, outside strict mode too, and write nothing: two
// names with the same first 16 bytes would otherwise share one lock, and two
// keys one request.
func TestMySQLNameLongerThanUserLeaseAndIdempotencyColumns(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "sql_mode="+url.QueryEscape("''"))
	leases := userTable(t, raw, "name", "VARBINARY(16)", ", token BIGINT NOT NULL, owner BLOB NOT NULL, expires_at BIGINT NOT NULL")
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Table: leases})
	for _, name := range []string{"0123456789abcdef-job-a", "0123456789abcdef-job-b"} {
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if err == nil {
			t.Cleanup(func() { _ = l.Release(context.Background()) })
		}
		if !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("TryAcquire(%q) on a VARBINARY(16) name column: %v, want ErrInvalid", name, err)
		}
	}
	idem := userTable(t, raw, "key", "VARBINARY(16)", idempotencyColumns)
	s, err := sqlfence.NewIdempotencyStore(fdb, &sqlfence.IdempotencyOptions{Table: idem})
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"0123456789abcdef-pay-a", "0123456789abcdef-pay-b"} {
		_, err := idempotency.Do(ctx, s, key, "fp", func(context.Context, string) ([]byte, error) { return []byte(key), nil }, nil)
		if !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("Do(%q) on a VARBINARY(16) key column: %v, want ErrInvalid", key, err)
		}
	}
	for _, table := range []string{leases, idem} {
		var n int
		if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&n); err != nil || n != 0 {
			t.Errorf("rows in %s after the refusals: %d, %v; want none", table, n, err)
		}
	}
	if l, err := a.TryAcquire(ctx, "0123456789abcdef", time.Minute); err != nil {
		t.Errorf("TryAcquire of a name that fits the column: %v", err)
	} else {
		_ = l.Release(ctx)
	}
}

// TestMySQLDataTooLongIsInvalid: under a strict sql_mode, a value the
// server refuses as too long for a column of the user's table ("Data too
// long", 1406; here the lease table's owner column) is reported as an error
// matching fence.ErrInvalid, with the server's error in the chain, and
// grants nothing.
func TestMySQLDataTooLongIsInvalid(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "sql_mode="+url.QueryEscape("'STRICT_ALL_TABLES'"))
	leases := userTable(t, raw, "name", "VARBINARY(1024)", ", token BIGINT NOT NULL, owner VARBINARY(8) NOT NULL, expires_at BIGINT NOT NULL")
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Table: leases, Owner: "an-owner-longer-than-8-bytes"})
	l, err := a.TryAcquire(ctx, "job", time.Minute)
	if err == nil {
		_ = l.Release(ctx)
	}
	var me *mysql.MySQLError
	if !errors.Is(err, fence.ErrInvalid) || !errors.As(err, &me) || me.Number != 1406 {
		t.Errorf("TryAcquire with an owner longer than its column: %v, want ErrInvalid carrying MySQL error 1406", err)
	}
}
