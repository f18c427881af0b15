package sqlfence_test

import (
	"context"
	"database/sql"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/go-sql-driver/mysql"
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
	// maxConns is the pool's size; 0 is pgxpool's default.
	maxConns int32
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
	if o.maxConns > 0 {
		cfg.MaxConns = o.maxConns
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

// pooledConn takes a connection of p, given back at the end of the test.
func pooledConn(t testing.TB, p *pgxpool.Pool) *pgxpool.Conn {
	t.Helper()
	c, err := p.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Release)
	return c
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
		db := mysqlDB(t, addr, params)
		// Two idle connections, dialled before any fault is armed: a grant
		// pins one (see the bell), and a renewal runs on the other, so an
		// armed fault takes the renewal's statement, not a new handshake.
		takeStd(db, 2)(t)()
		return sqlfence.MySQL(db)
	}
}

// mysqlConfig is the test MySQL server's DSN, parsed.
func mysqlConfig(t testing.TB) *mysql.Config {
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

// newAcquirerOn is an acquirer with opts on fdb; an error ends the test.
func newAcquirerOn(t testing.TB, fdb *sqlfence.DB, opts *sqlfence.AcquirerOptions) *sqlfence.Acquirer {
	t.Helper()
	a, err := sqlfence.NewAcquirer(fdb, opts)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// newWriterOn is a writer with opts on fdb; an error ends the test.
func newWriterOn(t testing.TB, fdb *sqlfence.DB, opts *sqlfence.WriterOptions) *sqlfence.Writer {
	t.Helper()
	w, err := sqlfence.NewWriter(fdb, opts)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// mustGrant is a.TryAcquire(ctx, name, ttl); an error ends the test.
func mustGrant(t testing.TB, ctx context.Context, a fence.Acquirer, name string, ttl time.Duration) fence.Lease {
	t.Helper()
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	return l
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

// withParams appends extra DSN parameters (such as "clientFoundRows=true") to dsn.
func withParams(dsn, params string) string {
	if params == "" {
		return dsn
	}
	if strings.Contains(dsn, "?") {
		return dsn + "&" + params
	}
	return dsn + "?" + params
}

// mysqlDB is a database/sql handle on the test MySQL server reached at addr
// (the server's own address when addr is ""), with extra DSN parameters.
func mysqlDB(t testing.TB, addr, params string) *sql.DB {
	t.Helper()
	cfg := mysqlConfig(t)
	if addr != "" {
		cfg.Addr = addr
	}
	db, err := sql.Open("mysql", withParams(cfg.FormatDSN(), params))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// serverStyle is one driver style on one of the network servers: PostgreSQL
// through pgx or database/sql, or MySQL with a set of extra DSN parameters.
type serverStyle struct {
	server string // "postgres" or "mysql"
	name   string // "pgx", "database-sql", or "params=" and the DSN parameters
	params string // MySQL's extra DSN parameters
	open   opener
	target func(testing.TB) string // the server's address, for a proxy
}

// serverStyles returns PostgreSQL through pgx and database/sql, and MySQL
// with each of mysqlParams.
func serverStyles(mysqlParams ...string) []serverStyle {
	out := []serverStyle{
		{server: "postgres", name: "pgx", open: pgOpener("pgx"), target: pgTarget},
		{server: "postgres", name: "database-sql", open: pgOpener("database-sql"), target: pgTarget},
	}
	for _, p := range mysqlParams {
		out = append(out, serverStyle{server: "mysql", name: "params=" + p, params: p, open: mysqlOpener(p), target: mysqlAddr})
	}
	return out
}

// operator runs an operator's SQL (parameters written %[1]s, ...) on a handle
// of its own on s's server.
func (s serverStyle) operator(t *testing.T) func(context.Context, string, ...any) error {
	if s.server == "postgres" {
		return pgxExec(pgPool(t, pgOpts{}))
	}
	raw, _ := openMySQL(t, s.params)
	return stdExec(raw, func(int) string { return "?" })
}

// faultyStore returns an idempotency store on a handle of s's style that
// reaches the server only through a new proxy.
func (s serverStyle) faultyStore(t *testing.T) (idempotency.Store, *faultnet.Proxy) {
	if s.server == "postgres" {
		return faultyPostgres(t, s.name)
	}
	return faultyMySQL(t, s.params)
}

// runByServer runs f on each style as the subtest server/style; the servers'
// subtests run side by side when parallel, and each server's styles one after
// another.
func runByServer(t *testing.T, styles []serverStyle, parallel bool, f func(t *testing.T, s serverStyle)) {
	for _, server := range []string{"postgres", "mysql"} {
		t.Run(server, func(t *testing.T) {
			if parallel {
				t.Parallel()
			}
			for _, s := range styles {
				if s.server == server {
					t.Run(s.name, func(t *testing.T) { f(t, s) })
				}
			}
		})
	}
}
