package sqlfence_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
	"github.com/fencekit/fencekit/internal/testenv"
	_ "github.com/go-sql-driver/mysql"
)

// openMySQL opens the test MySQL or MariaDB server with extra DSN parameters
// (such as "clientFoundRows=true"), and creates the package's tables on it.
func openMySQL(t testing.TB, params string) (*sql.DB, *sqlfence.DB) {
	t.Helper()
	dsn := testenv.MySQLDSN()
	if params != "" {
		sep := "?"
		for _, c := range dsn {
			if c == '?' {
				sep = "&"
			}
		}
		dsn += sep + params
	}
	db, err := sql.Open("mysql", dsn)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = db.PingContext(ctx)
		cancel()
	}
	if err != nil {
		testenv.Missing(t, "MySQL or MariaDB at "+testenv.MySQLDSN(), err)
	}
	t.Cleanup(func() { db.Close() })
	fdb := sqlfence.MySQL(db)
	mysqlSetup(t, fdb)
	return db, fdb
}

// mysqlSetup creates the default tables once per test binary.
func mysqlSetup(t testing.TB, fdb *sqlfence.DB) {
	t.Helper()
	ctx := context.Background()
	w, _ := sqlfence.NewWriter(fdb, nil)
	a, _ := sqlfence.NewAcquirer(fdb, nil)
	s, _ := sqlfence.NewIdempotencyStore(fdb, nil)
	g, _ := sqlfence.NewGuards(&sqlfence.GuardOptions{MySQL: true})
	for _, f := range []func() error{func() error { return w.CreateTable(ctx) }, func() error { return a.CreateTable(ctx) }, func() error { return s.CreateTable(ctx) }, func() error { return g.CreateTable(ctx, fdb) }} {
		if err := f(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestMySQLWriterConformance(t *testing.T) {
	for _, params := range []string{"", "clientFoundRows=true"} {
		t.Run("params="+params, func(t *testing.T) {
			_, fdb := openMySQL(t, params)
			w, err := sqlfence.NewWriter(fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			fencetest.WriterSuite{New: func(t *testing.T) fence.FencedWriter { return w }, BadKeys: badKeys}.Run(t)
		})
	}
}

func TestMySQLAcquirerConformance(t *testing.T) {
	for _, params := range []string{"", "clientFoundRows=true"} {
		t.Run("params="+params, func(t *testing.T) {
			_, fdb := openMySQL(t, params)
			a, err := sqlfence.NewAcquirer(fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			fencetest.AcquirerSuite{New: func(t *testing.T) fence.Acquirer { return a }, MaxTTL: sqlfence.MaxTTL, BadNames: badKeys}.Run(t)
		})
	}
}

func TestMySQLIdempotency(t *testing.T) {
	for _, params := range []string{"", "clientFoundRows=true"} {
		t.Run("params="+params, func(t *testing.T) {
			_, fdb := openMySQL(t, params)
			s, err := sqlfence.NewIdempotencyStore(fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			idempotencytest.Suite{New: func(t *testing.T) idempotency.Store { return s }, BadKeys: badKeys}.Run(t)
		})
	}
}
