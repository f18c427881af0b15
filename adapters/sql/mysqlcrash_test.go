package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// ownMariaDB is a mariadbd process of a test's own, on a temporary data
// directory, its own port and socket: the shared server is never killed.
type ownMariaDB struct {
	bin, dir string
	port     int
	flush    string      // innodb_flush_log_at_trx_commit
	proc     *os.Process // nil when not running
	exited   chan error  // Wait's result for proc
}

// startOwnMariaDB starts a mariadbd (or mysqld) of the test's own. Without the
// binary it skips, and fails when CI is set. The data directory starts empty:
// with --skip-grant-tables the server needs no system tables (mariadb-install-db
// would take seconds). flush is its innodb_flush_log_at_trx_commit: "1" (the
// default, as on the shared server) flushes every commit to disk, "2" writes
// each commit's log to the operating system and flushes once a second.
func startOwnMariaDB(t *testing.T, flush string) *ownMariaDB {
	t.Helper()
	var bin string
	for _, c := range []string{"mariadbd", "/usr/sbin/mariadbd", "mysqld", "/usr/sbin/mysqld"} {
		if p, err := exec.LookPath(c); err == nil {
			bin = p
			break
		}
	}
	if bin == "" {
		const msg = "no mariadbd binary to start a server of this test's own (install mariadb-server; scripts/test.sh does)"
		testenv.SkipUnlessCI(t, msg)
	}
	dir, err := os.MkdirTemp("", "fencekit-mariadb-") // short: the socket path has a length limit
	if err != nil {
		t.Fatal(err)
	}
	m := &ownMariaDB{bin: bin, dir: dir, port: testenv.Port(t), flush: flush}
	if err := os.Mkdir(filepath.Join(dir, "data"), 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		m.kill(t)
		os.RemoveAll(dir)
	})
	m.start(t)
	db := m.open(t, "")
	if _, err := db.Exec("CREATE DATABASE IF NOT EXISTS test"); err != nil {
		t.Fatal(err)
	}
	return m
}

// start runs the server on its data directory and waits until it answers.
func (m *ownMariaDB) start(t *testing.T) {
	t.Helper()
	args := []string{"--no-defaults", "--datadir=" + filepath.Join(m.dir, "data"),
		fmt.Sprintf("--port=%d", m.port), "--bind-address=127.0.0.1",
		"--socket=" + filepath.Join(m.dir, "sock"), "--pid-file=" + filepath.Join(m.dir, "pid"),
		"--skip-grant-tables", "--skip-log-bin", "--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M",
		"--innodb-flush-log-at-trx-commit=" + m.flush}
	if os.Geteuid() == 0 {
		args = append(args, "--user=root")
	}
	log, err := os.OpenFile(filepath.Join(m.dir, "server.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command(m.bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	m.proc, m.exited = cmd.Process, exited
	db, err := sql.Open("mysql", m.dsn(""))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	for deadline := time.Now().Add(60 * time.Second); ; {
		if err := db.Ping(); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("mariadbd did not answer within 60s: %v (log in %s)", err, m.dir)
		}
		select {
		case err := <-exited:
			m.proc = nil
			out, _ := os.ReadFile(filepath.Join(m.dir, "server.log"))
			t.Fatalf("mariadbd exited: %v\n%s", err, out)
		case <-time.After(50 * time.Millisecond): // poll pace
		}
	}
}

// kill ends the server with SIGKILL, as a crash would, and waits until it is gone.
func (m *ownMariaDB) kill(t *testing.T) {
	t.Helper()
	if m.proc == nil {
		return
	}
	p := m.proc
	m.proc = nil
	_ = p.Signal(syscall.SIGKILL)
	select {
	case <-m.exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("mariadbd %d still runs 30s after SIGKILL", p.Pid)
	}
}

func (m *ownMariaDB) dsn(db string) string {
	return fmt.Sprintf("root@tcp(127.0.0.1:%d)/%s", m.port, db)
}

// open opens a handle on database db ("" for none), closed with the test.
func (m *ownMariaDB) open(t *testing.T, db string) *sql.DB {
	t.Helper()
	h, err := sql.Open("mysql", m.dsn(db))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// TestMySQLCrashRestart kills mariadbd with SIGKILL (a server of the test's
// own) and starts it again on the same data. Afterwards: a name's next token
// is above every token granted before the crash (released or held), a lease
// held at the crash is still held (no one is granted while its holder's
// context may still run: the grant was flushed) and its holder can renew and
// release it, and a lease whose holder died with the crash frees itself after
// its ttl. It runs with every commit flushed (innodb_flush_log_at_trx_commit=1,
// the default) and with each commit's log written to the operating system
// only (2), which a crash of mariadbd alone does not lose either.
func TestMySQLCrashRestart(t *testing.T) {
	for _, flush := range []string{"1", "2"} {
		t.Run("innodb_flush_log_at_trx_commit="+flush, func(t *testing.T) { crashRestart(t, flush) })
	}
}

func crashRestart(t *testing.T, flush string) {
	m := startOwnMariaDB(t, flush)
	ctx := context.Background()
	open := func() (*sql.DB, *sqlfence.Acquirer) {
		db := m.open(t, "test")
		a, err := sqlfence.NewAcquirer(sqlfence.MySQL(db), nil)
		if err != nil {
			t.Fatal(err)
		}
		return db, a
	}
	_, a := open()
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	released, held, dead := fencetest.Name("crash"), fencetest.Name("crash"), fencetest.Name("crash")
	var last fence.Token
	for range 5 { // a row that made several grants
		l, err := a.TryAcquire(ctx, released, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		last = l.Token()
	}
	lh, err := a.TryAcquire(ctx, held, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	const deadTTL = 2 * time.Second
	ld, err := a.TryAcquire(ctx, dead, deadTTL)
	if err != nil {
		t.Fatal(err)
	}
	granted := time.Now()

	m.kill(t)
	m.start(t)
	_, b := open() // a new process's view

	l, err := b.TryAcquire(ctx, released, time.Minute)
	if err != nil {
		t.Fatalf("TryAcquire of a released name after the restart: %v", err)
	}
	if l.Token() <= last {
		t.Fatalf("token %d after the restart, not above %d granted before the crash", l.Token(), last)
	}
	_ = l.Release(ctx)
	if l2, err := b.TryAcquire(ctx, held, time.Minute); !errors.Is(err, fence.ErrHeld) {
		if err == nil {
			_ = l2.Release(ctx)
		}
		t.Fatalf("TryAcquire of a name held at the crash = %v, want ErrHeld: its holder's lease is still running", err)
	}
	// The holder's pool reconnects: its lease is the row's, on the new server.
	if err := lh.Renew(ctx); err != nil {
		t.Fatalf("Renew of the lease held at the crash: %v", err)
	}
	if err := lh.Release(ctx); err != nil {
		t.Fatalf("Release of the lease held at the crash: %v", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	lw, err := b.Acquire(wctx, dead, time.Minute)
	if err != nil {
		t.Fatalf("Acquire of a name whose holder died with the crash: %v", err)
	}
	if since := time.Since(granted); since < deadTTL-50*time.Millisecond {
		t.Fatalf("granted %v after the dead holder's grant, before its ttl %v", since, deadTTL)
	}
	if lw.Token() <= ld.Token() {
		t.Fatalf("token %d after the restart, not above %d granted before the crash", lw.Token(), ld.Token())
	}
	_ = lw.Release(ctx)
}
