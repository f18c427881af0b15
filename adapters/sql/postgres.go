package sqlfence

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

var postgresDialect = &dialect{
	name:  "postgres",
	nowMs: "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
	nowUs: "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint", greatest: "greatest",
	textType: "TEXT", blobType: "BYTEA", intType: "BIGINT", keyType: "TEXT", quoteChar: `"`,
	missingTable:        func(err error) bool { return pgCode(err) == "42P01" },
	checkViolation:      func(err error) bool { return pgCode(err) == "23514" },
	serializationFailed: func(err error) bool { c := pgCode(err); return c == "40001" || c == "40P01" },
}

// pgDurable, in the WHERE clause of a PostgreSQL statement's outer SELECT
// over the rows it changed, makes its commit wait for the WAL to reach the
// local disk even on a server or session whose synchronous_commit is off: the
// statements that hand out a token (grant, bump) or extend a lease (renew)
// must not be lost in a crash after the holder was told, or a token would be
// handed out twice, or a lease granted to another while its holder still
// holds it. off becomes local, not on: on would also wait for a synchronous
// standby, which the operator chose not to wait for. Every other setting is
// kept as it is. set_config with is_local true lasts to the end of the
// transaction: the statement's own, or the caller's when the statement runs
// inside the caller's transaction (whose commit then waits for the disk too).
// It is only evaluated when the statement changed a row (a statement that
// changed nothing commits nothing).
const pgDurable = "set_config('synchronous_commit', CASE current_setting('synchronous_commit') WHEN 'off' THEN 'local' ELSE current_setting('synchronous_commit') END, true) IS NOT NULL"

// pgNoFlushUpToClock replaces pgDurable in an AsyncGrants grant: the commit
// does not wait for the disk when the granted token is at or below the
// server's clock in microseconds, read here (later than where the token was
// set); otherwise it is pgDurable's.
var pgNoFlushUpToClock = "set_config('synchronous_commit', CASE WHEN token <= " + postgresDialect.nowUs + " THEN 'off' " +
	"WHEN current_setting('synchronous_commit') = 'off' THEN 'local' ELSE current_setting('synchronous_commit') END, true) IS NOT NULL"

// pgDurableChange wraps q, a PostgreSQL INSERT or UPDATE whose caller counts
// the rows it changed, so that its commit waits for the disk (pgDurable); the
// count is that of the outer SELECT, the same.
func pgDurableChange(q string) string {
	return "WITH c AS (" + q + " RETURNING 1) SELECT 1 FROM c WHERE " + pgDurable
}

// pgNoFlush makes a release's commit return without waiting for the WAL to
// reach the disk (or a synchronous standby). A release lost in a crash
// leaves the lease held on the server until its ttl, as an unanswered
// release does, and changes no token; any later grant's commit flushes the
// WAL up to itself, so a grant that followed the release never survives a
// crash without it. It is only used where the statement is its own
// transaction (see DB.autocommit): inside a caller's transaction the release
// sets nothing, and the caller's commit keeps its own durability.
const pgNoFlush = "set_config('synchronous_commit', 'off', true) IS NOT NULL"

func pgCode(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// IsSerializationFailure reports whether err is a PostgreSQL serialization
// failure (40001) or deadlock (40P01): the transaction did nothing and may be
// run again from the start.
func IsSerializationFailure(err error) bool { return postgresDialect.serializationFailed(err) }

// PgxQuerier is what *pgxpool.Pool, *pgx.Conn and pgx.Tx share.
type PgxQuerier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Pgx wraps a native pgx handle on PostgreSQL: a *pgxpool.Pool (recommended:
// waiters then wake on LISTEN/NOTIFY), a *pgx.Conn, or a pgx.Tx (every statement
// then runs inside that transaction).
//
// On a pool, while any Acquire waits, the *DB listens on one connection of
// its own, opened with the pool's configuration outside the pool (one more
// server session per *DB, not counted in MaxConns): waiting never takes a
// pool connection from a holder's Renew or Release or a Write, whatever the
// pool's size. A statement whose context ends while it waits for a pool
// connection was not sent, and its error is the context's, never
// fence.ErrUnknown.
//
// A nil q gives a *DB whose every use returns an error matching fence.ErrInvalid.
func Pgx(q PgxQuerier) *DB {
	db := &DB{c: pgxConn{q}, d: postgresDialect, nilHandle: isNilPgx(q)}
	if db.nilHandle {
		return db
	}
	switch h := q.(type) {
	case *pgxpool.Pool:
		db.ownTx = func() bool { return true }
	case *pgx.Conn:
		// Outside a transaction block each statement is its own transaction.
		db.ownTx = func() bool { return h.PgConn().TxStatus() == 'I' }
	}
	if p, ok := q.(*pgxpool.Pool); ok {
		db.listen = newListener(poolConn(p))
	}
	return db
}

// Postgres wraps a database/sql handle on PostgreSQL opened with the "pgx" driver
// of github.com/jackc/pgx/v5/stdlib. Waiters wake on LISTEN/NOTIFY, on one
// connection of the *DB's own opened with the configuration of db's
// connections, outside db's pool (not counted in SetMaxOpenConns), as [Pgx]
// does on a pool.
//
// A nil db gives a *DB whose every use returns an error matching fence.ErrInvalid.
func Postgres(db *sql.DB) *DB {
	if db == nil {
		return &DB{d: postgresDialect, nilHandle: true}
	}
	return &DB{c: stdConn{q: db}, d: postgresDialect, listen: newListener(stdlibConn(db)), ownTx: func() bool { return true }}
}

// isNilPgx reports a nil handle, also one of the pgx types in an interface.
func isNilPgx(q PgxQuerier) bool {
	switch h := q.(type) {
	case nil:
		return true
	case *pgxpool.Pool:
		return h == nil
	case *pgx.Conn:
		return h == nil
	}
	return false
}

type pgxConn struct{ q PgxQuerier }

// onPoolConn runs f on a connection acquired from pool for it, so that a
// failure to acquire one is known to have sent nothing (notSentError).
func onPoolConn(ctx context.Context, pool *pgxpool.Pool, f func(pgxConn) error) error {
	c, err := pool.Acquire(ctx)
	if err != nil {
		return &notSentError{err}
	}
	defer c.Release()
	return f(pgxConn{c})
}

func (p pgxConn) exec(ctx context.Context, q string, args ...any) (int64, error) {
	if pool, ok := p.q.(*pgxpool.Pool); ok {
		var n int64
		err := onPoolConn(ctx, pool, func(c pgxConn) (err error) {
			n, err = c.exec(ctx, q, args...)
			return err
		})
		return n, err
	}
	tag, err := p.q.Exec(ctx, q, args...)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

func (p pgxConn) queryRow(ctx context.Context, q string, args []any, dest ...any) error {
	if pool, ok := p.q.(*pgxpool.Pool); ok {
		return onPoolConn(ctx, pool, func(c pgxConn) error { return c.queryRow(ctx, q, args, dest...) })
	}
	err := p.q.QueryRow(ctx, q, args...).Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return errNoRows
	}
	return err
}
