package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"cloud.google.com/go/storage"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/adapters/redislua"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/etcdtest"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/fsouza/fake-gcs-server/fakestorage"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"
	"google.golang.org/api/option"
)

// fenceCmd runs the CLI and returns its exit status and all it printed.
func fenceCmd(args ...string) (int, string) {
	var out, errOut bytes.Buffer
	code := run(args, &out, &errOut)
	return code, out.String() + errOut.String()
}

// uniqueName is a lock name no earlier run used.
func uniqueName(t *testing.T) string {
	return fmt.Sprintf("cli-%s-%d", strings.ToLower(t.Name()[len("TestOperator"):]), time.Now().UnixNano())
}

// TestOperatorRefusesUnnamedBackend: for every backend, inspect and bump
// without the flags that name a real backend exit 2 with one line, and touch
// nothing (no file appears).
func TestOperatorRefusesUnnamedBackend(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing.db")
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"bump", "job", "-to", "100"}, "-backend sqlite needs -db FILE"},
		{[]string{"inspect", "job"}, "-backend sqlite needs -db FILE"},
		{[]string{"bump", "-db", missing, "job", "-to", "100"}, "inspect and bump never create a database"},
		{[]string{"inspect", "-db", missing, "job"}, "inspect and bump never create a database"},
		{[]string{"inspect", "-backend", "postgres", "job"}, "-backend postgres needs -postgres-url"},
		{[]string{"bump", "-backend", "postgres", "job", "-to", "5"}, "-backend postgres needs -postgres-url"},
		{[]string{"inspect", "-backend", "mysql", "job"}, "-backend mysql needs -mysql-dsn"},
		{[]string{"bump", "-backend", "mysql", "job", "-to", "5"}, "-backend mysql needs -mysql-dsn"},
		{[]string{"inspect", "-backend", "redis", "job"}, "-backend redis needs -redis-addr ADDR or -redis-url"},
		{[]string{"bump", "-backend", "redis", "job", "-to", "5"}, "-backend redis needs -redis-addr ADDR or -redis-url"},
		{[]string{"inspect", "-backend", "etcd", "job"}, "-backend etcd needs -etcd-endpoints"},
		{[]string{"bump", "-backend", "etcd", "job", "-to", "5"}, "-backend etcd needs -etcd-endpoints"},
		{[]string{"inspect", "-backend", "etcd", "-etcd-endpoints", "http://127.0.0.1:1", "-key", "k", "job"}, "-key on -backend etcd needs -db FILE"},
		{[]string{"inspect", "-backend", "etcd", "-etcd-endpoints", "http://127.0.0.1:1", "-db", missing, "job"}, "never create a database"},
		{[]string{"inspect", "-backend", "s3", "job"}, "-backend s3 needs -s3-bucket"},
		{[]string{"bump", "-backend", "s3", "job", "-to", "5"}, "-backend s3 needs -s3-bucket"},
		{[]string{"inspect", "-backend", "s3", "-s3-endpoint", "http://127.0.0.1:1", "job"}, "-backend s3 needs -s3-bucket"},
		{[]string{"inspect", "-backend", "s3", "-s3-bucket", "b", "job"}, "needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"},
		{[]string{"inspect", "-backend", "nats", "job"}, "-backend nats needs -nats-url"},
		{[]string{"bump", "-backend", "nats", "job", "-to", "5"}, "-backend nats needs -nats-url"},
		{[]string{"inspect", "-backend", "nats", "-nats-url", " ", "job"}, "-backend nats needs -nats-url"},
		{[]string{"inspect", "-backend", "nope", "job"}, `unknown backend "nope"`},
		// A blank value names nothing either: libpq's defaults would pick the
		// local server, go-redis and etcd a host of their own.
		{[]string{"inspect", "-backend", "postgres", "-postgres-url", " ", "job"}, "-backend postgres needs -postgres-url"},
		{[]string{"bump", "-backend", "mysql", "-mysql-dsn", " ", "job", "-to", "5"}, "-backend mysql needs -mysql-dsn"},
		{[]string{"inspect", "-backend", "redis", "-redis-addr", " ", "job"}, "-backend redis needs -redis-addr ADDR or -redis-url"},
		{[]string{"inspect", "-backend", "etcd", "-etcd-endpoints", ",", "job"}, "-etcd-endpoints holds an empty endpoint"},
		{[]string{"inspect", "-backend", "etcd", "-etcd-endpoints", "http://127.0.0.1:1, ", "job"}, "-etcd-endpoints holds an empty endpoint"},
		{[]string{"inspect", "-backend", "s3", "-s3-bucket", " ", "job"}, "-backend s3 needs -s3-bucket"},
		{[]string{"inspect", "-backend", "gcs", "job"}, "-backend gcs needs -gcs-bucket"},
	}
	t.Setenv("AWS_ACCESS_KEY_ID", "")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "")
	for _, c := range cases {
		code, out := fenceCmd(c.args...)
		if code != 2 || !strings.Contains(out, c.want) {
			t.Errorf("fence %q: exit %d, want 2 with %q:\n%s", c.args, code, c.want, out)
		}
		if first, _, _ := strings.Cut(out, "\n"); !strings.Contains(first, c.want) {
			t.Errorf("fence %q: the reason is not on the first line:\n%s", c.args, out)
		}
	}
	if _, err := os.Stat(missing); !os.IsNotExist(err) {
		t.Errorf("a refused command created %s: %v", missing, err)
	}
}

// bumpTo is what checkBump raises a counter to: above every backend's clock
// floor in microseconds (a new SQL lease row starts at the server's clock,
// and Bump never recreates a row below it) until about the year 2096, and
// below fence.MaxToken.
const bumpTo = 4_000_000_000_000_000

// checkBump bumps name to bumpTo through the CLI, refuses bumpTo-1, and
// inspects it; counter reads the counter from the backend itself.
func checkBump(t *testing.T, flags []string, name string, counter func() fence.Token) {
	t.Helper()
	with := func(args ...string) []string { return append(append([]string{args[0]}, flags...), args[1:]...) }
	to, below := fmt.Sprint(bumpTo), fmt.Sprint(bumpTo-1)
	if code, out := fenceCmd(with("inspect", name)...); code != 1 || !strings.Contains(out, "no lock named") {
		t.Errorf("inspect of a name never granted: exit %d\n%s", code, out)
	}
	if code, out := fenceCmd(with("bump", name, "-to", to)...); code != 0 || !strings.Contains(out, "counter raised to "+to) {
		t.Fatalf("bump: exit %d\n%s", code, out)
	}
	if got := counter(); got != bumpTo {
		t.Errorf("after fence bump -to %s the backend's counter is %d", to, got)
	}
	if code, out := fenceCmd(with("bump", name, "-to", below)...); code != 1 || !strings.Contains(out, "already at "+to) {
		t.Errorf("bump downwards: exit %d\n%s", code, out)
	}
	if code, out := fenceCmd(with("inspect", "-key", "never-written", name)...); code != 0 || !strings.Contains(out, "counter:   "+to) ||
		!strings.Contains(out, "held:      no") || !strings.Contains(out, `key "never-written": no value`) {
		t.Errorf("inspect after the bump: exit %d\n%s", code, out)
	}
}

func inspectCounter(t *testing.T, in fence.Inspector, name string) func() fence.Token {
	return func() fence.Token {
		info, err := in.Inspect(context.Background(), name)
		if err != nil {
			t.Fatalf("inspect %q on the backend: %v", name, err)
		}
		return info.Counter
	}
}

// sqlTables creates the lease and row tables on fdb, as an application using
// the library would have, and returns the acquirer.
func sqlTables(t *testing.T, fdb *sqlfence.DB) *sqlfence.Acquirer {
	t.Helper()
	ctx := context.Background()
	a, err := sqlfence.NewAcquirer(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := sqlfence.NewWriter(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	if err := w.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	return a
}

// sqliteLocks opens a SQLite file in a temporary directory, makes the lease
// and fence tables in it, and returns its path and an acquirer on it.
func sqliteLocks(t *testing.T) (string, *sqlfence.Acquirer) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "locks.db")
	db, err := sqlfence.OpenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	a := sqlTables(t, sqlfence.SQLite(db))
	return path, a
}

// holdJob grants the lock "job" through a for 10s, released when the test
// ends.
func holdJob(t *testing.T, a fence.Acquirer) fence.Lease {
	t.Helper()
	l, err := a.TryAcquire(context.Background(), "job", 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Release(context.Background()) })
	return l
}

// grantOnce grants name through a and releases it, so that its counter
// exists.
func grantOnce(t *testing.T, a fence.Acquirer, name string) {
	t.Helper()
	l, err := a.TryAcquire(context.Background(), name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestOperatorSQLite(t *testing.T) {
	path, a := sqliteLocks(t)
	checkBump(t, []string{"-db", path}, "job", inspectCounter(t, a, "job"))
	// A database without the lease table is an error naming it; nothing is created.
	empty := filepath.Join(t.TempDir(), "empty.db")
	edb, err := sql.Open("sqlite", empty)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := edb.Exec("CREATE TABLE other (x INT)"); err != nil {
		t.Fatal(err)
	}
	edb.Close()
	if code, out := fenceCmd("bump", "-db", empty, "job", "-to", "5"); code != 1 || !strings.Contains(out, "fence_leases") {
		t.Errorf("bump on a database without the lease table: exit %d\n%s", code, out)
	}
}

func TestOperatorPostgres(t *testing.T) {
	url := testenv.PostgresURL()
	if err := testenv.PingPostgres(url); err != nil {
		testenv.Missing(t, "PostgreSQL at "+url, err)
	}
	ctx := context.Background()
	p, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	a := sqlTables(t, sqlfence.Pgx(p))
	name := uniqueName(t)
	checkBump(t, []string{"-backend", "postgres", "-postgres-url", url}, name, inspectCounter(t, a, name))
}

func TestOperatorMySQL(t *testing.T) {
	dsn := testenv.MySQLDSN()
	ctx := context.Background()
	db, err := sql.Open("mysql", dsn)
	if err == nil {
		err = db.PingContext(ctx)
	}
	if err != nil {
		testenv.Missing(t, "MySQL or MariaDB at "+redactConn(dsn), err)
	}
	t.Cleanup(func() { db.Close() })
	a := sqlTables(t, sqlfence.MySQL(db))
	name := uniqueName(t)
	checkBump(t, []string{"-backend", "mysql", "-mysql-dsn", dsn}, name, inspectCounter(t, a, name))
}

func TestOperatorRedis(t *testing.T) {
	addr := testenv.RedisAddr()
	if err := testenv.Dial(addr); err != nil {
		testenv.Missing(t, "Redis at "+addr, err)
	}
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	a, err := redislua.NewAcquirer(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	name := uniqueName(t)
	checkBump(t, []string{"-backend", "redis", "-redis-addr", addr}, name, inspectCounter(t, a, name))
	// The same lock through -redis-url.
	if code, out := fenceCmd("inspect", "-backend", "redis", "-redis-url", "redis://"+addr+"/0", name); code != 0 || !strings.Contains(out, fmt.Sprintf("counter:   %d", bumpTo)) {
		t.Errorf("inspect -redis-url: exit %d\n%s", code, out)
	}
}

func TestOperatorEtcd(t *testing.T) {
	cluster := etcdtest.Start(t, 1)
	a, err := etcdfence.NewAcquirer(cluster.Client(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	name := uniqueName(t)
	l, err := a.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Release(context.Background()) })
	eps := strings.Join(cluster.Endpoints(), ",")
	code, out := fenceCmd("inspect", "-backend", "etcd", "-etcd-endpoints", eps, name)
	if want := fmt.Sprintf("held:      yes, token %d", l.Token()); code != 0 || !strings.Contains(out, want) {
		t.Errorf("inspect of a held etcd lock: exit %d, want %q\n%s", code, want, out)
	}
	if code, out := fenceCmd("bump", "-backend", "etcd", "-etcd-endpoints", eps, name, "-to", "5"); code != 1 || !strings.Contains(out, "no counter to bump") {
		t.Errorf("bump on etcd: exit %d\n%s", code, out)
	}
}

func TestOperatorEtcdUnreachable(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for the etcd client's 5s deadline; skipped with -short")
	}
	eps := "http://127.0.0.1:1,127.0.0.1:2"
	code, out := fenceCmd("inspect", "-backend", "etcd", "-etcd-endpoints", eps, "job")
	for _, want := range []string{"http://127.0.0.1:1: TCP connect failed", "127.0.0.1:2: TCP connect failed", "connection refused", "no endpoint answered"} {
		if code != 1 || !strings.Contains(out, want) {
			t.Errorf("inspect on unreachable etcd: exit %d, want %q\n%s", code, want, out)
		}
	}
}

// heldS3Lock starts a gofakes3 server with a bucket "locks", sets the AWS
// credentials the fence command reads, and holds the lock "job" there until
// the test ends.
func heldS3Lock(t *testing.T) (*httptest.Server, fence.Lease) {
	t.Helper()
	srv := httptest.NewServer(gofakes3.New(s3mem.New()).Server())
	t.Cleanup(srv.Close)
	t.Setenv("AWS_ACCESS_KEY_ID", "operator")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "operator-secret")
	c := s3.New(s3.Options{Region: "us-east-1", BaseEndpoint: aws.String(srv.URL), UsePathStyle: true,
		Credentials: credentials.NewStaticCredentialsProvider("operator", "operator-secret", "")})
	ctx := context.Background()
	if _, err := c.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("locks")}); err != nil {
		t.Fatal(err)
	}
	a, err := s3fence.NewAcquirer(c, "locks", nil)
	if err != nil {
		t.Fatal(err)
	}
	l := holdJob(t, a)
	return srv, l
}

func TestOperatorS3(t *testing.T) {
	srv, l := heldS3Lock(t)
	flags := []string{"-backend", "s3", "-s3-endpoint", srv.URL, "-s3-bucket", "locks"}
	code, out := fenceCmd(append(append([]string{"inspect"}, flags...), "job")...)
	if want := fmt.Sprintf("held:      yes, token %d", l.Token()); code != 0 || !strings.Contains(out, want) || !strings.Contains(out, srv.URL) {
		t.Errorf("inspect of a held S3 lock: exit %d, want %q and the endpoint\n%s", code, want, out)
	}
	if code, out := fenceCmd(append(append([]string{"bump"}, flags...), "job", "-to", "50")...); code != 1 || !strings.Contains(out, "no counter to bump") {
		t.Errorf("bump on S3: exit %d\n%s", code, out)
	}
	if code, out := fenceCmd("inspect", "-backend", "s3", "-s3-endpoint", srv.URL, "-s3-bucket", "no-such-bucket", "job"); code != 1 || !strings.Contains(out, `s3 bucket "no-such-bucket"`) {
		t.Errorf("inspect of a missing bucket: exit %d\n%s", code, out)
	}
}

// TestOperatorLeavesSQLiteFileAlone: inspect and bump on an operator's SQLite
// file change nothing but the counter bump raises: an empty file stays empty
// (it is not made a database), a database in rollback-journal mode stays in
// it (not switched to WAL), and a directory is a usage error.
func TestOperatorLeavesSQLiteFileAlone(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.db")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"inspect", "-db", empty, "job"}, {"bump", "-db", empty, "job", "-to", "5"}} {
		if code, out := fenceCmd(args...); code != 1 || !strings.Contains(out, "fence_leases") {
			t.Errorf("fence %q on an empty file: exit %d\n%s", args, code, out)
		}
	}
	if fi, err := os.Stat(empty); err != nil || fi.Size() != 0 {
		t.Errorf("inspect and bump wrote to an empty file: %v, %d bytes", err, fi.Size())
	}

	journal := filepath.Join(dir, "journal.db")
	db, err := sql.Open("sqlite", journal)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1)
	a := sqlTables(t, sqlfence.SQLite(db))
	mode := func() string {
		var m string
		if err := db.QueryRow("PRAGMA journal_mode").Scan(&m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	if m := mode(); m != "delete" {
		t.Fatalf("journal mode %q before the commands, want delete", m)
	}
	checkBump(t, []string{"-db", journal}, "job", inspectCounter(t, a, "job"))
	if m := mode(); m != "delete" {
		t.Errorf("inspect and bump switched the operator's database to journal mode %q", m)
	}

	for _, args := range [][]string{{"inspect", "-db", dir, "job"}, {"bump", "-db", dir, "job", "-to", "5"}} {
		if code, out := fenceCmd(args...); code != 2 || !strings.Contains(out, "is a directory") {
			t.Errorf("fence %q on a directory: exit %d, want 2\n%s", args, code, out)
		}
	}
}

// TestOperatorS3EndpointFromEnvironment: without -s3-endpoint, the endpoint
// the AWS environment names (AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, as
// the AWS CLI and SDKs read them) is the one inspected, not AWS.
func TestOperatorS3EndpointFromEnvironment(t *testing.T) {
	srv, l := heldS3Lock(t)
	for _, env := range []string{"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"} {
		t.Run(env, func(t *testing.T) {
			t.Setenv("AWS_ENDPOINT_URL_S3", "")
			t.Setenv("AWS_ENDPOINT_URL", "")
			t.Setenv(env, srv.URL)
			code, out := fenceCmd("inspect", "-backend", "s3", "-s3-bucket", "locks", "job")
			if want := fmt.Sprintf("held:      yes, token %d", l.Token()); code != 0 || !strings.Contains(out, want) || !strings.Contains(out, srv.URL) {
				t.Errorf("inspect with %s=%s: exit %d, want %q and the endpoint\n%s", env, srv.URL, code, want, out)
			}
		})
	}
}

// TestOperatorNATS: inspect on a named NATS server shows a held lock's token
// and a protected key's; bump refuses (tokens are revisions); a lock bucket
// that does not exist is an error, never created.
func TestOperatorNATS(t *testing.T) {
	srv, err := natstest.Start(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	j, err := jetstream.New(natstest.Connect(t, srv.ClientURL()))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, cfg := range []jetstream.KeyValueConfig{natsfence.LockBucket("ops_locks"), {Bucket: "ops_data"}} {
		if _, err := j.CreateKeyValue(ctx, cfg); err != nil {
			t.Fatal(err)
		}
	}
	a, err := natsfence.NewAcquirer(ctx, j, "ops_locks", nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := natsfence.NewWriter(ctx, j, "ops_data", nil)
	if err != nil {
		t.Fatal(err)
	}
	name := uniqueName(t)
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Release(context.Background()) })
	if err := w.Write(ctx, "k", []byte("v"), l.Token()); err != nil {
		t.Fatal(err)
	}
	flags := []string{"-backend", "nats", "-nats-url", srv.ClientURL(), "-nats-bucket", "ops_locks"}
	code, out := fenceCmd(append(append([]string{"inspect"}, flags...), "-nats-data-bucket", "ops_data", "-key", "k", name)...)
	if want := fmt.Sprintf("held:      yes, token %d", l.Token()); code != 0 || !strings.Contains(out, want) || !strings.Contains(out, fmt.Sprintf(`key "k": token %d`, l.Token())) {
		t.Errorf("inspect of a held NATS lock: exit %d, want %q and the key's token\n%s", code, want, out)
	}
	if code, out := fenceCmd(append(append([]string{"bump"}, flags...), name, "-to", "5")...); code != 1 || !strings.Contains(out, "no counter to bump") {
		t.Errorf("bump on NATS: exit %d\n%s", code, out)
	}
	if code, out := fenceCmd("inspect", "-backend", "nats", "-nats-url", srv.ClientURL(), "-nats-bucket", "ops_missing", name); code != 1 || !strings.Contains(out, "ops_missing") {
		t.Errorf("inspect on a missing bucket: exit %d\n%s", code, out)
	}
	if _, err := j.KeyValue(ctx, "ops_missing"); !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Errorf("inspect created the bucket it was refused: %v", err)
	}
}

func TestOperatorGCS(t *testing.T) {
	srv, err := fakestorage.NewServerWithOptions(fakestorage.Options{Scheme: "http", Host: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	srv.CreateBucketWithOpts(fakestorage.CreateBucketOpts{Name: "locks"})
	ctx := context.Background()
	c, err := storage.NewClient(ctx, option.WithEndpoint(srv.URL()+"/storage/v1/"), option.WithoutAuthentication(), storage.WithJSONReads())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	a, err := gcsfence.NewAcquirer(c.Bucket("locks"), nil)
	if err != nil {
		t.Fatal(err)
	}
	l := holdJob(t, a)
	flags := []string{"-backend", "gcs", "-gcs-endpoint", srv.URL() + "/storage/v1/", "-gcs-bucket", "locks"}
	code, out := fenceCmd(append(append([]string{"inspect"}, flags...), "job")...)
	if want := fmt.Sprintf("held:      yes, token %d", l.Token()); code != 0 || !strings.Contains(out, want) {
		t.Errorf("inspect of a held GCS lock: exit %d, want %q\n%s", code, want, out)
	}
	if code, out := fenceCmd(append(append([]string{"bump"}, flags...), "job", "-to", "50")...); code != 1 || !strings.Contains(out, "no counter to bump") {
		t.Errorf("bump on GCS: exit %d\n%s", code, out)
	}
}
