package sqlfence

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// DB is a database handle with its dialect. Build one with [SQLite] or [Postgres].
// A DB is safe for concurrent use when its handle is.
type DB struct {
	c      conn
	d      *dialect
	listen *listener // PostgreSQL release notifications; nil where unsupported
	sqlDB  *sql.DB   // for SQLite transactions
	// nilHandle: built on a nil handle; every use returns ErrInvalid.
	nilHandle bool
	// ownTx reports whether a statement run now is its own transaction (a
	// pool, a *sql.DB, a *pgx.Conn outside a transaction block); nil: never
	// known (a caller's transaction).
	ownTx func() bool
}

// autocommit reports whether a statement run now commits on its own, so
// that it may set its own commit's durability (see pgNoFlush).
func (db *DB) autocommit() bool { return db.ownTx != nil && db.ownTx() }

// SQLite wraps a database/sql handle opened with the "sqlite" driver of
// modernc.org/sqlite (see [OpenSQLite]).
// A nil db gives a *DB whose every use returns an error matching fence.ErrInvalid.
func SQLite(db *sql.DB) *DB {
	return &DB{c: stdConn{q: db}, d: sqliteDialect, sqlDB: db, nilHandle: db == nil}
}

// Dialect returns "sqlite", "postgres" or "mysql".
func (db *DB) Dialect() string { return db.d.name }

// conn is the one small interface the package's SQL runs through, so that each
// statement is written once for every driver style.
type conn interface {
	exec(ctx context.Context, q string, args ...any) (rowsAffected int64, err error)
	// queryRow scans one row into dest; no row returns errNoRows.
	queryRow(ctx context.Context, q string, args []any, dest ...any) error
}

var errNoRows = errors.New("sqlfence: no rows")

// maxStatementRetries bounds how often one of the package's own statements is
// run again after a serialization failure or deadlock (possible when the
// server's default isolation level is REPEATABLE READ or SERIALIZABLE). Such a
// statement had no effect, so running it again is safe.
const maxStatementRetries = 8

// exec runs one of the package's own statements, retrying serialization failures.
func (db *DB) exec(ctx context.Context, q string, args ...any) (int64, error) {
	for i := 0; ; i++ {
		n, err := db.c.exec(ctx, q, args...)
		if err == nil || i == maxStatementRetries || !db.d.serializationFailed(err) || !retryPause(ctx, i) {
			return n, err
		}
	}
}

// queryRow runs one of the package's own statements, retrying serialization failures.
func (db *DB) queryRow(ctx context.Context, q string, args []any, dest ...any) error {
	for i := 0; ; i++ {
		err := db.c.queryRow(ctx, q, args, dest...)
		if err == nil || i == maxStatementRetries || !db.d.serializationFailed(err) || !retryPause(ctx, i) {
			return err
		}
	}
}

// retryPause sleeps a short jittered while before retry i+1; false if ctx ended.
func retryPause(ctx context.Context, i int) bool {
	return fence.Backoff{Min: time.Millisecond, Max: 50 * time.Millisecond}.Sleep(ctx, i) == nil
}

// stdQuerier is what *sql.DB, *sql.Conn and *sql.Tx share.
type stdQuerier interface {
	ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row
}

// stdConn runs statements on a database/sql handle; inline (set on every
// MySQL handle) sends their arguments as literals in the statement, or as
// parameters that no character set converts (see mysqlInline).
type stdConn struct {
	q      stdQuerier
	inline bool
}

// on wraps q, a handle on db's database, as db's dialect needs.
func (db *DB) on(q stdQuerier) stdConn { return stdConn{q: q, inline: db.d == mysqlDialect} }

// notSentError is the error of a statement that never left the client: no
// connection could be had for it (the context ended while it waited for a
// free one, the pool was closed, a dial failed). It is definite (see
// ambiguous), and the cause stays in the chain.
type notSentError struct{ err error }

func (e *notSentError) Error() string {
	return "sqlfence: not sent (no connection for it): " + e.err.Error()
}

func (e *notSentError) Unwrap() error { return e.err }

// badConnTries bounds how often a statement on a *sql.DB is run again on
// another connection after the driver refused it unsent (driver.ErrBadConn),
// as database/sql itself would.
const badConnTries = 3

// onConn runs f on a connection taken from db for it, so that a failure to
// get one is known to have sent nothing (notSentError); database/sql's own
// methods report it as the bare context error that a statement cut short
// while it ran returns too.
func (s stdConn) onConn(ctx context.Context, db *sql.DB, f func(stdConn) error) error {
	for i := 0; ; i++ {
		c, err := db.Conn(ctx)
		if err != nil {
			return &notSentError{err}
		}
		err = f(stdConn{q: c, inline: s.inline})
		_ = c.Close()
		if !errors.Is(err, driver.ErrBadConn) || i+1 == badConnTries {
			return err
		}
	}
}

func (s stdConn) exec(ctx context.Context, q string, args ...any) (int64, error) {
	r, err := s.result(ctx, q, args)
	if err != nil {
		return 0, err
	}
	return r.RowsAffected()
}

// result runs q as an ExecContext (see runInline) and returns its result.
func (s stdConn) result(ctx context.Context, q string, args []any) (r sql.Result, err error) {
	if db, ok := s.q.(*sql.DB); ok {
		err = s.onConn(ctx, db, func(c stdConn) (err error) {
			r, err = c.result(ctx, q, args)
			return err
		})
		return r, err
	}
	err = runInline(s.inline, q, args, func(q string, args []any) (err error) {
		r, err = s.q.ExecContext(ctx, q, args...)
		return err
	})
	return r, err
}

func (s stdConn) queryRow(ctx context.Context, q string, args []any, dest ...any) error {
	if db, ok := s.q.(*sql.DB); ok {
		return s.onConn(ctx, db, func(c stdConn) error { return c.queryRow(ctx, q, args, dest...) })
	}
	err := runInline(s.inline, q, args, func(q string, args []any) error {
		return s.q.QueryRowContext(ctx, q, args...).Scan(dest...)
	})
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
	nowMs string
	// nowUs is the server's clock in microseconds since the Unix epoch, read
	// when the statement runs (on SQLite, whose clock counts milliseconds,
	// this host's clock, see sqliteUnixUs); greatest is the two-argument maximum.
	nowUs, greatest    string
	textType, blobType string
	intType            string
	// keyType is the type of an indexed key or name column.
	keyType string
	// quoteChar quotes identifiers.
	quoteChar string
	// updateFirst: a fenced write tries a fenced UPDATE before the upsert. On
	// SQLite the upsert costs more than an UPDATE of an existing row; on
	// PostgreSQL it does not (BenchmarkPostgresWrite), so there every write is
	// one upsert statement.
	updateFirst         bool
	missingTable        func(error) bool
	checkViolation      func(error) bool
	serializationFailed func(error) bool
}

var sqliteDialect = &dialect{
	name:  "sqlite",
	nowMs: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
	nowUs: sqliteUnixUs, greatest: "max",
	textType: "TEXT", blobType: "BLOB", intType: "INTEGER", keyType: "TEXT", quoteChar: `"`,
	updateFirst:         true,
	missingTable:        func(err error) bool { return err != nil && strings.Contains(err.Error(), "no such table") },
	checkViolation:      func(err error) bool { return err != nil && strings.Contains(err.Error(), "CHECK constraint failed") },
	serializationFailed: func(error) bool { return false },
}

// TableError reports that a table sqlfence needs is missing, and says how to
// create it.
type TableError struct {
	// Table is the missing table's name, as it appears in the statements.
	Table string
	// DDL creates the table (what CreateTable runs), for an operator to run
	// instead.
	DDL string
	// Err is the database's own error.
	Err error
}

// Error names the table and gives its DDL.
func (e *TableError) Error() string {
	return fmt.Sprintf("sqlfence: table %s does not exist; create it with CreateTable or run:\n%s\n(cause: %v)", e.Table, e.DDL, e.Err)
}

// Unwrap returns the driver's error.
func (e *TableError) Unwrap() error { return e.Err }

// inTx runs f in a transaction on a database/sql handle (SQLite), committing when
// f returns nil.
func (db *DB) inTx(ctx context.Context, f func(conn) error) error {
	if db.sqlDB == nil {
		return fmt.Errorf("sqlfence: this handle cannot begin transactions")
	}
	tx, err := db.sqlDB.BeginTx(ctx, nil)
	if err != nil {
		return &notSentError{err} // no statement of f's was sent
	}
	if err := f(db.on(tx)); err != nil {
		return errors.Join(err, tx.Rollback())
	}
	return tx.Commit()
}

// createTable runs a CREATE TABLE IF NOT EXISTS. Two sessions running it at the
// same moment on PostgreSQL can collide in the catalog (23505, 42P07) even with
// IF NOT EXISTS; the loser runs it again and finds the table.
func (db *DB) createTable(ctx context.Context, ddl string) error {
	if err := db.checkCall("create table", ctx); err != nil {
		return err
	}
	_, err := db.exec(ctx, ddl)
	if c := pgCode(err); c == "23505" || c == "42P07" {
		_, err = db.exec(ctx, ddl)
	}
	return err
}
