package sqlfence_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/stdlib"
)

// The suites' optional harness parts for the SQL backends: an independent
// acquirer on a handle of its own (NewOther), and a writer or acquirer that
// reaches the server through a faultnet proxy (Faulty).

// opener returns a handle of its own on the test server, dialled through addr
// when addr is not empty.
type opener func(t *testing.T, addr string) *sqlfence.DB

// pgOpener opens handles of style ("pgx" or "database-sql", as pgHandles).
func pgOpener(style string) opener {
	return func(t *testing.T, addr string) *sqlfence.DB {
		p := pgPool(t, pgOpts{addr: addr})
		if style == "pgx" {
			return sqlfence.Pgx(p)
		}
		db := stdlib.OpenDBFromPool(p)
		t.Cleanup(func() { db.Close() })
		return sqlfence.Postgres(db)
	}
}

// mysqlOpener opens handles with the extra DSN parameters params.
func mysqlOpener(params string) opener {
	return func(t *testing.T, addr string) *sqlfence.DB {
		if addr == "" {
			_, fdb := openMySQL(t, params)
			return fdb
		}
		cfg := mysqlConfig(t)
		cfg.Addr = addr
		dsn := cfg.FormatDSN()
		if params != "" {
			sep := "?"
			if strings.Contains(dsn, "?") {
				sep = "&"
			}
			dsn += sep + params
		}
		db, err := sql.Open("mysql", dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		// Two idle connections, dialled before any fault is armed: a grant
		// pins one (see the bell), and a renewal runs on the other, so an
		// armed fault takes the renewal's statement, not a new handshake.
		ctx := context.Background()
		var cs []*sql.Conn
		for range 2 {
			c, err := db.Conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			cs = append(cs, c)
		}
		for _, c := range cs {
			_ = c.Close()
		}
		return sqlfence.MySQL(db)
	}
}

func mysqlConfig(t *testing.T) *mysql.Config {
	cfg, err := mysql.ParseDSN(testenv.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// otherAcquirer returns NewOther: an acquirer with opts on a handle of its own.
func otherAcquirer(open opener, opts *sqlfence.AcquirerOptions) func(*testing.T) fence.Acquirer {
	return func(t *testing.T) fence.Acquirer { return newAcquirerOn(t, open(t, ""), opts) }
}

func newAcquirerOn(t *testing.T, fdb *sqlfence.DB, opts *sqlfence.AcquirerOptions) *sqlfence.Acquirer {
	a, err := sqlfence.NewAcquirer(fdb, opts)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// faultyAcquirer returns Faulty: an acquirer with opts on a handle that
// reaches the server at target only through a new proxy.
func faultyAcquirer(open opener, target func(testing.TB) string, opts *sqlfence.AcquirerOptions) func(*testing.T) (fence.Acquirer, *faultnet.Proxy) {
	return func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
		p := faultnet.Start(t, target(t))
		return newAcquirerOn(t, open(t, p.Addr()), opts), p
	}
}

// faultyWriter returns Faulty: a default writer on a handle that reaches the
// server at target only through a new proxy.
func faultyWriter(open opener, target func(testing.TB) string) func(*testing.T) (fence.FencedWriter, *faultnet.Proxy) {
	return func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
		p := faultnet.Start(t, target(t))
		w, err := sqlfence.NewWriter(open(t, p.Addr()), nil)
		if err != nil {
			t.Fatal(err)
		}
		return w, p
	}
}
