package sqlfence_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// syncCommitPool is a pool on the shared test server with at most one
// connection (so every statement runs on the same session) and the given
// session settings.
func syncCommitPool(t *testing.T, params map[string]string, mode pgx.QueryExecMode) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	if mode != 0 {
		cfg.ConnConfig.DefaultQueryExecMode = mode
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err == nil {
		err = p.Ping(context.Background())
	}
	if err != nil {
		testenv.Missing(t, "PostgreSQL at "+testenv.PostgresURL(), err)
	}
	t.Cleanup(p.Close)
	return p
}

func showSyncCommit(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) string {
	t.Helper()
	var s string
	if err := q.QueryRow(context.Background(), "SHOW synchronous_commit").Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestPostgresReleaseInCallerTxKeepsItsDurability attacks the promise "Inside
// a caller's transaction the release leaves that transaction's durability as
// it is" (Acquirer doc; README: "the release leaves your commit's durability
// alone"). A *pgx.Conn is granted a lease outside a transaction block (its
// own, durable transaction); then the caller opens a transaction that asks
// for an asynchronous commit (SET LOCAL synchronous_commit = off, and in a
// second round the session's own setting off), writes a row, releases the
// lease inside it and commits. Expected, per the docs: the caller's setting
// is still off after the release, and its commit does not wait for the disk
// (as the same transaction without the release does: the control round).
func TestPostgresReleaseInCallerTxKeepsItsDurability(t *testing.T) {
	t.Parallel() // a server of its own
	pg := startQuietPostgres(t, "on")
	ctx := context.Background()
	p := pg.pool(t)
	pc := pooledConn(t, p)
	conn := pc.Conn()
	a := newAcquirerOn(t, sqlfence.Pgx(conn), nil)
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE IF NOT EXISTS durable_work (v bigint)"); err != nil {
		t.Fatal(err)
	}
	exec := func(q string) {
		t.Helper()
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	for _, round := range []struct {
		how        string
		setup      string // run before BEGIN (session), or "" for SET LOCAL inside
		local      bool
		withLease  bool
		wantLeased bool
	}{
		{how: "control, SET LOCAL off, no release", local: true},
		{how: "SET LOCAL off, release inside", local: true, withLease: true},
		{how: "control, session off, no release", setup: "SET synchronous_commit = off"},
		{how: "session off, release inside", setup: "SET synchronous_commit = off", withLease: true},
	} {
		var l fence.Lease
		if round.withLease {
			l = mustGrant(t, ctx, a, "durable-in-tx", time.Minute)
			if !flushed(t, p) {
				t.Fatalf("%s: the grant outside a transaction block was not on disk when it returned", round.how)
			}
		}
		if round.setup != "" {
			exec(round.setup)
		}
		exec("BEGIN")
		if round.local {
			exec("SET LOCAL synchronous_commit = off")
		}
		exec("INSERT INTO durable_work VALUES (1)")
		if l != nil {
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		setting := showSyncCommit(t, conn)
		exec("COMMIT")
		onDisk := flushed(t, p)
		exec("RESET synchronous_commit")
		t.Logf("%s: synchronous_commit before COMMIT %q, commit on disk when it returned: %v", round.how, setting, onDisk)
		if !round.withLease {
			if onDisk {
				t.Fatalf("%s: the control transaction was on disk: this check cannot tell", round.how)
			}
			continue
		}
		if setting != "off" {
			t.Errorf("%s: the release inside the caller's transaction changed its synchronous_commit from off to %q", round.how, setting)
		}
		if onDisk {
			t.Errorf("%s: the caller's transaction, which asked for an asynchronous commit, waited for the disk after a release inside it", round.how)
		}
	}
}

// TestPostgresAsyncSessionKeepsGrantsAcrossCrash attacks durability where
// synchronous_commit is off for the session only (pgx RuntimeParams, the
// server's setting is on): a grant with AdvanceGuards (one statement writing
// the lease row and the guard row), a renewal and a Bump, each on a pool and
// on a *pgx.Conn outside a transaction block, must be on disk when they
// return; after a crash the lease is still held with its token, the guard
// row holds that token, the bumped counter is kept, and no token is handed
// out again.
func TestPostgresAsyncSessionKeepsGrantsAcrossCrash(t *testing.T) {
	t.Parallel() // a server of its own
	pg := startQuietPostgres(t, "on")
	ctx := context.Background()
	check := pg.pool(t) // for flushed and the tables: the server's default
	cfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:" + pg.port + "/postgres?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if s := showSyncCommit(t, p); s != "off" {
		t.Fatalf("session synchronous_commit %q, want off", s)
	}
	g, err := sqlfence.NewGuards(sqlfence.Pgx(check), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	pa := newAcquirerOn(t, sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AdvanceGuards: g})
	if err := pa.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	pc := pooledConn(t, p)
	ca := newAcquirerOn(t, sqlfence.Pgx(pc.Conn()), &sqlfence.AcquirerOptions{AdvanceGuards: g, DisableNotify: true})
	type held struct {
		l    fence.Lease
		name string
	}
	var leases []held
	bumped := map[string]fence.Token{}
	for _, c := range []struct {
		how string
		a   *sqlfence.Acquirer
	}{{"pool", pa}, {"*pgx.Conn", ca}} {
		name := "durable-async-" + c.how
		l := mustGrant(t, ctx, c.a, name, time.Minute)
		if !flushed(t, check) {
			t.Errorf("%s: a grant with AdvanceGuards returned before its commit was on disk (session synchronous_commit off)", c.how)
		}
		if err := l.Renew(ctx); err != nil {
			t.Fatal(err)
		}
		if !flushed(t, check) {
			t.Errorf("%s: a renewal returned before its commit was on disk (session synchronous_commit off)", c.how)
		}
		leases = append(leases, held{l, name})
		bname := name + "-bump"
		to := fence.Token(time.Now().UnixMicro()) + 1e12
		if err := c.a.Bump(ctx, bname, to); err != nil {
			t.Fatal(err)
		}
		if !flushed(t, check) {
			t.Errorf("%s: a Bump returned before its commit was on disk (session synchronous_commit off)", c.how)
		}
		bumped[bname] = to
	}
	pc.Release()
	pg.crash(t)
	p.Reset()
	check.Reset()
	for _, h := range leases {
		info, err := pa.Inspect(ctx, h.name)
		if err != nil {
			t.Fatalf("after the crash, %s: %v", h.name, err)
		}
		if !info.Held || info.Token != h.l.Token() {
			t.Errorf("after the crash %s shows held=%v token %d; it was granted token %d before it", h.name, info.Held, info.Token, h.l.Token())
		}
		var gf int64
		if err := check.QueryRow(ctx, "SELECT fence FROM fence_guards WHERE name = $1", h.name).Scan(&gf); err != nil {
			t.Errorf("after the crash the guard row of %s: %v", h.name, err)
		} else if fence.Token(gf) != h.l.Token() {
			t.Errorf("after the crash the guard row of %s holds %d, the grant had %d", h.name, gf, h.l.Token())
		}
		if _, err := pa.TryAcquire(ctx, h.name, time.Minute); !errors.Is(err, fence.ErrHeld) {
			t.Errorf("after the crash %s was granted again while held: %v", h.name, err)
		}
	}
	for name, to := range bumped {
		info, err := pa.Inspect(ctx, name)
		if err != nil {
			t.Fatalf("after the crash, %s: %v", name, err)
		}
		if info.Counter != to {
			t.Errorf("after the crash the bumped counter of %s is %d, was bumped to %d", name, info.Counter, to)
		}
	}
}

// TestPostgresSessionSyncCommitUnchanged attacks "the session's setting is
// unchanged afterwards" (pgDurable, pgNoFlush): on a pool of one connection
// whose session has synchronous_commit off, local, remote_write, on or
// remote_apply, each of grant, renewal, release, a release that finds
// nothing (ErrLost), a grant refused (ErrHeld), a Bump and a Bump refused,
// and a grant cancelled by its context while it waits for a row lock, leaves
// SHOW synchronous_commit on that session as the session had it; on a
// *pgx.Conn inside BEGIN with SET LOCAL, the caller's value is what the
// transaction shows after a renewal refused, and the session's after
// ROLLBACK.
func TestPostgresSessionSyncCommitUnchanged(t *testing.T) {
	ctx := context.Background()
	for _, v := range []string{"off", "local", "remote_write", "on", "remote_apply"} {
		p := syncCommitPool(t, map[string]string{"synchronous_commit": v}, 0)
		a := newAcquirerOn(t, sqlfence.Pgx(p), &sqlfence.AcquirerOptions{Table: "durable_leases"})
		if err := a.CreateTable(ctx); err != nil {
			t.Fatal(err)
		}
		name := fmt.Sprintf("durable-setting-%s-%d", v, time.Now().UnixNano())
		after := func(step string) {
			t.Helper()
			if s := showSyncCommit(t, p); s != v {
				t.Errorf("session synchronous_commit %s: after %s it is %q", v, step, s)
			}
		}
		l := mustGrant(t, ctx, a, name, time.Minute)
		after("a grant")
		if _, err := a.TryAcquire(ctx, name, time.Minute); !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("second grant: %v", err)
		}
		after("a refused grant")
		if err := l.Renew(ctx); err != nil {
			t.Fatal(err)
		}
		after("a renewal")
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		after("a release")
		if err := a.Bump(ctx, name, l.Token()+10); err != nil {
			t.Fatal(err)
		}
		after("a Bump")
		if err := a.Bump(ctx, name, l.Token()+5); !errors.Is(err, fence.ErrInvalid) {
			t.Fatalf("lower bump: %v", err)
		}
		after("a refused Bump")
		// A grant that waits for a row lock, cancelled by its context.
		tx, err := pgPool(t, pgOpts{}).Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT 1 FROM durable_leases WHERE name = $1 FOR UPDATE", name); err != nil {
			t.Fatal(err)
		}
		cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		_, err = a.TryAcquire(cctx, name, time.Minute)
		cancel()
		_ = tx.Rollback(ctx)
		if err == nil {
			t.Fatal("a grant waiting for a row lock held elsewhere was granted")
		}
		after("a grant cancelled by its context: " + err.Error())
	}

	// *pgx.Conn inside BEGIN: the caller's SET LOCAL stays, the session's
	// value comes back after ROLLBACK.
	p := syncCommitPool(t, map[string]string{"synchronous_commit": "off"}, 0)
	pc := pooledConn(t, p)
	conn := pc.Conn()
	a := newAcquirerOn(t, sqlfence.Pgx(conn), &sqlfence.AcquirerOptions{Table: "durable_leases"})
	name := fmt.Sprintf("durable-setting-tx-%d", time.Now().UnixNano())
	if _, err := conn.Exec(ctx, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "SET LOCAL synchronous_commit = local"); err != nil {
		t.Fatal(err)
	}
	l := mustGrant(t, ctx, a, name, time.Minute)
	if s := showSyncCommit(t, conn); s != "local" {
		t.Errorf("inside BEGIN with SET LOCAL synchronous_commit = local, a grant made it %q (a setting that is not off is to be kept)", s)
	}
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	if s := showSyncCommit(t, conn); s != "off" {
		t.Errorf("after ROLLBACK the session's synchronous_commit is %q, want its own off", s)
	}
	_ = l
}

// TestPostgresOutcomesThroughWrappedStatements attacks the results of the
// wrapped statements (WITH ... SELECT ... WHERE set_config(...)): for a
// pool (extended and simple protocol), a *sql.DB, a *pgx.Conn outside and
// inside a transaction block, each with DisableNotify false and true, a
// release returns nil and then ErrLost, a renewal after the release ErrLost,
// a renewal of a held lease nil, a Bump of a held name ErrHeld, a Bump to a
// lower counter ErrInvalid, a Bump above it nil, and Inspect shows each
// step; the session's synchronous_commit off is not a factor.
func TestPostgresOutcomesThroughWrappedStatements(t *testing.T) {
	ctx := context.Background()
	type handle struct {
		how   string
		db    func() *sqlfence.DB
		begin func() // start the caller's block, if any
		end   func()
	}
	ext := syncCommitPool(t, map[string]string{"synchronous_commit": "off"}, 0)
	simple := syncCommitPool(t, map[string]string{"synchronous_commit": "off"}, pgx.QueryExecModeSimpleProtocol)
	stdPool := syncCommitPool(t, map[string]string{"synchronous_commit": "off"}, 0)
	sdb := stdlib.OpenDBFromPool(stdPool)
	defer sdb.Close()
	cp := syncCommitPool(t, map[string]string{"synchronous_commit": "off"}, 0)
	pc := pooledConn(t, cp)
	conn := pc.Conn()
	run := func(q string) func() {
		return func() {
			if _, err := conn.Exec(ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
	}
	nop := func() {}
	handles := []handle{
		{"pool", func() *sqlfence.DB { return sqlfence.Pgx(ext) }, nop, nop},
		{"pool simple protocol", func() *sqlfence.DB { return sqlfence.Pgx(simple) }, nop, nop},
		{"*sql.DB", func() *sqlfence.DB { return sqlfence.Postgres(sdb) }, nop, nop},
		{"*pgx.Conn", func() *sqlfence.DB { return sqlfence.Pgx(conn) }, nop, nop},
		{"*pgx.Conn in BEGIN", func() *sqlfence.DB { return sqlfence.Pgx(conn) }, run("BEGIN"), run("COMMIT")},
	}
	for _, h := range handles {
		for _, dn := range []bool{false, true} {
			how := fmt.Sprintf("%s DisableNotify=%v", h.how, dn)
			a := newAcquirerOn(t, h.db(), &sqlfence.AcquirerOptions{Table: "durable_leases", DisableNotify: dn})
			if err := a.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			name := fmt.Sprintf("durable-outcome-%d", time.Now().UnixNano())
			h.begin()
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatalf("%s: grant: %v", how, err)
			}
			if err := l.Renew(ctx); err != nil {
				t.Errorf("%s: renewal of a held lease: %v", how, err)
			}
			if err := a.Bump(ctx, name, l.Token()+100); !errors.Is(err, fence.ErrHeld) {
				t.Errorf("%s: Bump of a held name: %v, want ErrHeld", how, err)
			}
			if err := l.Release(ctx); err != nil {
				t.Errorf("%s: release: %v, want nil", how, err)
			}
			info, err := a.Inspect(ctx, name)
			if err != nil || info.Held || info.Counter != l.Token() {
				t.Errorf("%s: after the release Inspect says %+v, %v", how, info, err)
			}
			if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
				t.Errorf("%s: renewal after the release: %v, want ErrLost", how, err)
			}
			if err := a.Bump(ctx, name, l.Token()); !errors.Is(err, fence.ErrInvalid) {
				t.Errorf("%s: Bump to the current counter: %v, want ErrInvalid", how, err)
			}
			// Far above the clock, so the grant counts up from it (a
			// PostgreSQL grant takes the larger of the counter + 1 and the clock).
			if err := a.Bump(ctx, name, l.Token()+1e12); err != nil {
				t.Errorf("%s: Bump above the counter of a free name: %v, want nil", how, err)
			}
			// An expired lease: its release finds nothing (ErrLost), its
			// renewal too.
			l2, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatalf("%s: grant after the Bump: %v", how, err)
			}
			if l2.Token() != l.Token()+1e12+1 {
				t.Errorf("%s: grant after Bump to %d got token %d", how, l.Token()+1e12, l2.Token())
			}
			if h.how != "*pgx.Conn in BEGIN" {
				// Expire it on the server (the caller's block would hold the row).
				if _, err := ext.Exec(ctx, "UPDATE durable_leases SET expires_at = 1 WHERE name = $1", name); err != nil {
					t.Fatal(err)
				}
				if err := l2.Release(ctx); !errors.Is(err, fence.ErrLost) {
					t.Errorf("%s: release of a lease expired on the server: %v, want ErrLost", how, err)
				}
			} else if err := l2.Release(ctx); err != nil {
				t.Errorf("%s: release: %v", how, err)
			}
			h.end()
		}
	}
}

// TestPostgresIdempotencyArmSurvivesCrash attacks the same bug class as the
// change fixed for grants (a commit lost in a crash on a server with
// synchronous_commit off), in the PostgreSQL IdempotencyStore of the same
// package: a key claimed and armed (the effect is about to run) must still
// be armed after a crash, or a retry claims it afresh and runs the effect a
// second time ("at most once"). Expected: after the crash Begin does not
// create a new record, and Get shows the armed record.
func TestPostgresIdempotencyArmSurvivesCrash(t *testing.T) {
	t.Parallel() // a server of its own
	pg := startQuietPostgres(t, "off")
	ctx := context.Background()
	p := pg.pool(t)
	s, err := sqlfence.NewIdempotencyStore(sqlfence.Pgx(p), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	rec, created, err := s.Begin(ctx, "durable-idem", "fp", "owner-1", time.Minute)
	if err != nil || !created {
		t.Fatalf("begin: %v created=%v", err, created)
	}
	armed, err := s.Update(ctx, "durable-idem", idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "owner-1", Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	onDisk := flushed(t, p)
	t.Logf("armed record (fence %d) on disk when Update returned: %v", armed.Fence, onDisk)
	// Here the effect runs (a card is charged). Then the server crashes.
	pg.crash(t)
	p.Reset()
	got, err := s.Get(ctx, "durable-idem")
	if err != nil {
		t.Errorf("after the crash the armed key is gone (%v): a retry claims it afresh and runs the effect again", err)
	} else if got.State != idempotency.Armed {
		t.Errorf("after the crash the key is %s, was armed", got.State)
	}
	_, created, err = s.Begin(ctx, "durable-idem", "fp", "owner-2", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if created {
		t.Errorf("after the crash a second caller claimed the key whose effect already ran: the effect runs twice")
	}
}

// TestPostgresAsyncServerWithAbsentSyncStandby attacks the choice of "on"
// as the durable setting (the docs promise "on disk"; "local" gives that):
// on a server whose synchronous_commit is off while synchronous_standby_names
// names a standby that is not connected (an operator's way of not waiting
// for the standby), a grant on a free name must still be made within 5s, as
// it was before the change. With "on" the commit waits for the absent
// standby, and the grant is never answered.
func TestPostgresAsyncServerWithAbsentSyncStandby(t *testing.T) {
	t.Parallel() // a server of its own
	pg := startOwnPostgres(t, "synchronous_commit = off", "synchronous_standby_names = 'absent_standby'")
	ctx := context.Background()
	p := pg.pool(t)
	a := newAcquirerOn(t, sqlfence.Pgx(p), nil)
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	start := time.Now()
	l, err := a.TryAcquire(cctx, "durable-standby", time.Minute)
	t.Logf("TryAcquire after %v: %v", time.Since(start).Round(time.Millisecond), err)
	if err != nil {
		t.Fatalf("a grant on a free name, on a server with synchronous_commit off and an absent synchronous standby, failed: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Errorf("release: %v", err)
	}
}

// TestPostgresWriterFenceAcrossCrash attacks the fence of the PostgreSQL
// Writer on a server with synchronous_commit off (the change made the
// acquirer's grants durable there, not the fenced writes): the new holder's
// write with token t+1 is acknowledged, the server crashes, and a paused
// holder's write with token t must still be rejected (ErrStale), since the
// resource had accepted t+1.
func TestPostgresWriterFenceAcrossCrash(t *testing.T) {
	t.Parallel() // a server of its own
	pg := startQuietPostgres(t, "off")
	ctx := context.Background()
	p := pg.pool(t)
	db := sqlfence.Pgx(p)
	a := newAcquirerOn(t, db, nil)
	w := newWriterOn(t, db, nil)
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	if err := w.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	old := mustGrant(t, ctx, a, "durable-writer", time.Minute)
	if err := w.Write(ctx, "k", []byte("old"), old.Token()); err != nil {
		t.Fatal(err)
	}
	if err := old.Release(ctx); err != nil { // stands for its expiry
		t.Fatal(err)
	}
	l, err := a.TryAcquire(ctx, "durable-writer", time.Minute) // durable: flushes the above
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, "k", []byte("new"), l.Token()); err != nil {
		t.Fatal(err)
	}
	t.Logf("the write with token %d on disk when it returned: %v", l.Token(), flushed(t, p))
	pg.crash(t)
	p.Reset()
	err = w.Write(ctx, "k", []byte("stale"), old.Token())
	if !errors.Is(err, fence.ErrStale) {
		v, tok, rerr := w.Read(ctx, "k")
		t.Errorf("after the crash a write with token %d, below the acknowledged %d, returned %v; the key now holds %q token %d (%v)", old.Token(), l.Token(), err, v, tok, rerr)
	}
}
