package sqlfence_test

import (
	"context"
	"database/sql"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// counter is a pgx tracer that counts statements and serialization failures.
type counter struct {
	queries       atomic.Int64
	serialization atomic.Int64
}

func (c *counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.queries.Add(1)
	return ctx
}

func (c *counter) TraceQueryEnd(_ context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if sqlfence.IsSerializationFailure(d.Err) {
		c.serialization.Add(1)
	}
}

type pgOpts struct {
	params map[string]string // server settings for every connection
	tracer *counter
	addr   string // host:port to dial instead of the server's (a faultnet proxy)
}

// pgPool returns a pgx pool on the test server, closed at the end of the test.
func pgPool(t testing.TB, o pgOpts) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range o.params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	if o.tracer != nil {
		cfg.ConnConfig.Tracer = o.tracer
	}
	if o.addr != "" {
		host, port, err := net.SplitHostPort(o.addr)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.Atoi(port)
		cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = host, uint16(n), nil
	}
	ctx := context.Background()
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = p.Ping(ctx)
	}
	if err != nil {
		testenv.Missing(t, "PostgreSQL at "+testenv.PostgresURL(), err)
	}
	t.Cleanup(p.Close)
	pgSetup(t, p)
	return p
}

// pgStd returns a database/sql handle (pgx stdlib driver) on the test server.
func pgStd(t testing.TB) *sql.DB {
	t.Helper()
	p := pgPool(t, pgOpts{})
	db := stdlib.OpenDBFromPool(p)
	t.Cleanup(func() { db.Close() })
	return db
}

var pgSetupOnce sync.Once

// pgSetup creates the default tables once per test binary.
func pgSetup(t testing.TB, p *pgxpool.Pool) {
	var err error
	pgSetupOnce.Do(func() {
		ctx := context.Background()
		fdb := sqlfence.Pgx(p)
		w, _ := sqlfence.NewWriter(fdb, nil)
		a, _ := sqlfence.NewAcquirer(fdb, nil)
		g, _ := sqlfence.NewGuards(fdb, nil)
		if err = w.CreateTable(ctx); err != nil {
			return
		}
		if err = a.CreateTable(ctx); err != nil {
			return
		}
		err = g.CreateTable(ctx)
	})
	if err != nil {
		t.Fatalf("creating the default tables: %v", err)
	}
}

// pgGuards returns Guards on the default guard table of p's database (pgSetup
// creates it).
func pgGuards(t testing.TB, p *pgxpool.Pool) *sqlfence.Guards {
	t.Helper()
	g, err := sqlfence.NewGuards(sqlfence.Pgx(p), nil)
	if err != nil {
		t.Fatal(err)
	}
	return g
}
