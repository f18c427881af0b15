package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestNilHandlesAndBadOptions: constructors refuse nil handles and negative
// options with ErrInvalid instead of panicking later.
func TestNilHandlesAndBadOptions(t *testing.T) {
	var nilPool *pgxpool.Pool
	for what, db := range map[string]*sqlfence.DB{
		"nil *DB": nil, "SQLite(nil)": sqlfence.SQLite(nil), "Postgres(nil)": sqlfence.Postgres(nil),
		"Pgx(nil)": sqlfence.Pgx(nil), "Pgx(nil pool)": sqlfence.Pgx(nilPool),
	} {
		if _, err := sqlfence.NewWriter(db, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewWriter(%s): %v", what, err)
		}
		if _, err := sqlfence.NewAcquirer(db, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewAcquirer(%s): %v", what, err)
		}
		if _, err := sqlfence.NewIdempotencyStore(db, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewIdempotencyStore(%s): %v", what, err)
		}
		if _, err := sqlfence.NewGuards(db, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewGuards(%s): %v", what, err)
		}
	}
	_, fdb := openSQLite(t)
	for _, b := range []fence.Backoff{{Min: -1}, {Max: -time.Second}, {MaxWait: -time.Second}} {
		if _, err := sqlfence.NewAcquirer(fdb, &sqlfence.AcquirerOptions{Backoff: b}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewAcquirer with Backoff %+v: %v", b, err)
		}
	}
}

// TestNilContextLeavesHandleUsable: a nil context used to panic inside
// database/sql and leave the SQLite handle's mutex locked, so Close hung. Now it
// is refused before the handle is touched, and the handle still works and
// closes.
func TestNilContextLeavesHandleUsable(t *testing.T) {
	db, fdb := openSQLite(t)
	w, a := newSQLiteWriter(t, fdb), newSQLiteAcquirer(t, fdb)
	var nilCtx context.Context
	if err := w.Write(nilCtx, "k", []byte("v"), 1); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("Write with a nil context: %v", err)
	}
	if _, err := a.TryAcquire(nilCtx, "n", time.Second); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("TryAcquire with a nil context: %v", err)
	}
	g, err := sqlfence.NewGuards(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Guard(nilCtx, nil, "n", 1); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("Guard with a nil context: %v", err)
	}
	if err := w.Write(context.Background(), "k", []byte("v"), 1); err != nil {
		t.Fatalf("Write after the refused calls: %v", err)
	}
	closed := make(chan error, 1)
	go func() { closed <- db.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("db.Close hung: the handle was left locked")
	}
}

// TestLongestKeys: a key and a lock name of exactly MaxKeyBytes, in multi-byte
// characters that do not compress, are stored on both dialects.
func TestLongestKeys(t *testing.T) {
	// 1012 bytes of 3-byte characters and one ASCII byte, then 12 unique ones.
	var b strings.Builder
	for i := 0; i < 337; i++ {
		b.WriteRune(rune(0x4e00 + (i*7919)%20000))
	}
	b.WriteString("y")
	_, sq := openSQLite(t)
	handles := map[string]*sqlfence.DB{"sqlite": sq}
	for style, fdb := range pgHandles(t) {
		handles["postgres/"+style] = fdb
	}
	ctx := context.Background()
	for what, fdb := range handles {
		w, err := sqlfence.NewWriter(fdb, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := w.CreateTable(ctx); err != nil {
			t.Fatal(err)
		}
		key := b.String() + fencetest.Name("")[1:]
		if len(key) != sqlfence.MaxKeyBytes {
			t.Fatalf("built a key of %d bytes", len(key))
		}
		if err := w.Write(ctx, key, []byte("v"), 1); err != nil {
			t.Errorf("%s: Write with a %d-byte key: %v", what, len(key), err)
		}
		a, err := sqlfence.NewAcquirer(fdb, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.CreateTable(ctx); err != nil {
			t.Fatal(err)
		}
		l, err := a.TryAcquire(ctx, key, time.Second)
		if err != nil {
			t.Errorf("%s: TryAcquire with a %d-byte name: %v", what, len(key), err)
			continue
		}
		_ = l.Release(ctx)
	}
}

// TestRunTxBadInput: RunTx and RunPgxTx refuse a nil context, handle or
// function with ErrInvalid instead of panicking.
func TestRunTxBadInput(t *testing.T) {
	db, _ := openSQLite(t)
	p := pgPool(t, pgOpts{})
	ok := func(*sql.Tx) error { return nil }
	okPgx := func(pgx.Tx) error { return nil }
	var nilPool *pgxpool.Pool
	var nilCtx context.Context // the nil context is the input under test
	for name, err := range map[string]error{
		"RunTx nil ctx":    sqlfence.RunTx(nilCtx, db, nil, ok),
		"RunTx nil db":     sqlfence.RunTx(context.Background(), nil, nil, ok),
		"RunTx nil f":      sqlfence.RunTx(context.Background(), db, nil, nil),
		"RunPgxTx nil ctx": sqlfence.RunPgxTx(nilCtx, p, nil, okPgx),
		"RunPgxTx nil db":  sqlfence.RunPgxTx(context.Background(), nilPool, nil, okPgx),
		"RunPgxTx nil f":   sqlfence.RunPgxTx(context.Background(), p, nil, nil),
	} {
		if !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
}

// TestRunTxBadOptions (HAZARDS 8): a negative MaxAttempts, an isolation
// level that database/sql does not define and pgx transaction modes that pgx
// does not define are refused with ErrInvalid naming the option, before a
// transaction begins (f never runs); a MaxAttempts of math.MaxInt is a bound
// like any other.
func TestRunTxBadOptions(t *testing.T) {
	ctx := context.Background()
	db, _ := openSQLite(t)
	p := pgPool(t, pgOpts{})
	runs := 0
	f := func(*sql.Tx) error { runs++; return nil }
	fPgx := func(pgx.Tx) error { runs++; return nil }
	for _, c := range []struct {
		name, arg string
		run       func() error
	}{
		{"RunTx MaxAttempts -1", "MaxAttempts", func() error { return sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{MaxAttempts: -1}, f) }},
		{"RunTx MaxAttempts MinInt", "MaxAttempts", func() error { return sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{MaxAttempts: math.MinInt}, f) }},
		{"RunTx Isolation 99", "Isolation", func() error { return sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{Isolation: 99}, f) }},
		{"RunTx Isolation -1", "Isolation", func() error { return sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{Isolation: -1}, f) }},
		{"RunPgxTx MaxAttempts -1", "MaxAttempts", func() error { return sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{MaxAttempts: -1}, fPgx) }},
		{"RunPgxTx IsoLevel", "TxOptions.IsoLevel", func() error {
			return sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{TxOptions: pgx.TxOptions{IsoLevel: "snapshot"}}, fPgx)
		}},
		{"RunPgxTx AccessMode", "TxOptions.AccessMode", func() error {
			return sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{TxOptions: pgx.TxOptions{AccessMode: "read only; SELECT 1"}}, fPgx)
		}},
		{"RunPgxTx DeferrableMode", "TxOptions.DeferrableMode", func() error {
			return sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{TxOptions: pgx.TxOptions{DeferrableMode: "later"}}, fPgx)
		}},
	} {
		runs = 0
		err := c.run()
		var inv *fence.InvalidError
		if !errors.As(err, &inv) || inv.Arg != c.arg {
			t.Errorf("%s: %v, want ErrInvalid naming %s", c.name, err, c.arg)
		}
		if runs != 0 {
			t.Errorf("%s: f ran %d times, want 0", c.name, runs)
		}
	}
	runs = 0
	if err := sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{MaxAttempts: math.MaxInt}, f); err != nil || runs != 1 {
		t.Errorf("RunTx MaxAttempts MaxInt: %v after %d runs, want nil after 1", err, runs)
	}
	runs = 0
	if err := sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{MaxAttempts: math.MaxInt, TxOptions: pgx.TxOptions{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadOnly, DeferrableMode: pgx.Deferrable}}, fPgx); err != nil || runs != 1 {
		t.Errorf("RunPgxTx MaxAttempts MaxInt, serializable read only deferrable: %v after %d runs, want nil after 1", err, runs)
	}
}

// TestTTLNotAboveDrift: a ttl that a Drift of the acquirer's would use up
// entirely is refused, instead of granting a lease whose context is already
// done with a nil error.
func TestTTLNotAboveDrift(t *testing.T) {
	_, fdb := openSQLite(t)
	newSQLiteAcquirer(t, fdb)
	a, err := sqlfence.NewAcquirer(fdb, &sqlfence.AcquirerOptions{Drift: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	fencetest.DriftRefusesShortTTL(t, a, time.Second, "ttl")
}
