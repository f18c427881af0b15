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
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5/pgxpool"
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
	if out, err := pg.start(); err != nil {
		skip("pg_ctl start: "+out, err)
	}
	t.Cleanup(func() { _, _ = pg.run("pg_ctl", "-D", pg.dir, "-m", "immediate", "-w", "stop") })
	return pg
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
