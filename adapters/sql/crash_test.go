package sqlfence_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// ownPostgres is a PostgreSQL server of a test's own, in a temporary
// directory on a free port, so that the test can crash it.
type ownPostgres struct {
	bin, dir, port string
	asUser         string // run the server's commands as this user (initdb refuses root)
}

// startOwnPostgres initialises and starts a server with the given extra
// settings, stopped at the end of the test. It skips (fails when CI is set)
// when it cannot.
func startOwnPostgres(t *testing.T, settings ...string) *ownPostgres {
	t.Helper()
	skip := func(why string, err error) {
		t.Helper()
		msg := fmt.Sprintf("cannot start a PostgreSQL server of the test's own (%s: %v); install the PostgreSQL server binaries (initdb, pg_ctl)", why, err)
		testenv.SkipUnlessCI(t, msg)
	}
	bins, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_ctl")
	bin := ""
	if len(bins) > 0 {
		bin = filepath.Dir(bins[len(bins)-1])
	} else if p, err := exec.LookPath("pg_ctl"); err == nil {
		bin = filepath.Dir(p)
	} else {
		skip("no pg_ctl", err)
	}
	dir, err := os.MkdirTemp("", "fencekit-pgcrash-")
	if err != nil {
		skip("temp dir", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	pg := &ownPostgres{bin: bin, dir: filepath.Join(dir, "data")}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			skip("running as root and no postgres user", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			skip("chown", err)
		}
		pg.asUser = "postgres"
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		skip("free port", err)
	}
	pg.port = strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	l.Close()
	if out, err := pg.run("initdb", "-D", pg.dir, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"); err != nil {
		skip("initdb: "+out, err)
	}
	conf := []string{"listen_addresses = '127.0.0.1'", "port = " + pg.port, "unix_socket_directories = '" + dir + "'", "fsync = on", "max_connections = 30", "shared_buffers = 16MB"}
	conf = append(conf, settings...)
	f, err := os.OpenFile(filepath.Join(pg.dir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteString(strings.Join(conf, "\n") + "\n")
		f.Close()
	}
	if err != nil {
		skip("postgresql.conf", err)
	}
	// The free port is only free when it was read: a test running beside
	// this one can take it before the server binds it (CI run e5 of stop
	// 41: the server exited at once). Each retry appends a new port, which
	// overrides the earlier lines.
	for try := 1; ; try++ {
		out, err := pg.start()
		if err == nil {
			break
		}
		logText, _ := os.ReadFile(filepath.Join(dir, "log"))
		if try == 3 || !strings.Contains(string(logText), "could not bind") {
			skip("pg_ctl start: "+out+"\n"+string(logText), err)
		}
		t.Logf("the server could not bind port %s (taken since it was read), trying another:\n%s", pg.port, logText)
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			skip("free port", err)
		}
		pg.port = strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
		l.Close()
		if err := appendConf(filepath.Join(pg.dir, "postgresql.conf"), "port = "+pg.port); err != nil {
			skip("postgresql.conf", err)
		}
	}
	t.Cleanup(func() { _, _ = pg.run("pg_ctl", "-D", pg.dir, "-m", "immediate", "-w", "stop") })
	return pg
}

// appendConf appends line to the server's configuration file at path.
func appendConf(path, line string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(line + "\n")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// startQuietPostgres starts a server of the test's own (startOwnPostgres)
// with synchronous_commit set to syncCommit, on which nothing but a commit's
// own flush writes the WAL to disk: the WAL writer waits 10s between
// flushes, and wal_level minimal and no autovacuum mean no background
// process writes WAL (a standby snapshot, a vacuum) between a statement and
// a check of flushed.
func startQuietPostgres(t *testing.T, syncCommit string) *ownPostgres {
	t.Helper()
	return startOwnPostgres(t, "wal_writer_delay = 10s", "synchronous_commit = "+syncCommit, "wal_level = minimal", "max_wal_senders = 0", "autovacuum = off")
}

// run runs one of the server's programs (as the server's user).
func (pg *ownPostgres) run(prog string, args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(pg.bin, prog), args...)
	if pg.asUser != "" {
		q := []string{filepath.Join(pg.bin, prog)}
		for _, a := range args {
			q = append(q, "'"+strings.ReplaceAll(a, "'", `'\''`)+"'")
		}
		cmd = exec.Command("su", pg.asUser, "-s", "/bin/sh", "-c", strings.Join(q, " "))
	}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func (pg *ownPostgres) start() (string, error) {
	return pg.run("pg_ctl", "-D", pg.dir, "-l", filepath.Join(filepath.Dir(pg.dir), "log"), "-w", "-t", "60", "start")
}

// crash stops the server as a crash would (no checkpoint, no flush of what
// is not yet on disk) and starts it again, which replays the WAL.
func (pg *ownPostgres) crash(t *testing.T) {
	t.Helper()
	if out, err := pg.run("pg_ctl", "-D", pg.dir, "-m", "immediate", "-w", "stop"); err != nil {
		t.Fatalf("pg_ctl stop -m immediate: %v\n%s", err, out)
	}
	if out, err := pg.start(); err != nil {
		t.Fatalf("pg_ctl start after the crash: %v\n%s", err, out)
	}
}

func (pg *ownPostgres) pool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	p, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:"+pg.port+"/postgres?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// TestPostgresTokensGrowAcrossCrash: grants and releases on a server of the
// test's own, which then crashes (pg_ctl stop -m immediate) and restarts
// (wal_writer_delay 10s, so nothing but a grant's own commit flushes it):
// every grant is on disk when it returns, so the row comes back with its
// counter, a lease held across the crash is still held after it and can be
// released, and the next grant's token is above every token handed out
// before the crash.
func TestPostgresTokensGrowAcrossCrash(t *testing.T) {
	t.Parallel() // a server of its own
	pg := startOwnPostgres(t, "wal_writer_delay = 10s", "synchronous_commit = on")
	ctx := context.Background()
	p := pg.pool(t)
	a, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := "crash"
	// A durable starting point: a checkpoint after the first grant.
	l, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	var last fence.Token
	for i := 0; i < 50; i++ {
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if l.Token() <= last {
			t.Fatalf("token %d after %d", l.Token(), last)
		}
		last = l.Token()
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	held, err := a.TryAcquire(ctx, name, time.Minute) // held across the crash
	if err != nil {
		t.Fatal(err)
	}
	last = held.Token()
	pg.crash(t)
	p.Reset() // its connections died with the server

	info, err := a.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if info.Counter != last || !info.Held {
		t.Errorf("after the crash the row holds counter %d (held %v); the grant before it had %d and was held", info.Counter, info.Held, last)
	}
	if _, err := a.TryAcquire(ctx, name, time.Minute); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("after the crash the lease held across it was granted again: %v, want ErrHeld", err)
	}
	if err := held.Release(ctx); err != nil {
		t.Errorf("releasing the lease held across the crash: %v", err)
	}
	l, err = a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if l.Token() <= last {
		t.Errorf("after the crash a grant got token %d, not above %d", l.Token(), last)
	}
}

// flushed reports whether the server's WAL is on disk up to where it has
// been written to (the read itself writes none): true right after a commit
// that waited for the disk, false after one that did not (the WAL writer,
// at wal_writer_delay 10s, rarely catches up in between).
func flushed(t *testing.T, p *pgxpool.Pool) bool {
	t.Helper()
	var ok bool
	if err := p.QueryRow(context.Background(), "SELECT pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn()").Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

// TestPostgresAsyncServerKeepsGrantsAcrossCrash: on a server whose
// synchronous_commit is off (a common tuning; wal_writer_delay 10s, so the
// WAL writer does not flush in between), the statements that hand out a token
// or extend a lease still wait for the disk, each one; a release does not. A
// grant made just before a crash comes back with its counter and its holder,
// so no token is handed out twice; a release lost in the crash leaves the
// lease held no longer than its ttl, and the next token is above every
// earlier one.
func TestPostgresAsyncServerKeepsGrantsAcrossCrash(t *testing.T) {
	t.Parallel() // a server of its own
	pg := startQuietPostgres(t, "off")
	ctx := context.Background()
	p := pg.pool(t)
	a, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	const n = 20
	name := "async"
	var grants, renewals, releases, bumps int // statements whose commit was on disk when they returned
	for i := 0; i < n; i++ {
		l, err := a.TryAcquire(ctx, fmt.Sprintf("%s-%d", name, i), time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if flushed(t, p) {
			grants++
		}
		if err := l.Renew(ctx); err != nil {
			t.Fatal(err)
		}
		if flushed(t, p) {
			renewals++
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if flushed(t, p) {
			releases++
		}
		if err := a.Bump(ctx, fmt.Sprintf("%s-%d", name, i), l.Token()+1e9); err != nil {
			t.Fatal(err)
		}
		if flushed(t, p) {
			bumps++
		}
	}
	t.Logf("of %d each, on disk when they returned: grants %d, renewals %d, releases %d, bumps %d", n, grants, renewals, releases, bumps)
	if grants < n || renewals < n || bumps < n {
		t.Errorf("grants, renewals or bumps returned before their commit was on disk, on a server with synchronous_commit off: %d, %d, %d of %d on disk", grants, renewals, bumps, n)
	}
	if releases > n/2 {
		t.Errorf("%d of %d releases waited for the disk: a release need not", releases, n)
	}

	// A grant just before the crash.
	held, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	pg.crash(t)
	p.Reset()
	info, err := a.Inspect(ctx, name)
	if err != nil {
		t.Fatalf("after the crash: %v (the grant made before it was lost)", err)
	}
	if info.Counter != held.Token() || !info.Held {
		t.Fatalf("after the crash the row holds counter %d (held %v); the grant before it had token %d", info.Counter, info.Held, held.Token())
	}
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// A release just before the crash: lost or not, the lease is free
	// within its ttl, and the next token is above the released one.
	l, err := a.TryAcquire(ctx, name, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if l.Token() <= held.Token() {
		t.Fatalf("token %d after %d", l.Token(), held.Token())
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	pg.crash(t)
	p.Reset()
	info, err = a.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after the crash the released lease shows held=%v, counter %d (token %d)", info.Held, info.Counter, l.Token())
	if info.Counter != l.Token() {
		t.Fatalf("after the crash the counter is %d; the last grant had token %d", info.Counter, l.Token())
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	next, err := a.Acquire(wctx, name, time.Minute)
	if err != nil {
		t.Fatalf("the lease released before the crash was not granted within 20s (its ttl was 2s): %v", err)
	}
	if next.Token() <= l.Token() {
		t.Errorf("after the crash a grant got token %d, not above %d", next.Token(), l.Token())
	}
}

// TestPostgresReleaseDoesNotWaitForDisk: on a server with synchronous_commit
// on, a grant returns with its commit on disk and a release without waiting
// for it, through a pool and through a *pgx.Conn; a release run inside the
// caller's transaction (a pgx.Tx, or a *pgx.Conn inside BEGIN) leaves that
// transaction's commit as durable as the server's setting makes it.
func TestPostgresReleaseDoesNotWaitForDisk(t *testing.T) {
	t.Parallel() // a server of its own
	pg := startQuietPostgres(t, "on")
	ctx := context.Background()
	p := pg.pool(t)
	pa, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := pa.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	pc, err := p.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Release()
	ca, err := sqlfence.NewAcquirer(sqlfence.Pgx(pc.Conn()), nil)
	if err != nil {
		t.Fatal(err)
	}
	sdb := stdlib.OpenDBFromPool(p)
	defer sdb.Close()
	sa, err := sqlfence.NewAcquirer(sqlfence.Postgres(sdb), nil)
	if err != nil {
		t.Fatal(err)
	}
	const n = 10
	for _, c := range []struct {
		how string
		a   *sqlfence.Acquirer
	}{{"pool", pa}, {"*pgx.Conn", ca}, {"database/sql", sa}} {
		grants, releases := 0, 0
		for i := 0; i < n; i++ {
			l, err := c.a.TryAcquire(ctx, "nodisk", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if flushed(t, p) {
				grants++
			}
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if flushed(t, p) {
				releases++
			}
		}
		t.Logf("%s: of %d, on disk when they returned: grants %d, releases %d", c.how, n, grants, releases)
		if grants < n || releases > n/2 {
			t.Errorf("%s: of %d grants %d were on disk when they returned, of %d releases %d: want every grant, and releases not waiting", c.how, n, grants, n, releases)
		}
	}

	// Inside the caller's transaction: its commit waits for the disk.
	inTx := func(how string, begin, commit func() error, a *sqlfence.Acquirer) {
		t.Helper()
		if err := begin(); err != nil {
			t.Fatal(err)
		}
		l, err := a.TryAcquire(ctx, "in-tx-"+how, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := commit(); err != nil {
			t.Fatal(err)
		}
		if !flushed(t, p) {
			t.Errorf("%s: the caller's transaction, with a release in it, committed without waiting for the disk", how)
		}
	}
	tx, err := p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ta, err := sqlfence.NewAcquirer(sqlfence.Pgx(tx), nil)
	if err != nil {
		t.Fatal(err)
	}
	inTx("pgx.Tx", func() error { return nil }, func() error { return tx.Commit(ctx) }, ta)
	exec := func(q string) func() error {
		return func() error { _, err := pc.Exec(ctx, q); return err }
	}
	inTx("*pgx.Conn in BEGIN", exec("BEGIN"), exec("COMMIT"), ca)
}

// TestPostgresAsyncGrants: with AsyncGrants a grant returns before its
// commit is on disk, and may be lost in a crash; the next grant's token is
// still above it (the counter is floored at the server's clock). A grant
// whose token is above the clock (after a Bump) still waits for the disk and
// survives the crash. Other dialects refuse the option.
func TestPostgresAsyncGrants(t *testing.T) {
	t.Parallel() // a server of its own
	if _, err := sqlfence.NewAcquirer(sqliteFDB(t), &sqlfence.AcquirerOptions{AsyncGrants: true}); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("AsyncGrants on SQLite: %v, want ErrInvalid", err)
	}
	pg := startQuietPostgres(t, "on")
	ctx := context.Background()
	p := pg.pool(t)
	durable, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), nil)
	if err != nil {
		t.Fatal(err)
	}
	a, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AsyncGrants: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := "async-grants"
	// A row on disk, its counter below the clock.
	first := fencetest.TryLive(ctx, t, durable, name, time.Minute)
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	const n = 10
	onDisk := 0
	last := first.Token()
	for i := 0; i < n; i++ {
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if flushed(t, p) {
			onDisk++
		}
		if l.Token() <= last {
			t.Fatalf("token %d after %d", l.Token(), last)
		}
		last = l.Token()
		if i < n-1 {
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("%d of %d asynchronous grants were on disk when they returned", onDisk, n)
	if onDisk > n/2 {
		t.Errorf("%d of %d AsyncGrants grants waited for the disk", onDisk, n)
	}
	pg.crash(t) // the last grant is held, maybe not on disk
	p.Reset()
	info, err := a.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after the crash: counter %d, held %v; the last grant had token %d", info.Counter, info.Held, last)
	if info.Counter > last {
		t.Fatalf("after the crash the counter is %d, above the last token %d", info.Counter, last)
	}
	wctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	next, err := a.Acquire(wctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if next.Token() <= last {
		t.Fatalf("after the crash a grant got token %d, not above the %d handed out before it: a token handed out twice", next.Token(), last)
	}
	if err := next.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// A counter above the clock: the grant waits for the disk.
	bumped := fence.Token(time.Now().UnixMicro()) + 1e12
	if err := a.Bump(ctx, name, bumped); err != nil {
		t.Fatal(err)
	}
	ahead, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if ahead.Token() != bumped+1 {
		t.Fatalf("token %d after a bump to %d", ahead.Token(), bumped)
	}
	if !flushed(t, p) {
		t.Errorf("a grant above the clock (token %d) returned before its commit was on disk", ahead.Token())
	}
	pg.crash(t)
	p.Reset()
	info, err = a.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if info.Counter != ahead.Token() || !info.Held {
		t.Fatalf("after the crash the counter is %d (held %v); the grant above the clock had token %d", info.Counter, info.Held, ahead.Token())
	}
}

func sqliteFDB(t *testing.T) *sqlfence.DB {
	_, fdb := openSQLite(t)
	return fdb
}
