package sqlfence

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"

	"github.com/fencekit/fencekit/fence"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"modernc.org/sqlite"
)

// maxAmbiguousRetries bounds how often a lease step whose reply was lost is
// run again (after looking for its own applied change) before it reports
// fence.ErrUnknown. Acquire retries until its context ends.
const maxAmbiguousRetries = 4

// ambiguous reports whether err, returned for a statement, leaves open whether
// the server applied it: the request may have been sent and its reply lost
// (EOF, a reset or closed connection, a timeout or cancellation while it
// ran). An error the server sent (also a COMMIT answered with ROLLBACK,
// pgx.ErrTxCommitRollback), an SQLite error (the database is in the
// process), a statement that got no connection (notSentError: the context
// ended while it waited for one of the pool), and an error the driver
// reports for a request it did not send
// (driver.ErrBadConn, which database/sql retries on its own; pgconn's
// SafeToRetry; the MySQL driver's ErrPktTooLarge, checked before it writes
// the packet) are definite. With notSent false, the drivers' "not sent"
// signals are not trusted (for a commit, whose outcome the caller needs).
func ambiguous(err error, notSent bool) bool {
	if err == nil || errors.Is(err, errNoRows) || errors.Is(err, fence.ErrUnknown) {
		return false
	}
	var (
		pe *pgconn.PgError
		me *mysql.MySQLError
		se *sqlite.Error
		ie *fence.InvalidError
		ns *notSentError
	)
	if errors.As(err, &pe) || errors.As(err, &me) || errors.As(err, &se) || errors.As(err, &ie) || errors.As(err, &ns) ||
		errors.Is(err, sql.ErrTxDone) || errors.Is(err, pgx.ErrTxClosed) || errors.Is(err, pgx.ErrTxCommitRollback) || notConnected(err) {
		return false
	}
	return !notSent || !(errors.Is(err, driver.ErrBadConn) || errors.Is(err, mysql.ErrPktTooLarge) || pgconn.SafeToRetry(err))
}

// unknownIfAmbiguous wraps err in fence.ErrUnknown when the statement that
// returned it may have been applied (see ambiguous); the driver's error stays
// in the chain.
func unknownIfAmbiguous(err error, notSent bool) error {
	if !ambiguous(err, notSent) {
		return err
	}
	return fmt.Errorf("%w (the statement may have been applied): %w", fence.ErrUnknown, err)
}

// unknown is unknownIfAmbiguous for a statement of db's own, outside a
// transaction of the caller's. SQLite runs in the process: its own errors are
// definite, but the context's error, returned when the context ended while the
// statement ran, may come after the statement committed.
func (db *DB) unknown(err error) error {
	if db.d == sqliteDialect && !notSent(err) {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			// The driver reports the context's end even when the statement
			// committed before it noticed (the review's Bump, Release and
			// Begin rows showed their changes).
			return fmt.Errorf("%w (the context ended while SQLite ran the statement, which may have committed first): %w", fence.ErrUnknown, err)
		}
		return err
	}
	return unknownIfAmbiguous(err, true)
}

// ambiguous is ambiguous for a statement of db's own.
func (db *DB) ambiguous(err error) bool { return db.d != sqliteDialect && ambiguous(err, true) }

// notConnected reports an error of opening a connection (pgconn's
// ConnectError, or a refused or failed dial under the MySQL driver): no
// statement was sent on it.
func notConnected(err error) bool {
	var (
		ce *pgconn.ConnectError
		oe *net.OpError
	)
	return errors.As(err, &ce) || (errors.As(err, &oe) && oe.Op == "dial")
}

// notSent reports a statement that got no connection (notSentError).
func notSent(err error) bool {
	var ns *notSentError
	return errors.As(err, &ns)
}
