package fencekit_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
)

// The child side of the process tests: run by re-executing the test binary with
// FENCEKIT_CHILD_DB set. It takes a lease on the shared SQLite file, says so,
// and waits for "write" on stdin; then it writes with its token, releases, and
// reports both outcomes.
func TestMain(m *testing.M) {
	if path := os.Getenv("FENCEKIT_CHILD_DB"); path != "" {
		os.Exit(child(path))
	}
	os.Exit(m.Run())
}

func child(path string) int {
	ctx := context.Background()
	db, err := sqlfence.OpenSQLite(path)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fdb := sqlfence.SQLite(db)
	a, _ := sqlfence.NewAcquirer(fdb, nil)
	w, _ := sqlfence.NewWriter(fdb, nil)
	ttl, _ := time.ParseDuration(os.Getenv("FENCEKIT_CHILD_TTL"))
	l, err := a.TryAcquire(ctx, "job", ttl)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("acquired", l.Token())
	in := bufio.NewScanner(os.Stdin)
	if !in.Scan() || in.Text() != "write" {
		return 1
	}
	// The lease's context ended while the process was stopped, but the
	// process only finds out now, as a real paused process would.
	err = w.Write(ctx, "report", []byte("written by the child"), l.Token())
	switch {
	case err == nil:
		fmt.Println("write ok")
	case errors.Is(err, fence.ErrStale):
		fmt.Println("write stale")
	default:
		fmt.Println("write error", err)
	}
	if err := l.Release(ctx); errors.Is(err, fence.ErrLost) {
		fmt.Println("release lost")
	} else {
		fmt.Println("release", err)
	}
	return 0
}

type childProc struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
}

func startChild(t *testing.T, path string, ttl time.Duration) (*childProc, fence.Token) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "FENCEKIT_CHILD_DB="+path, "FENCEKIT_CHILD_TTL="+ttl.String())
	in, _ := cmd.StdinPipe()
	outPipe, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	c := &childProc{cmd: cmd, in: in, out: bufio.NewScanner(outPipe)}
	line := c.line(t)
	tok, err := strconv.ParseUint(strings.TrimPrefix(line, "acquired "), 10, 64)
	if !strings.HasPrefix(line, "acquired ") || err != nil {
		t.Fatalf("child: %q", line)
	}
	return c, fence.Token(tok)
}

func (c *childProc) line(t *testing.T) string {
	t.Helper()
	if !c.out.Scan() {
		t.Fatalf("child said nothing more: %v", c.out.Err())
	}
	return c.out.Text()
}

func sharedFile(t *testing.T) (string, *sqlfence.Acquirer, *sqlfence.Writer) {
	path := filepath.Join(t.TempDir(), "shared.db")
	fdb := sqliteDBAt(t, path)
	a, w := must(sqlfence.NewAcquirer(fdb, nil)), must(sqlfence.NewWriter(fdb, nil))
	if err := a.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := w.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	return path, a, w
}

func sqliteDBAt(t *testing.T, path string) *sqlfence.DB {
	db, err := sqlfence.OpenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return sqlfence.SQLite(db)
}

// TestProcessPaused stops a real process with SIGSTOP while it holds a lease and
// is about to write, lets this process take the lock and write, then resumes it:
// its write is rejected and it reports the lost lease.
func TestProcessPaused(t *testing.T) {
	ctx := context.Background()
	path, a, w := sharedFile(t)
	c, childTok := startChild(t, path, 300*time.Millisecond)
	if err := c.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	l, err := a.Acquire(ctx, "job", 10*time.Second) // granted once the child's lease expires
	if err != nil {
		t.Fatal(err)
	}
	if l.Token() <= childTok {
		t.Fatalf("token %d after the child's %d", l.Token(), childTok)
	}
	if err := w.Write(ctx, "report", []byte("written by the parent"), l.Token()); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(c.in, "write")
	if got := c.line(t); got != "write stale" {
		t.Errorf("the resumed child's write: %q, want rejected as stale", got)
	}
	if got := c.line(t); got != "release lost" {
		t.Errorf("the resumed child's release: %q, want the lost lease reported", got)
	}
	v, tok, _ := w.Read(ctx, "report")
	if string(v) != "written by the parent" || tok != l.Token() {
		t.Errorf("stored %q token %d", v, tok)
	}
	_ = l.Release(ctx)
}

// TestProcessKilled kills a real process with SIGKILL while it holds a lease:
// the lock stays held until the lease expires on the database's clock, then
// frees itself.
//
// The child's grant request was sent after the child was started, so its
// lease cannot expire before started+ttl; the database reports (Inspect) the
// time the lease has left, so it cannot expire before that much after the
// inspection was sent. Polled with TryAcquire, the lock must stay held, with
// the dead child's token, until both; the first grant must come back after
// them, with a larger token.
func TestProcessKilled(t *testing.T) {
	ctx := context.Background()
	path, a, _ := sharedFile(t)
	// The window is from the child's grant to the inspection after the kill
	// (a kill, a wait, one query): 2s leaves room for a loaded machine.
	const ttl = 2 * time.Second
	started := time.Now()
	c, childTok := startChild(t, path, ttl)
	if err := c.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = c.cmd.Wait()
	inspected := time.Now()
	info, err := a.Inspect(ctx, "job")
	if err != nil {
		t.Fatal(err)
	}
	if !info.Held || info.Token != childTok || info.TimeLeft <= 0 || info.TimeLeft > ttl {
		t.Fatalf("right after the kill: %+v, want held by the child's token %d with up to %v left", info, childTok, ttl)
	}
	expiresAfter := started.Add(ttl)
	if e := inspected.Add(info.TimeLeft); e.After(expiresAfter) {
		expiresAfter = e
	}
	if _, err := a.TryAcquire(ctx, "job", time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("right after the kill: %v, want ErrHeld (the lease outlives its holder)", err)
	}
	// Poll until the lock frees itself; the acquirer's default wait limit
	// (fence.DefaultMaxWait) bounds how long.
	deadline := time.Now().Add(fence.DefaultMaxWait)
	var l fence.Lease
	for attempts := 0; ; attempts++ {
		l, err = a.TryAcquire(ctx, "job", time.Second)
		if err == nil {
			break
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("polling the dead child's lock: %v", err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("the lock did not free itself within %v of the kill", fence.DefaultMaxWait)
		}
		if err := (fence.Backoff{Min: time.Millisecond, Max: 10 * time.Millisecond}).Sleep(ctx, attempts); err != nil {
			t.Fatal(err)
		}
	}
	if granted := time.Now(); granted.Before(expiresAfter) {
		t.Errorf("granted %v before the dead child's lease could expire on the database (%v after its start, %v left at the inspection)",
			expiresAfter.Sub(granted), ttl, info.TimeLeft)
	}
	if l.Token() <= childTok {
		t.Errorf("token %d after the killed child's %d", l.Token(), childTok)
	}
	_ = l.Release(ctx)
}
