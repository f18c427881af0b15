package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/go-sql-driver/mysql" // also registers the "mysql" driver
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
	peer         *peerLock // the server's own lock, fence bench's baseline (PostgreSQL, MySQL); nil elsewhere
}

var backendNames = []string{"sqlite", "postgres", "mysql", "redis", "etcd", "s3", "nats", "gcs", "azure"}

// backendConfig holds the flags that choose and reach a backend.
type backendConfig struct {
	name        string
	dbPath      string
	postgresURL string
	mysqlDSN    string
	redisAddr   string
	redisURL    string
	etcd        string
	s3Endpoint  string
	s3Bucket    string
	s3Region    string
	// NATS: the server, and the buckets of the locks and of the protected keys.
	natsURL, natsBucket, natsDataBucket string
	gcsBucket                           string // -backend gcs
	gcsEndpoint                         string
	// -backend azure
	azureURL, azureContainer string
	// operator is set for inspect and bump, which act on the backend the flags
	// name and nothing else: no defaults, no temporary or embedded backend, no
	// tables created.
	operator bool
}

// The demo's and benchmarks' defaults: the servers scripts/test.sh starts.
const (
	defaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultMySQLDSN    = "fencekit:fencekit@tcp(127.0.0.1:3306)/test"
	defaultRedisAddr   = "127.0.0.1:6379"
)

// register adds the backend flags to fs: with the demo's defaults, or, for an
// operator's command, with none.
func (c *backendConfig) register(fs *flag.FlagSet, operator bool) {
	c.operator = operator
	def := func(v string) string {
		if operator {
			return ""
		}
		return v
	}
	need := func(demo, op string) string {
		if operator {
			return op
		}
		return demo
	}
	fs.StringVar(&c.name, "backend", "sqlite", "lock and storage backend: "+strings.Join(backendNames, ", "))
	fs.StringVar(&c.dbPath, "db", "", need(
		"SQLite database file to use and keep (when empty, a temporary file is used and removed afterwards)",
		"SQLite database file, which must exist: required for -backend sqlite, and with -key on etcd"))
	fs.StringVar(&c.postgresURL, "postgres-url", def(defaultPostgresURL), need(
		"PostgreSQL URL or keyword/value DSN, for -backend postgres",
		"PostgreSQL URL or keyword/value DSN, required for -backend postgres (PGPASSWORD and ~/.pgpass work as in psql)"))
	fs.StringVar(&c.mysqlDSN, "mysql-dsn", def(defaultMySQLDSN), need(
		"MySQL or MariaDB DSN (go-sql-driver/mysql format), for -backend mysql",
		"MySQL or MariaDB DSN (go-sql-driver/mysql format), required for -backend mysql"))
	fs.StringVar(&c.redisAddr, "redis-addr", def(defaultRedisAddr), need(
		"Redis address host:port, for -backend redis (password from REDIS_PASSWORD)",
		"Redis address host:port, for -backend redis: this or -redis-url is required (password from REDIS_PASSWORD)"))
	fs.StringVar(&c.redisURL, "redis-url", "", "Redis URL (redis://[user:password@]host:port/db or rediss://), for -backend redis; overrides -redis-addr")
	fs.StringVar(&c.etcd, "etcd-endpoints", "", need(
		"comma-separated etcd endpoints, for -backend etcd (when empty, an embedded etcd in a temporary directory; ETCDCTL_USERNAME and ETCDCTL_PASSWORD for auth)",
		"comma-separated etcd endpoints, required for -backend etcd (ETCDCTL_USERNAME and ETCDCTL_PASSWORD for auth)"))
	fs.StringVar(&c.s3Endpoint, "s3-endpoint", "", need(
		"S3 endpoint URL, for -backend s3 (when empty and -s3-bucket too, an in-process S3 server); credentials from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN",
		"S3 endpoint URL, for -backend s3 (when empty, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS); credentials from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN"))
	fs.StringVar(&c.s3Bucket, "s3-bucket", "", need(
		"S3 bucket, for -backend s3 with -s3-endpoint (it must exist)",
		"S3 bucket, required for -backend s3 (it must exist)"))
	fs.StringVar(&c.s3Region, "s3-region", "", "S3 region, for -backend s3 (default: AWS_REGION, else us-east-1)")
	fs.StringVar(&c.natsURL, "nats-url", "", need(
		"NATS server URL, for -backend nats (when empty, an in-process server in a temporary directory; NATS_USER and NATS_PASSWORD for auth)",
		"NATS server URL, required for -backend nats (NATS_USER and NATS_PASSWORD for auth)"))
	if operator {
		// Bucket names on the server -nats-url names; empty means the buckets
		// fence demo makes there (no default is shown: help shows nothing to
		// act on that the operator did not name).
		fs.StringVar(&c.natsBucket, "nats-bucket", "", "NATS KV bucket of the locks, for -backend nats (it must exist; when empty: "+natsLockBucket+", the bucket fence demo -nats-url uses)")
		fs.StringVar(&c.natsDataBucket, "nats-data-bucket", "", "NATS KV bucket of the protected keys, for -backend nats with inspect -key (it must exist; when empty: "+natsDataBucket+")")
	}
	fs.StringVar(&c.gcsBucket, "gcs-bucket", "", need(
		"Google Cloud Storage bucket, for -backend gcs (it must exist; when empty, an in-process GCS emulator); credentials from Application Default Credentials",
		"Google Cloud Storage bucket, required for -backend gcs (it must exist); credentials from Application Default Credentials"))
	fs.StringVar(&c.gcsEndpoint, "gcs-endpoint", "", "GCS JSON API endpoint URL, for -backend gcs with another server (default: Google's; an http:// one is taken for an emulator and sent no credentials)")
	fs.StringVar(&c.azureURL, "azure-url", "", need(
		"Azure blob service URL, for -backend azure (when empty, an Azurite started for the command); account and key from AZURE_STORAGE_ACCOUNT, AZURE_STORAGE_KEY",
		"Azure blob service URL, required for -backend azure; account and key from AZURE_STORAGE_ACCOUNT, AZURE_STORAGE_KEY"))
	fs.StringVar(&c.azureContainer, "azure-container", "", "Azure container, for -backend azure with -azure-url (it must exist)")
	if !operator {
		// The default DSN's password is the test user's; help shows it redacted.
		fs.Lookup("mysql-dsn").DefValue = redactConn(defaultMySQLDSN)
	}
}

// flagBackends names, for each backend flag, the backends it is for (-db is
// also the file of etcd's protected keys).
var flagBackends = map[string][]string{
	"db":               {"sqlite", "etcd"},
	"postgres-url":     {"postgres"},
	"mysql-dsn":        {"mysql"},
	"redis-addr":       {"redis"},
	"redis-url":        {"redis"},
	"etcd-endpoints":   {"etcd"},
	"s3-endpoint":      {"s3"},
	"s3-bucket":        {"s3"},
	"s3-region":        {"s3"},
	"nats-url":         {"nats"},
	"nats-bucket":      {"nats"},
	"nats-data-bucket": {"nats"},
	"gcs-bucket":       {"gcs"},
	"gcs-endpoint":     {"gcs"},
	"azure-url":        {"azure"},
	"azure-container":  {"azure"},
}

// checkFlags refuses, as a usage error, an unknown -backend and a backend flag
// given on the command line for another backend than -backend names: ignored,
// it would leave the command acting on (or starting) another backend than the
// one meant.
func (c *backendConfig) checkFlags(fs *flag.FlagSet) error {
	if !slices.Contains(backendNames, c.name) {
		return usagef("unknown backend %q (have: %s)", c.name, strings.Join(backendNames, ", "))
	}
	var err error
	fs.Visit(func(f *flag.Flag) {
		owners, ok := flagBackends[f.Name]
		if err != nil || !ok || slices.Contains(owners, c.name) {
			return
		}
		err = usagef("-%s is for -backend %s, not -backend %s", f.Name, strings.Join(owners, " or "), c.name)
	})
	return err
}

// checkOperator refuses, as a usage error, an operator's command whose flags
// do not name a real backend: inspect and bump never act on a default, a
// temporary file or an embedded server.
func (c *backendConfig) checkOperator(key string) error {
	missing := func(flagName, what string) error {
		return usagef("-backend %s needs %s naming %s (inspect and bump never act on a default or temporary backend)", c.name, flagName, what)
	}
	existing := func() error {
		fi, err := os.Stat(c.dbPath)
		if err != nil {
			return usagef("-db %s: %v (inspect and bump never create a database)", c.dbPath, errors.Unwrap(err))
		}
		if fi.IsDir() {
			return usagef("-db %s is a directory, not a database file", c.dbPath)
		}
		if strings.ContainsAny(c.dbPath, "?#") {
			return usagef("-db %s: the path may not contain ? or #", c.dbPath)
		}
		return nil
	}
	blank := func(v string) bool { return strings.TrimSpace(v) == "" }
	switch c.name {
	case "sqlite":
		if blank(c.dbPath) {
			return missing("-db FILE", "an existing database file")
		}
		return existing()
	case "postgres":
		if blank(c.postgresURL) {
			return missing("-postgres-url URL", "the database")
		}
	case "mysql":
		if blank(c.mysqlDSN) {
			return missing("-mysql-dsn DSN", "the database")
		}
	case "redis":
		if blank(c.redisAddr) && blank(c.redisURL) {
			return missing("-redis-addr ADDR or -redis-url URL", "the server")
		}
	case "etcd":
		if blank(c.etcd) {
			return missing("-etcd-endpoints URLS", "the cluster")
		}
		if slices.ContainsFunc(strings.Split(c.etcd, ","), blank) {
			return usagef("-etcd-endpoints holds an empty endpoint: %q", c.etcd)
		}
		if key != "" && c.dbPath == "" {
			return usagef("-key on -backend etcd needs -db FILE, the SQLite file that holds the protected keys")
		}
		if c.dbPath != "" {
			return existing()
		}
	case "nats":
		if blank(c.natsURL) {
			return missing("-nats-url URL", "the server")
		}
	case "s3":
		if blank(c.s3Bucket) {
			return missing("-s3-bucket BUCKET", "an existing bucket")
		}
		if os.Getenv("AWS_ACCESS_KEY_ID") == "" || os.Getenv("AWS_SECRET_ACCESS_KEY") == "" {
			return usagef("-backend s3 needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment")
		}
	case "gcs":
		if blank(c.gcsBucket) {
			return missing("-gcs-bucket BUCKET", "an existing bucket")
		}
	case "azure":
		if blank(c.azureURL) || blank(c.azureContainer) {
			return missing("-azure-url URL and -azure-container NAME", "an existing container")
		}
		if os.Getenv("AZURE_STORAGE_ACCOUNT") == "" || os.Getenv("AZURE_STORAGE_KEY") == "" {
			return usagef("-backend azure needs AZURE_STORAGE_ACCOUNT and AZURE_STORAGE_KEY in the environment")
		}
	}
	return nil
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

// connectPostgres opens a pool on url and checks that the server answers; a
// url that does not parse is a usage error.
func connectPostgres(ctx context.Context, url string) (*pgxpool.Pool, string, error) {
	if err := checkURLUserinfo("-postgres-url", url); err != nil {
		return nil, "", err
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, "", usagef("-postgres-url %s does not parse: %v", redactConn(url), err)
	}
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = p.Ping(ctx)
	}
	if err != nil {
		if p != nil {
			p.Close()
		}
		return nil, "", fmt.Errorf("postgres at %s: %w", redactConn(url), err)
	}
	u := cfg.ConnConfig
	return p, fmt.Sprintf("postgres (%s:%d/%s)", u.Host, u.Port, u.Database), nil
}

func openPostgresBackend(ctx context.Context, url string) (*backend, error) {
	p, name, err := connectPostgres(ctx, url)
	if err != nil {
		return nil, err
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
	b, err := sqlBackend(ctx, name, sqlfence.Pgx(p), raw, closeFn)
	if err != nil {
		p.Close()
		return nil, err
	}
	b.peer = postgresPeer(p)
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

// connectMySQL opens MySQL or MariaDB at dsn (go-sql-driver/mysql format)
// and checks that the server answers; a dsn that does not parse is a usage
// error.
func connectMySQL(ctx context.Context, dsn string) (*sql.DB, string, error) {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, "", usagef("-mysql-dsn %s does not parse: %v", redactConn(dsn), err)
	}
	db, err := sql.Open("mysql", dsn)
	if err == nil {
		err = db.PingContext(ctx)
	}
	if err != nil {
		if db != nil {
			db.Close()
		}
		return nil, "", fmt.Errorf("mysql at %s: %w", redactConn(dsn), err)
	}
	return db, fmt.Sprintf("mysql (%s/%s)", cfg.Addr, cfg.DBName), nil
}

// openMySQLBackend opens MySQL or MariaDB at dsn for the demo and benchmarks.
func openMySQLBackend(ctx context.Context, dsn string) (*backend, error) {
	db, name, err := connectMySQL(ctx, dsn)
	if err != nil {
		return nil, err
	}
	raw := stdRaw(db, rawSQL{
		createPlain:  "CREATE TABLE IF NOT EXISTS demo_plain (k VARBINARY(255) PRIMARY KEY, value LONGBLOB NOT NULL)",
		putPlain:     "INSERT INTO demo_plain (k, value) VALUES (?, ?) ON DUPLICATE KEY UPDATE value = VALUES(value)",
		getPlain:     "SELECT value FROM demo_plain WHERE k = ?",
		forceRelease: "UPDATE fence_leases SET expires_at = 0 WHERE name = ?",
	})
	b, err := sqlBackend(ctx, name, sqlfence.MySQL(db), raw, db.Close)
	if err != nil {
		db.Close()
		return nil, err
	}
	b.peer = mysqlPeer(db)
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
		return openRedisBackend(ctx, c)
	case "etcd":
		return openEtcdBackend(ctx, c.etcd, c.dbPath)
	case "s3":
		return openS3Backend(ctx, c)
	case "nats":
		return openNATSBackend(ctx, c.natsURL)
	case "gcs":
		return openGCSBackend(ctx, c)
	case "azure":
		return openAzureBackend(ctx, c)
	default:
		return nil, usagef("unknown backend %q (have: %s)", c.name, strings.Join(backendNames, ", "))
	}
}

// quietRedis drops go-redis's own log lines; errors reach the user as errors.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

// connectRedis connects to the server of -redis-url, else -redis-addr, with
// the password from REDIS_PASSWORD when the URL has none, and checks that it
// answers; a URL that does not parse is a usage error.
func connectRedis(ctx context.Context, cfg backendConfig) (*redis.Client, string, error) {
	redis.SetLogger(quietRedis{})
	opts, shown := &redis.Options{Addr: cfg.redisAddr}, cfg.redisAddr
	if cfg.redisURL != "" {
		if err := checkURLUserinfo("-redis-url", cfg.redisURL); err != nil {
			return nil, "", err
		}
		var err error
		if opts, err = redis.ParseURL(cfg.redisURL); err != nil {
			return nil, "", usagef("-redis-url %s does not parse: %v", redactConn(cfg.redisURL), err)
		}
		shown = redactConn(cfg.redisURL)
	}
	if opts.Password == "" {
		opts.Password = os.Getenv("REDIS_PASSWORD")
	}
	c := redis.NewClient(opts)
	if err := c.Ping(ctx).Err(); err != nil {
		c.Close()
		return nil, "", fmt.Errorf("redis at %s: %w", shown, err)
	}
	return c, "redis (" + opts.Addr + ")", nil
}

func openRedisBackend(ctx context.Context, cfg backendConfig) (*backend, error) {
	c, name, err := connectRedis(ctx, cfg)
	if err != nil {
		return nil, err
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
		name:   name,
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
