package sqlfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// asyncServer starts a server of the test's own on which nothing but a
// commit's own flush puts the WAL on disk (wal_writer_delay 10s, no
// background WAL), with synchronous_commit on.
func asyncServer(t *testing.T) (*ownPostgres, *pgxpool.Pool) {
	t.Helper()
	pg := startQuietPostgres(t, "on")
	return pg, pg.pool(t)
}

func asyncAcquirer(t *testing.T, db *sqlfence.DB, o *sqlfence.AcquirerOptions) *sqlfence.Acquirer {
	t.Helper()
	a, err := sqlfence.NewAcquirer(db, o)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// TestAsyncGrantsMixedAcquirersAfterCrash attacks "fencing tokens never repeat or
// go backwards across a crash" when one table is shared by an AsyncGrants
// acquirer and a default one (nothing in the docs forbids it, e.g. a rolling
// deploy turning the option on). The async grant's token T is the clock; it
// is lost in a crash, the durable counter C is far below it, and the default
// acquirer's grant is C+1. Expects the token after the crash to be above T
// (fails if a token at or below a handed-out one is granted).
func TestAsyncGrantsMixedAcquirersAfterCrash(t *testing.T) {
	t.Parallel() // a server of its own
	pg, p := asyncServer(t)
	ctx := context.Background()
	durable := asyncAcquirer(t, sqlfence.Pgx(p), nil)
	async := asyncAcquirer(t, sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AsyncGrants: true})
	if err := durable.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := "mixed"
	first, err := durable.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	l, err := async.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if flushed(t, p) {
		t.Skip("the async grant was flushed before the crash: nothing to lose")
	}
	pg.crash(t)
	p.Reset()
	next, err := durable.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("before: durable token %d, async token %d; after the crash the default acquirer granted %d", first.Token(), l.Token(), next.Token())
	if next.Token() <= l.Token() {
		t.Errorf("after the crash the default acquirer granted token %d, not above the async grant's %d that its holder still uses: fencing broken (%d behind)", next.Token(), l.Token(), l.Token()-next.Token())
	}
	// The holder of the lost grant is told it lost the lease.
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("renewal of the grant lost in the crash: %v, want ErrLost", err)
	}
}

// TestAsyncGrantsInCallerTx attacks the durability of the caller's own
// transaction: an AsyncGrants grant run inside a caller's pgx.Tx sets
// synchronous_commit off for the whole transaction (set_config is_local), so
// the caller's other writes, committed on a synchronous_commit on server,
// return before they are on disk and are lost in a crash. The "# Durability
// on PostgreSQL" section promises a grant inside a caller's transaction makes
// the caller's commit wait for the disk; review 5 removed the same kind of
// change from the release. Expects the caller's commit on disk when Commit
// returns and its row present after a crash.
func TestAsyncGrantsInCallerTx(t *testing.T) {
	t.Parallel() // a server of its own
	pg, p := asyncServer(t)
	ctx := context.Background()
	if _, err := p.Exec(ctx, "CREATE TABLE callers (id int PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	if err := asyncAcquirer(t, sqlfence.Pgx(p), nil).CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	tx, err := p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO callers VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	a := asyncAcquirer(t, sqlfence.Pgx(tx), &sqlfence.AcquirerOptions{AsyncGrants: true, DisableNotify: true})
	l, err := a.TryAcquire(ctx, "in-tx", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	var setting string
	if err := tx.QueryRow(ctx, "SHOW synchronous_commit").Scan(&setting); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	onDisk := flushed(t, p)
	t.Logf("token %d; synchronous_commit in the caller's transaction after the grant: %s; on disk after Commit: %v", l.Token(), setting, onDisk)
	if !onDisk {
		t.Errorf("the caller's commit (synchronous_commit on) returned before it was on disk: the AsyncGrants grant inside it set synchronous_commit to %q for the caller's transaction", setting)
	}
	pg.crash(t)
	p.Reset()
	var n int
	if err := p.QueryRow(ctx, "SELECT count(*) FROM callers").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Errorf("the caller's committed row is gone after a crash (%d rows): its commit was acknowledged before it was durable", n)
	}
}

// TestAsyncGrantsWithAdvanceGuardsRefused: AsyncGrants with AdvanceGuards lost
// the guard advance with an asynchronous grant in a crash, and a stale
// holder's guarded transaction committed afterwards while the newer holder
// still held (review 6 showed it on a crashed server). The combination is
// now refused.
func TestAsyncGrantsWithAdvanceGuardsRefused(t *testing.T) {
	p := pgPool(t, pgOpts{})
	g, err := sqlfence.NewGuards(sqlfence.Pgx(p), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AsyncGrants: true, AdvanceGuards: g}); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("AsyncGrants with AdvanceGuards: %v, want ErrInvalid", err)
	}
}

// TestAsyncGrantsLostInCrash: an async grant lost in a crash, on a row
// the async grant itself created (INSERT branch) and on an existing row.
// Expects: Renew of the lost grant is ErrLost and does not touch the next
// holder's lease; its Release is ErrLost; the next async grant's token is
// above the lost one; a Bump to a value between the durable counter and the
// lost token succeeds (the counter is below it) and the next grant is still
// above the lost token; Bump refuses a value at the counter with ErrInvalid.
func TestAsyncGrantsLostInCrash(t *testing.T) {
	t.Parallel() // a server of its own
	pg, p := asyncServer(t)
	ctx := context.Background()
	a := asyncAcquirer(t, sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AsyncGrants: true})
	b := asyncAcquirer(t, sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AsyncGrants: true})
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	// An existing row, on disk.
	old, err := a.TryAcquire(ctx, "existing", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Exec(ctx, "CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	lostNew, err := a.TryAcquire(ctx, "created", time.Minute) // INSERT branch
	if err != nil {
		t.Fatal(err)
	}
	lostOld, err := a.TryAcquire(ctx, "existing", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if flushed(t, p) {
		t.Skip("the async grants were flushed before the crash")
	}
	pg.crash(t)
	p.Reset()
	if _, err := a.Inspect(ctx, "created"); !errors.Is(err, fence.ErrNotFound) {
		t.Logf("the created row after the crash: %v (expected it lost)", err)
	}
	info, err := a.Inspect(ctx, "existing")
	if err != nil {
		t.Fatal(err)
	}
	if info.Counter >= lostOld.Token() {
		t.Fatalf("the grant was not lost: counter %d, lost token %d", info.Counter, lostOld.Token())
	}
	// Bump to the counter is refused; to a value below the lost token it raises the counter.
	if err := a.Bump(ctx, "existing", info.Counter); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Bump to the counter %d: %v, want ErrInvalid", info.Counter, err)
	}
	mid := info.Counter + (lostOld.Token()-info.Counter)/2
	if err := a.Bump(ctx, "existing", mid); err != nil {
		t.Errorf("Bump to %d (counter %d): %v", mid, info.Counter, err)
	}
	for _, c := range []struct {
		name string
		lost fence.Lease
	}{{"created", lostNew}, {"existing", lostOld}} {
		next, err := b.TryAcquire(ctx, c.name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if next.Token() <= c.lost.Token() {
			t.Errorf("%s: token %d after the crash, not above the lost %d", c.name, next.Token(), c.lost.Token())
		}
		if err := c.lost.Renew(ctx); !errors.Is(err, fence.ErrLost) {
			t.Errorf("%s: renewal of the lost grant: %v, want ErrLost", c.name, err)
		}
		if err := c.lost.Release(ctx); !errors.Is(err, fence.ErrLost) {
			t.Errorf("%s: release of the lost grant: %v, want ErrLost", c.name, err)
		}
		info, err := b.Inspect(ctx, c.name)
		if err != nil {
			t.Fatal(err)
		}
		if !info.Held || info.Token != next.Token() || info.TimeLeft < 50*time.Second {
			t.Errorf("%s: the next holder's lease after the lost holder's calls: %+v", c.name, info)
		}
	}
}

// TestAsyncGrantsAboveClockOnAsyncSession: on a session whose synchronous_commit
// is off, an AsyncGrants grant whose token is above the clock (after a Bump)
// must still wait for the disk (off becomes local) and survive a crash; a
// grant below the clock leaves the session's own setting as it was (off
// stays off after the statement on a *pgx.Conn, not pinned to anything).
func TestAsyncGrantsAboveClockOnAsyncSession(t *testing.T) {
	t.Parallel() // a server of its own
	pg, p := asyncServer(t)
	ctx := context.Background()
	cfg := p.Config().ConnConfig.Copy()
	cfg.RuntimeParams["synchronous_commit"] = "off"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	a := asyncAcquirer(t, sqlfence.Pgx(conn), &sqlfence.AcquirerOptions{AsyncGrants: true})
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := "ahead"
	l, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	bumped := fence.Token(time.Now().UnixMicro()) + 1e11
	if err := a.Bump(ctx, name, bumped); err != nil {
		t.Fatal(err)
	}
	ahead, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if !flushed(t, p) {
		t.Errorf("a grant above the clock (token %d) on a synchronous_commit off session returned before it was on disk", ahead.Token())
	}
	var s string
	if err := conn.QueryRow(ctx, "SHOW synchronous_commit").Scan(&s); err != nil {
		t.Fatal(err)
	}
	if s != "off" {
		t.Errorf("the session's synchronous_commit is %q after the grant, want off", s)
	}
	conn.Close(ctx)
	pg.crash(t)
	p.Reset()
	a2 := asyncAcquirer(t, sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AsyncGrants: true})
	info, err := a2.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if info.Counter != ahead.Token() || !info.Held {
		t.Errorf("after the crash: counter %d held %v; the grant above the clock had token %d", info.Counter, info.Held, ahead.Token())
	}
}

// TestAsyncGrantsMixedAcquirersSameToken pushes the mixed-acquirer case to a
// token handed out twice: a Bump puts the counter a little above the clock,
// AsyncGrants grants (durable while above the clock) run until the clock has
// caught up and one returns before its commit is on disk; a crash loses it.
// A default acquirer on the same table then counts up from the durable
// counter one grant at a time and reaches the lost token exactly. Expects no
// grant with the lost token, and the lost holder's Renew to be ErrLost rather
// than extend the new holder's lease (fails when the token repeats).
func TestAsyncGrantsMixedAcquirersSameToken(t *testing.T) {
	t.Parallel() // a server of its own
	pg, p := asyncServer(t)
	ctx := context.Background()
	durable := asyncAcquirer(t, sqlfence.Pgx(p), &sqlfence.AcquirerOptions{DisableNotify: true})
	async := asyncAcquirer(t, sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AsyncGrants: true, DisableNotify: true})
	if err := durable.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := "same-token"
	first, err := durable.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := async.Bump(ctx, name, fence.Token(time.Now().UnixMicro())+2000); err != nil {
		t.Fatal(err)
	}
	var lost fence.Lease
	for i := 0; i < 10000 && lost == nil; i++ {
		l, err := async.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if !flushed(t, p) {
			lost = l
			break
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		// The release on disk too (an async grant after it flushes nothing).
		if _, err := p.Exec(ctx, "CHECKPOINT"); err != nil {
			t.Fatal(err)
		}
	}
	if lost == nil {
		t.Fatal("no grant returned before its commit was on disk")
	}
	pg.crash(t)
	p.Reset()
	info, err := durable.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	gap := lost.Token() - info.Counter
	t.Logf("lost token %d, durable counter after the crash %d (gap %d)", lost.Token(), info.Counter, gap)
	if gap <= 0 || gap > 20000 {
		t.Skipf("gap %d: not lost, or too many grants to walk", gap)
	}
	var l fence.Lease
	for {
		l, err = durable.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if l.Token() >= lost.Token() {
			break
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if l.Token() == lost.Token() {
		t.Errorf("token %d handed out twice: to the AsyncGrants grant lost in the crash, and again after it by the default acquirer", l.Token())
	}
	before, _ := durable.Inspect(ctx, name)
	if err := lost.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		after, _ := durable.Inspect(ctx, name)
		t.Errorf("the lost grant's Renew: %v, want ErrLost (the new holder's lease: %v left before, %v after)", err, before.TimeLeft, after.TimeLeft)
	}
}
