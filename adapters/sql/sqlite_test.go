package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// openSQLite opens a fresh SQLite file in a temporary directory with both tables.
func openSQLite(t testing.TB) (*sql.DB, *sqlfence.DB) {
	t.Helper()
	db, err := sqlfence.OpenSQLite(filepath.Join(t.TempDir(), "fence.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db, sqlfence.SQLite(db)
}

func newSQLiteWriter(t testing.TB, fdb *sqlfence.DB) *sqlfence.Writer {
	t.Helper()
	w, err := sqlfence.NewWriter(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	return w
}

func newSQLiteAcquirer(t testing.TB, fdb *sqlfence.DB) *sqlfence.Acquirer {
	t.Helper()
	a, err := sqlfence.NewAcquirer(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	return a
}

func TestSQLiteWriterConformance(t *testing.T) {
	_, fdb := openSQLite(t)
	w := newSQLiteWriter(t, fdb)
	fencetest.WriterSuite{
		New:     func(t *testing.T) fence.FencedWriter { return w },
		BadKeys: badKeys,
	}.Run(t)
}

func TestSQLiteAcquirerConformance(t *testing.T) {
	t.Parallel() // its cases use names of their own; it overlaps the other suites, not the sequential tests
	raw, fdb := openSQLite(t)
	a := newSQLiteAcquirer(t, fdb)
	fencetest.AcquirerSuite{Parallel: true,
		New:    func(t *testing.T) fence.Acquirer { return a },
		MaxTTL: sqlfence.MaxTTL, BadNames: badKeys,
		DeleteState: deleteLeaseRow(stdExec(raw, dollar)),
	}.Run(t)
}

// TestSQLiteAcrossHandles runs the acquirer suite with every acquirer on its
// own database handle on one file, as separate processes would share it: the
// suite's New opens a handle each time it is called, so a case that takes two
// acquirers gets two handles.
func TestSQLiteAcrossHandles(t *testing.T) {
	t.Parallel() // its cases use names of their own; it overlaps the other suites, not the sequential tests
	path := filepath.Join(t.TempDir(), "shared.db")
	var handles atomic.Int32
	open := func(t *testing.T) fence.Acquirer {
		db, err := sqlfence.OpenSQLite(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		handles.Add(1)
		return newSQLiteAcquirer(t, sqlfence.SQLite(db))
	}
	t.Run("suite", func(t *testing.T) {
		fencetest.AcquirerSuite{Parallel: true, New: open, MaxTTL: sqlfence.MaxTTL, BadNames: badKeys}.Run(t)
	})
	// Every case of the suite asks New for its acquirers, one a case at least.
	if n := handles.Load(); n < 15 {
		t.Errorf("the suite opened %d handles: it did not get one per acquirer", n)
	}
	// Leases taken on one handle are seen on another.
	a1, a2 := open(t), open(t)
	l, err := a1.TryAcquire(context.Background(), "shared", 30e9)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a2.TryAcquire(context.Background(), "shared", 30e9); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("second handle: err = %v, want ErrHeld", err)
	}
	if err := l.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	l2, err := a2.TryAcquire(context.Background(), "shared", 30e9)
	if err != nil {
		t.Fatal(err)
	}
	if l2.Token() != l.Token()+1 {
		t.Errorf("token on the second handle = %d, want %d", l2.Token(), l.Token()+1)
	}
	_ = l2.Release(context.Background())
	// The suite, with New and NewOther each on a handle of its own, and the
	// lease rows deleted through a third.
	raw, err := sqlfence.OpenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	fencetest.AcquirerSuite{Parallel: true, New: open, NewOther: open, MaxTTL: sqlfence.MaxTTL, BadNames: badKeys,
		DeleteState: deleteLeaseRow(stdExec(raw, dollar))}.Run(t)
}

// badKeys are keys and lock names sqlfence refuses on every dialect: what
// PostgreSQL cannot store as indexed text (NUL, invalid UTF-8, too long for a
// btree entry), and one past MaxKeyBytes.
var badKeys = []string{
	"nul\x00byte",
	"bad utf-8 \xff\xfe",
	strings.Repeat("k", sqlfence.MaxKeyBytes+1),
	strings.Repeat("k", 1<<20),
}
