// Package testenv finds the servers that fencekit's tests run against. A missing
// server skips the test with a message that says how to start it, except when
// the CI environment variable is set: then the test fails.
package testenv

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// DefaultPostgresURL is used when FENCEKIT_POSTGRES_URL is not set.
const DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// DefaultRedisAddr is used when FENCEKIT_REDIS_ADDR is not set.
const DefaultRedisAddr = "127.0.0.1:6379"

// PostgresURL returns the URL of the test PostgreSQL server.
func PostgresURL() string {
	if u := os.Getenv("FENCEKIT_POSTGRES_URL"); u != "" {
		return u
	}
	return DefaultPostgresURL
}

// RedisAddr returns the address of the test Redis server.
func RedisAddr() string {
	if a := os.Getenv("FENCEKIT_REDIS_ADDR"); a != "" {
		return a
	}
	return DefaultRedisAddr
}

// Missing skips t (or fails it when CI is set) because a server is unreachable.
func Missing(t testing.TB, what string, err error) {
	t.Helper()
	SkipUnlessCI(t, what+" is not reachable ("+err.Error()+"); run scripts/test.sh, which starts it, or set the FENCEKIT_* address variables")
}

// SkipUnlessCI skips t with msg, or fails it with msg when CI is set: what a
// developer's machine may lack, or a run may not reach, CI must run.
func SkipUnlessCI(t testing.TB, msg string) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// Dial checks that addr accepts TCP connections.
func Dial(addr string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	return c.Close()
}

// PingPostgres checks that the PostgreSQL server at url accepts connections.
func PingPostgres(url string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	return c.Close(ctx)
}

// DefaultMySQLDSN is used when FENCEKIT_MYSQL_DSN is not set: the user that
// scripts/test.sh creates on the local MariaDB (or MySQL).
const DefaultMySQLDSN = "fencekit:fencekit@tcp(127.0.0.1:3306)/test"

// MySQLDSN returns the DSN (go-sql-driver/mysql format) of the test MySQL or
// MariaDB server.
func MySQLDSN() string {
	if d := os.Getenv("FENCEKIT_MYSQL_DSN"); d != "" {
		return d
	}
	return DefaultMySQLDSN
}
