package sqlfence

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// MaxKeyBytes is the longest key, lock name or idempotency key sqlfence
// accepts, in bytes, on every dialect. They are stored as indexed text, so they
// must also be valid UTF-8 without NUL bytes (PostgreSQL refuses both, and a
// btree index entry cannot exceed about 2.7 kB); SQLite gets the same rules, so
// that code moves between the two unchanged.
const MaxKeyBytes = 1024

// MaxTTL is the longest lease sqlfence grants: the largest time.Duration. The
// ttl is rounded up to whole milliseconds and added to the server's clock in a
// 64-bit column, which cannot overflow for any duration.
const MaxTTL = time.Duration(math.MaxInt64)

// checkText applies the text rules above to arg.
func checkText(op, arg, s string) error { return leasekit.CheckText(op, arg, s, MaxKeyBytes) }

// check refuses a nil *DB, or one built on a nil handle.
func (db *DB) check(op string) error {
	if db == nil || db.nilHandle {
		return &fence.InvalidError{Op: op, Arg: "db", Reason: "nil database handle"}
	}
	return nil
}

// checkCall is the first step of every method that takes a context: ctx must not
// be nil, and the handle must be usable. A context that already ended is
// reported as it is, before any statement: nothing was sent (the drivers'
// own context errors would read as a statement that may have been applied).
func (db *DB) checkCall(op string, ctx context.Context) error {
	if err := checkLive(op, ctx); err != nil {
		return err
	}
	return db.check(op)
}

// checkLive refuses a nil context, and returns the error of one that ended.
func checkLive(op string, ctx context.Context) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("sqlfence: %s: %w", op, err)
	}
	return nil
}
