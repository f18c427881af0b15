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
// A nil q gives a *DB whose every use returns an error matching fence.ErrInvalid.
func Pgx(q PgxQuerier) *DB {
	db := &DB{c: pgxConn{q}, d: postgresDialect, nilHandle: isNilPgx(q)}
	if db.nilHandle {
		return db
	}
	if p, ok := q.(*pgxpool.Pool); ok {
		db.listen = newListener(func(ctx context.Context, f func(*pgx.Conn) error) error {
			return p.AcquireFunc(ctx, func(c *pgxpool.Conn) error { return f(c.Conn()) })
		})
	}
	return db
}

// Postgres wraps a database/sql handle on PostgreSQL opened with the "pgx" driver
// of github.com/jackc/pgx/v5/stdlib. Waiters wake on LISTEN/NOTIFY.
//
// A nil db gives a *DB whose every use returns an error matching fence.ErrInvalid.
func Postgres(db *sql.DB) *DB {
	if db == nil {
		return &DB{d: postgresDialect, nilHandle: true}
	}
	return &DB{c: stdConn{db}, d: postgresDialect, listen: newListener(stdlibConn(db))}
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

func (p pgxConn) exec(ctx context.Context, q string, args ...any) (int64, error) {
	tag, err := p.q.Exec(ctx, q, args...)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

func (p pgxConn) queryRow(ctx context.Context, q string, args []any, dest ...any) error {
	err := p.q.QueryRow(ctx, q, args...).Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return errNoRows
	}
	return err
}
