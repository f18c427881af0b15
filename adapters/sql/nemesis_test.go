package sqlfence_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
)

// TestSQLiteNemesis: clients, each on a database handle of its own on one
// SQLite file (as separate processes), call random lease and write
// operations while the nemesis deletes lease rows behind their backs; the
// history holds (fencetest.NemesisSuite). SQLite has no network, so no
// replies are lost and no client is partitioned.
func TestSQLiteNemesis(t *testing.T) {
	path := filepath.Join(t.TempDir(), "nemesis.db")
	open := func(t *testing.T) *sqlfence.DB {
		db, err := sqlfence.OpenSQLite(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		return sqlfence.SQLite(db)
	}
	raw, err := sqlfence.OpenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	direct := sqlfence.SQLite(raw)
	da, dw := newSQLiteAcquirer(t, direct), newSQLiteWriter(t, direct) // creates the tables
	exec := stdExec(raw, dollar)
	fencetest.NemesisSuite{
		Acquirer:    func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) { return newSQLiteAcquirer(t, open(t)), nil },
		Writer:      func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) { return newSQLiteWriter(t, open(t)), nil },
		Direct:      func(*testing.T) (fence.Acquirer, fence.FencedWriter) { return da, dw },
		DeleteState: nemesisDeleteLeaseRow(exec),
		ShortTTL:    300 * time.Millisecond,
	}.Run(t)
}

// nemesisDeleteLeaseRow is DeleteState for the nemesis: deleteLeaseRow, but
// reporting with t.Errorf, as the nemesis calls it from a goroutine of its
// own.
func nemesisDeleteLeaseRow(exec func(context.Context, string, ...any) error) func(*testing.T, string) {
	return func(t *testing.T, name string) {
		if err := exec(context.Background(), "DELETE FROM fence_leases WHERE name = %s", name); err != nil {
			t.Errorf("deleting the lease row of %q: %v", name, err)
		}
	}
}

// TestNemesis: clients on one PostgreSQL server, through pgx and through
// database/sql, and on the test MySQL or MariaDB server, each acquirer and
// writer on a handle of its own behind a proxy of its own, call random lease
// and write operations while replies are lost, latency added, clients
// partitioned and lease rows deleted; the history holds
// (fencetest.NemesisSuite). The ttl is the suite's default, as
// TestSQLiteNemesis, and twice the acquirer suite's 150ms: a client
// partitioned for a quarter of it must still be able to renew on a loaded
// machine.
func TestNemesis(t *testing.T) {
	runByServer(t, serverStyles(""), false, func(t *testing.T, s serverStyle) {
		deleteState := nemesisDeleteLeaseRow(s.operator(t)) // on MySQL, creates the tables
		fencetest.NemesisSuite{
			Acquirer: faultyAcquirer(s.open, s.target, nil),
			Writer:   faultyWriter(s.open, s.target),
			Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
				fdb := s.open(t, "")
				return newAcquirerOn(t, fdb, nil), newWriterOn(t, fdb, nil)
			},
			DeleteState: deleteState,
			ShortTTL:    300 * time.Millisecond,
		}.Run(t)
	})
}

// TestSQLiteIdempotencyNemesis: clients, each on a database handle of its own
// on one SQLite file (as separate processes), call idempotency.Do on a few
// keys with effects that pause past the lease and callers that leave; the
// history holds (idempotencytest.NemesisSuite). SQLite has no network, so no
// replies are lost and no client is partitioned.
func TestSQLiteIdempotencyNemesis(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idemnem.db")
	direct := idemStore(t, openSQLiteAt(t, path)) // creates the table
	idempotencytest.NemesisSuite{
		Store: func(t *testing.T) (idempotency.Store, *faultnet.Proxy) {
			return idemStore(t, openSQLiteAt(t, path)), nil
		},
		Direct: func(*testing.T) idempotency.Store { return direct },
	}.Run(t)
}

// TestIdempotencyNemesis: clients on one PostgreSQL server, through pgx and
// through database/sql, and on the test MySQL or MariaDB server, each store
// on a handle of its own behind a proxy of its own, call idempotency.Do while
// replies are lost, requests dropped, latency added and clients partitioned;
// the history holds (idempotencytest.NemesisSuite).
func TestIdempotencyNemesis(t *testing.T) {
	runByServer(t, serverStyles(""), false, func(t *testing.T, s serverStyle) {
		direct := idemStore(t, s.open(t, ""))
		idempotencytest.NemesisSuite{
			Store:  s.faultyStore,
			Direct: func(*testing.T) idempotency.Store { return direct },
		}.Run(t)
	})
}
