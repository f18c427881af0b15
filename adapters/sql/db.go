package sqlfence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
)

// DB is a database handle with its dialect. Build one with [SQLite] or [Postgres].
// A DB is safe for concurrent use when its handle is.
type DB struct {
	c conn
	d *dialect
}

// SQLite wraps a database/sql handle opened with the "sqlite" driver of
// modernc.org/sqlite (see [OpenSQLite]).
func SQLite(db *sql.DB) *DB { return &DB{c: stdConn{db}, d: sqliteDialect} }

// Postgres wraps a database/sql handle on PostgreSQL (for example opened with the
// "pgx" driver of github.com/jackc/pgx/v5/stdlib).
func Postgres(db *sql.DB) *DB { return &DB{c: stdConn{db}, d: postgresDialect} }

// Dialect returns "sqlite" or "postgres".
func (db *DB) Dialect() string { return db.d.name }

// conn is the one small interface the package's SQL runs through, so that each
// statement is written once for every driver style.
type conn interface {
	exec(ctx context.Context, q string, args ...any) (rowsAffected int64, err error)
	// queryRow scans one row into dest; no row returns errNoRows.
	queryRow(ctx context.Context, q string, args []any, dest ...any) error
}

var errNoRows = errors.New("sqlfence: no rows")

// stdQuerier is what *sql.DB, *sql.Conn and *sql.Tx share.
type stdQuerier interface {
	ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row
}

type stdConn struct{ q stdQuerier }

func (s stdConn) exec(ctx context.Context, q string, args ...any) (int64, error) {
	r, err := s.q.ExecContext(ctx, q, args...)
	if err != nil {
		return 0, err
	}
	return r.RowsAffected()
}

func (s stdConn) queryRow(ctx context.Context, q string, args []any, dest ...any) error {
	err := s.q.QueryRowContext(ctx, q, args...).Scan(dest...)
	if errors.Is(err, sql.ErrNoRows) {
		return errNoRows
	}
	return err
}

// dialect holds what differs between databases. The statements themselves are
// shared: both SQLite and PostgreSQL take $1-style parameters, upserts with a
// WHERE on the update, and RETURNING.
type dialect struct {
	name string
	// nowMs is an SQL expression for the server's clock in milliseconds since
	// the Unix epoch; it is read when the statement runs.
	nowMs               string
	textType, blobType  string
	intType             string
	missingTable        func(error) bool
	checkViolation      func(error) bool
	serializationFailed func(error) bool
}

var sqliteDialect = &dialect{
	name:     "sqlite",
	nowMs:    "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
	textType: "TEXT", blobType: "BLOB", intType: "INTEGER",
	missingTable:        func(err error) bool { return err != nil && strings.Contains(err.Error(), "no such table") },
	checkViolation:      func(err error) bool { return err != nil && strings.Contains(err.Error(), "CHECK constraint failed") },
	serializationFailed: func(error) bool { return false },
}

// TableError reports that a table sqlfence needs is missing, and says how to
// create it.
type TableError struct {
	Table string
	DDL   string
	Err   error
}

func (e *TableError) Error() string {
	return fmt.Sprintf("sqlfence: table %s does not exist; create it with CreateTable or run:\n%s\n(cause: %v)", e.Table, e.DDL, e.Err)
}

// Unwrap returns the driver's error.
func (e *TableError) Unwrap() error { return e.Err }
