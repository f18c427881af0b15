// Package idemstores gives tests the idempotency stores on the real servers:
// SQLite in a temporary file, PostgreSQL and Redis (found through testenv),
// and NATS JetStream (an in-process server per test), directly or each
// through its own fault proxy.
package idemstores

import (
	"context"
	"database/sql"
	"net"
	"net/url"
	"path/filepath"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/adapters/redislua"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/fencekit/fencekit/internal/testenv"
	_ "github.com/jackc/pgx/v5/stdlib" // the pgx driver for database/sql
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
)

// Faulty is a store reached through a fault proxy in front of its server.
type Faulty struct {
	Store idempotency.Store
	Proxy *faultnet.Proxy
}

// All returns the SQLite, PostgreSQL, Redis and NATS stores, by name. A missing
// server skips the test (fails it under CI), as testenv.Missing does.
func All(t testing.TB) map[string]idempotency.Store {
	t.Helper()
	out := map[string]idempotency.Store{}
	db, err := sqlfence.OpenSQLite(filepath.Join(t.TempDir(), "idem.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	out["sqlite"] = sqlStore(t, sqlfence.SQLite(db))
	out["postgres"] = sqlStore(t, sqlfence.Postgres(postgres(t, testenv.PostgresURL())))
	rs, err := redislua.NewIdempotencyStore(testenv.RedisClient(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	out["redis"] = rs
	srv := natsServer(t)
	out["nats"] = natsStore(t, srv.ClientURL(), nil)
	return out
}

// Faults returns the PostgreSQL, Redis and NATS stores, each through a fault
// proxy of its own.
func Faults(t testing.TB) map[string]Faulty {
	t.Helper()
	u, err := url.Parse(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	postgres(t, u.String()) // skips without a server
	pp := faultnet.Start(t, u.Host)
	u.Host = pp.Addr()
	out := map[string]Faulty{"postgres": {sqlStore(t, sqlfence.Postgres(postgres(t, u.String()))), pp}}
	if err := testenv.Dial(testenv.RedisAddr()); err != nil {
		testenv.Missing(t, "Redis at "+testenv.RedisAddr(), err)
	}
	rp := faultnet.Start(t, testenv.RedisAddr())
	c := redis.NewClient(&redis.Options{Addr: rp.Addr()})
	t.Cleanup(func() { c.Close() })
	rs, err := redislua.NewIdempotencyStore(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	out["redis"] = Faulty{rs, rp}
	np := faultnet.Start(t, natsServer(t).Addr().String())
	// A request on a connection the proxy cut waits for its Timeout.
	out["nats"] = Faulty{natsStore(t, "nats://"+np.Addr(), &natsfence.IdempotencyOptions{Timeout: 500 * time.Millisecond}), np}
	return out
}

// natsServer starts an in-process NATS server with JetStream, stopped when t
// ends.
func natsServer(t testing.TB) interface {
	ClientURL() string
	Addr() net.Addr
} {
	t.Helper()
	srv, err := natstest.Start(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

// natsStore is the NATS store on a bucket made with natsfence.LockBucket on
// the server at url.
func natsStore(t testing.TB, url string, o *natsfence.IdempotencyOptions) idempotency.Store {
	t.Helper()
	j, err := jetstream.New(natstest.Connect(t, url))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := j.CreateOrUpdateKeyValue(ctx, natsfence.LockBucket("idempotency")); err != nil {
		t.Fatal(err)
	}
	s, err := natsfence.NewIdempotencyStore(ctx, j, "idempotency", o)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// postgres opens dsn, closed when t ends; no server skips the test.
func postgres(t testing.TB, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", dsn)
	if err == nil {
		err = db.Ping()
	}
	if err != nil {
		testenv.Missing(t, "PostgreSQL at "+testenv.PostgresURL(), err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// sqlStore is the idempotency store on db, with its table.
func sqlStore(t testing.TB, db *sqlfence.DB) idempotency.Store {
	t.Helper()
	s, err := sqlfence.NewIdempotencyStore(db, nil)
	if err == nil {
		err = s.CreateTable(context.Background())
	}
	if err != nil {
		t.Fatal(err)
	}
	return s
}
