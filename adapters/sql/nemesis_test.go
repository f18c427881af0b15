package sqlfence_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
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
		Acquirer: func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) { return newSQLiteAcquirer(t, open(t)), nil },
		Writer:   func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) { return newSQLiteWriter(t, open(t)), nil },
		Direct:   func(*testing.T) (fence.Acquirer, fence.FencedWriter) { return da, dw },
		DeleteState: func(t *testing.T, name string) {
			if err := exec(context.Background(), "DELETE FROM fence_leases WHERE name = %s", name); err != nil {
				t.Errorf("deleting the lease row of %q: %v", name, err)
			}
		},
		ShortTTL: 300 * time.Millisecond,
	}.Run(t)
}
