package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
	_ "github.com/go-sql-driver/mysql" // registers the "mysql" driver
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// store is a fenced writer that can also read.
type store interface {
	fence.FencedWriter
	fence.Reader
}

// backend is what the demo and the benchmarks need from one lock backend.
type backend struct {
	name   string
	acq    fence.Acquirer
	fenced store
	// plainPut and plainGet are an unfenced store, the "before" of the lesson.
	plainPut func(ctx context.Context, key string, value []byte) error
	plainGet func(ctx context.Context, key string) ([]byte, error)
	// forceRelease frees a lock without checking whose it is: the lesson's
	// plain-DEL release bug, for the demo to show what it does.
	forceRelease func(ctx context.Context, name string) error
	close        func() error
	redis        *redis.Client // the Redis backend's client, for Redis-only measurements
	timing       *timing       // the demo's durations, when the lesson's do not fit
	idem         idempotency.Store
}

var backendNames = []string{"sqlite", "postgres", "mysql", "redis", "etcd", "s3"}

// backendConfig holds the flags that choose and reach a backend.
type backendConfig struct {
	name        string
	dbPath      string
	postgresURL string
	mysqlDSN    string
	redisAddr   string
	etcd        string
}

func (c *backendConfig) register(fs *flag.FlagSet) {
	fs.StringVar(&c.name, "backend", "sqlite", "lock and storage backend: "+strings.Join(backendNames, ", "))
	fs.StringVar(&c.dbPath, "db", "", "SQLite database file to use and keep (default: a temporary file, removed afterwards)")
	fs.StringVar(&c.postgresURL, "postgres-url", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL URL, for -backend postgres")
	fs.StringVar(&c.mysqlDSN, "mysql-dsn", "fencekit:fencekit@tcp(127.0.0.1:3306)/test", "MySQL or MariaDB DSN (go-sql-driver/mysql format), for -backend mysql")
	fs.StringVar(&c.redisAddr, "redis-addr", "127.0.0.1:6379", "Redis address, for -backend redis")
	fs.StringVar(&c.etcd, "etcd-endpoints", "", "comma-separated etcd endpoints, for -backend etcd (default: an embedded etcd in a temporary directory)")
}

// rawSQL runs the demo's own statements, which are not fenced, in the
// database's own dialect.
type rawSQL struct {
	exec     func(ctx context.Context, q string, args ...any) error
	getBytes func(ctx context.Context, q string, args ...any) ([]byte, error) // fence.ErrNotFound for no row
	// The unfenced table of the lesson's "before", and the plain release.
	createPlain, putPlain, getPlain, forceRelease string
}

// plainSQL returns the demo's unfenced statements for SQLite and PostgreSQL
// (blobType is their value type).
func plainSQL(blobType string) rawSQL {
	return rawSQL{
		createPlain:  `CREATE TABLE IF NOT EXISTS demo_plain (key TEXT PRIMARY KEY, value ` + blobType + ` NOT NULL)`,
		putPlain:     `INSERT INTO demo_plain (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = excluded.value`,
		getPlain:     `SELECT value FROM demo_plain WHERE key = $1`,
		forceRelease: `UPDATE fence_leases SET expires_at = 0 WHERE name = $1`,
	}
}

// sqlBackend builds a backend on a sqlfence handle and the same database's raw SQL.
func sqlBackend(ctx context.Context, name string, fdb *sqlfence.DB, raw rawSQL, closeFn func() error) (*backend, error) {
	w, err := sqlfence.NewWriter(fdb, nil)
	if err != nil {
		return nil, err
	}
	a, err := sqlfence.NewAcquirer(fdb, nil)
	if err != nil {
		return nil, err
	}
	if err := w.CreateTable(ctx); err != nil {
		return nil, err
	}
	if err := a.CreateTable(ctx); err != nil {
		return nil, err
	}
	idem, err := sqlfence.NewIdempotencyStore(fdb, nil)
	if err != nil {
		return nil, err
	}
	if err := idem.CreateTable(ctx); err != nil {
		return nil, err
	}
	if err := raw.exec(ctx, raw.createPlain); err != nil {
		return nil, err
	}
	return &backend{
		name:   name,
		acq:    a,
		fenced: w,
		idem:   idem,
		plainPut: func(ctx context.Context, key string, value []byte) error {
			return raw.exec(ctx, raw.putPlain, key, value)
		},
		plainGet: func(ctx context.Context, key string) ([]byte, error) {
			return raw.getBytes(ctx, raw.getPlain, key)
		},
		forceRelease: func(ctx context.Context, name string) error {
			// The documented lease table, released the wrong way: no token check.
			return raw.exec(ctx, raw.forceRelease, name)
		},
		close: closeFn,
	}, nil
}

// openSQLiteBackend opens path, or a temporary file when path is empty.
func openSQLiteBackend(ctx context.Context, path string) (*backend, error) {
	cleanup := func() error { return nil }
	if path == "" {
		dir, err := os.MkdirTemp("", "fence-")
		if err != nil {
			return nil, err
		}
		path = filepath.Join(dir, "demo.db")
		cleanup = func() error { return os.RemoveAll(dir) }
	}
	db, err := sqlfence.OpenSQLite(path)
	if err != nil {
		return nil, errors.Join(err, cleanup())
	}
	raw := stdRaw(db, plainSQL("BLOB"))
	closeFn := func() error { return errors.Join(db.Close(), cleanup()) }
	b, err := sqlBackend(ctx, "sqlite ("+path+")", sqlfence.SQLite(db), raw, closeFn)
	if err != nil {
		return nil, errors.Join(err, closeFn())
	}
	return b, nil
}

func openPostgresBackend(ctx context.Context, url string) (*backend, error) {
	p, err := pgxpool.New(ctx, url)
	if err == nil {
		err = p.Ping(ctx)
	}
	if err != nil {
		if p != nil {
			p.Close()
		}
		return nil, fmt.Errorf("postgres at %s: %w", url, err)
	}
	raw := plainSQL("BYTEA")
	raw.exec = func(ctx context.Context, q string, args ...any) error {
		_, err := p.Exec(ctx, q, args...)
		return err
	}
	raw.getBytes = func(ctx context.Context, q string, args ...any) ([]byte, error) {
		var v []byte
		err := p.QueryRow(ctx, q, args...).Scan(&v)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, fence.ErrNotFound
		}
		return v, err
	}
	closeFn := func() error { p.Close(); return nil }
	u := p.Config().ConnConfig
	b, err := sqlBackend(ctx, fmt.Sprintf("postgres (%s:%d/%s)", u.Host, u.Port, u.Database), sqlfence.Pgx(p), raw, closeFn)
	if err != nil {
		p.Close()
		return nil, err
	}
	return b, nil
}

// stdRaw runs the demo's statements on a database/sql handle.
func stdRaw(db *sql.DB, raw rawSQL) rawSQL {
	raw.exec = func(ctx context.Context, q string, args ...any) error {
		_, err := db.ExecContext(ctx, q, args...)
		return err
	}
	raw.getBytes = func(ctx context.Context, q string, args ...any) ([]byte, error) {
		var v []byte
		err := db.QueryRowContext(ctx, q, args...).Scan(&v)
		if errors.Is(err, sql.ErrNoRows) {
			return nil, fence.ErrNotFound
		}
		return v, err
	}
	return raw
}

// openMySQLBackend opens MySQL or MariaDB at dsn (go-sql-driver/mysql format).
func openMySQLBackend(ctx context.Context, dsn string) (*backend, error) {
	db, err := sql.Open("mysql", dsn)
	if err == nil {
		err = db.PingContext(ctx)
	}
	if err != nil {
		if db != nil {
			db.Close()
		}
		return nil, fmt.Errorf("mysql at %s: %w", dsn, err)
	}
	raw := stdRaw(db, rawSQL{
		createPlain:  "CREATE TABLE IF NOT EXISTS demo_plain (k VARBINARY(255) PRIMARY KEY, value LONGBLOB NOT NULL)",
		putPlain:     "INSERT INTO demo_plain (k, value) VALUES (?, ?) ON DUPLICATE KEY UPDATE value = VALUES(value)",
		getPlain:     "SELECT value FROM demo_plain WHERE k = ?",
		forceRelease: "UPDATE fence_leases SET expires_at = 0 WHERE name = ?",
	})
	b, err := sqlBackend(ctx, "mysql", sqlfence.MySQL(db), raw, db.Close)
	if err != nil {
		db.Close()
		return nil, err
	}
	return b, nil
}

func openBackend(ctx context.Context, c backendConfig) (*backend, error) {
	switch c.name {
	case "sqlite":
		return openSQLiteBackend(ctx, c.dbPath)
	case "postgres":
		return openPostgresBackend(ctx, c.postgresURL)
	case "mysql":
		return openMySQLBackend(ctx, c.mysqlDSN)
	case "redis":
		return openRedisBackend(ctx, c.redisAddr)
	case "etcd":
		return openEtcdBackend(ctx, c.etcd, c.dbPath)
	case "s3":
		return openS3Backend(ctx, c.dbPath)
	default:
		return nil, fmt.Errorf("%w: unknown backend %q (have: %s)", errUsage, c.name, strings.Join(backendNames, ", "))
	}
}

// quietRedis drops go-redis's own log lines; errors reach the user as errors.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

func openRedisBackend(ctx context.Context, addr string) (*backend, error) {
	redis.SetLogger(quietRedis{})
	c := redis.NewClient(&redis.Options{Addr: addr})
	if err := c.Ping(ctx).Err(); err != nil {
		c.Close()
		return nil, fmt.Errorf("redis at %s: %w", addr, err)
	}
	a, err := redislua.NewAcquirer(c, nil)
	if err != nil {
		c.Close()
		return nil, err
	}
	w, err := redislua.NewWriter(c, nil)
	if err != nil {
		c.Close()
		return nil, err
	}
	idem, err := redislua.NewIdempotencyStore(c, nil)
	if err != nil {
		c.Close()
		return nil, err
	}
	return &backend{
		name:   "redis (" + addr + ")",
		acq:    a,
		fenced: w,
		idem:   idem,
		redis:  c,
		plainPut: func(ctx context.Context, key string, value []byte) error {
			return c.Set(ctx, "fence-demo:"+key, value, time.Hour).Err()
		},
		plainGet: func(ctx context.Context, key string) ([]byte, error) {
			v, err := c.Get(ctx, "fence-demo:"+key).Bytes()
			if errors.Is(err, redis.Nil) {
				return nil, fence.ErrNotFound
			}
			return v, err
		},
		forceRelease: func(ctx context.Context, name string) error {
			// The lesson's bug itself: a plain DEL of the lock key.
			return c.Del(ctx, redislua.DefaultPrefix+"{"+name+"}:lock").Err()
		},
		close: c.Close,
	}, nil
}
