package idempotency_test

import (
	"context"
	"database/sql"
	"net"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/fencekit/fencekit/adapters/redislua"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"
)

// serverStore is a store on a real server reached through a fault proxy of
// its own, and a store on the same data reached directly (for other callers
// and for reading records back, untouched by the proxy's faults).
type serverStore struct {
	faulty idempotency.Store
	proxy  *faultnet.Proxy
	direct idempotency.Store
}

// serverStores returns the PostgreSQL (pgx and database/sql), MariaDB and
// Redis idempotency stores, each behind a fault proxy of its own.
func serverStores(t *testing.T) map[string]serverStore {
	t.Helper()
	out := map[string]serverStore{}
	newSQL := func(fdb *sqlfence.DB) idempotency.Store {
		s, err := sqlfence.NewIdempotencyStore(fdb, nil)
		if err == nil {
			err = s.CreateTable(context.Background())
		}
		if err != nil {
			t.Fatal(err)
		}
		return s
	}

	// PostgreSQL.
	if err := testenv.PingPostgres(testenv.PostgresURL()); err != nil {
		testenv.Missing(t, "PostgreSQL", err)
	}
	pgPool := func(addr string) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
		if err != nil {
			t.Fatal(err)
		}
		if addr != "" {
			host, port, _ := net.SplitHostPort(addr)
			p, _ := strconv.Atoi(port)
			cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = host, uint16(p), nil
		}
		p, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		return p
	}
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	pgAddr := net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))
	{
		px := faultnet.Start(t, pgAddr)
		out["postgres-pgx"] = serverStore{newSQL(sqlfence.Pgx(pgPool(px.Addr()))), px, newSQL(sqlfence.Pgx(pgPool("")))}
	}
	{
		px := faultnet.Start(t, pgAddr)
		db := stdlib.OpenDBFromPool(pgPool(px.Addr()))
		t.Cleanup(func() { db.Close() })
		ddb := stdlib.OpenDBFromPool(pgPool(""))
		t.Cleanup(func() { ddb.Close() })
		out["postgres-sql"] = serverStore{newSQL(sqlfence.Postgres(db)), px, newSQL(sqlfence.Postgres(ddb))}
	}

	// MariaDB.
	mcfg, err := mysql.ParseDSN(testenv.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	if err := testenv.Dial(mcfg.Addr); err != nil {
		testenv.Missing(t, "MariaDB", err)
	}
	{
		px := faultnet.Start(t, mcfg.Addr)
		open := func(addr string) *sql.DB {
			c := mcfg.Clone()
			c.Addr = addr
			db, err := sql.Open("mysql", c.FormatDSN())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			return db
		}
		out["mariadb"] = serverStore{newSQL(sqlfence.MySQL(open(px.Addr()))), px, newSQL(sqlfence.MySQL(open(mcfg.Addr)))}
	}

	// Redis.
	if err := testenv.Dial(testenv.RedisAddr()); err != nil {
		testenv.Missing(t, "Redis", err)
	}
	{
		px := faultnet.Start(t, testenv.RedisAddr())
		c := redis.NewClient(&redis.Options{Addr: px.Addr()})
		t.Cleanup(func() { c.Close() })
		fs, err := redislua.NewIdempotencyStore(c, nil)
		if err != nil {
			t.Fatal(err)
		}
		ds, err := redislua.NewIdempotencyStore(testenv.RedisClient(t), nil)
		if err != nil {
			t.Fatal(err)
		}
		out["redis"] = serverStore{fs, px, ds}
	}
	return out
}

// hookedStore passes every call to its Store, and lets a test act before or
// after chosen calls (a fault armed on the proxy, another caller's steps).
type hookedStore struct {
	idempotency.Store
	beforeUpdate func(n int, from idempotency.State, ch idempotency.Change)
	afterUpdate  func(n int, from idempotency.State, ch idempotency.Change, err error)
	beforeGet    func(n int)
	updates      atomic.Int32
	gets         atomic.Int32
}

func (h *hookedStore) Update(ctx context.Context, k string, from idempotency.State, f fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	n := int(h.updates.Add(1))
	if h.beforeUpdate != nil {
		h.beforeUpdate(n, from, ch)
	}
	rec, err := h.Store.Update(ctx, k, from, f, ch)
	if h.afterUpdate != nil {
		h.afterUpdate(n, from, ch, err)
	}
	return rec, err
}

func (h *hookedStore) Get(ctx context.Context, k string) (idempotency.Record, error) {
	n := int(h.gets.Add(1))
	if h.beforeGet != nil {
		h.beforeGet(n)
	}
	return h.Store.Get(ctx, k)
}
