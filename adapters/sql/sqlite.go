package sqlfence

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/fencekit/fencekit/fence"

	"modernc.org/sqlite" // registers the "sqlite" driver
)

// sqliteUnixUs is an SQL expression for this host's clock in microseconds
// since the Unix epoch on SQLite, whose own clock counts milliseconds. It
// calls a function of this package's, registered with the driver, so the
// clock is read while the statement runs, after it took SQLite's write lock:
// a reading taken before (when the call was made, then a wait for a pool
// connection or for the write lock) could be older than a row that another
// connection created and that was deleted meanwhile.
const sqliteUnixUs = "fencekit_unix_us()"

func init() {
	sqlite.MustRegisterScalarFunction("fencekit_unix_us", 0, func(*sqlite.FunctionContext, []driver.Value) (driver.Value, error) {
		return time.Now().UnixMicro(), nil
	})
}

// OpenSQLite opens (creating it if needed) the SQLite database file at path with
// the settings that make leases and fences safe across processes on one machine:
// WAL journal, synchronous=NORMAL, a 10s busy timeout (opening waits up to a
// minute more for a file that stays locked), and IMMEDIATE transactions,
// so that a transaction takes the write lock when it begins instead of failing
// to upgrade a read lock later.
func OpenSQLite(path string) (*sql.DB, error) {
	if path == "" {
		return nil, fmt.Errorf("sqlfence: open sqlite: empty path")
	}
	if strings.ContainsAny(path, "?#") {
		return nil, fmt.Errorf("sqlfence: open sqlite %q: the path may not contain ? or #", path)
	}
	q := url.Values{}
	q.Add("_pragma", "busy_timeout(10000)")
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous(NORMAL)")
	q.Set("_txlock", "immediate")
	db, err := sql.Open("sqlite", "file:"+path+"?"+q.Encode())
	if err != nil {
		return nil, fmt.Errorf("sqlfence: open sqlite %s: %w", path, err)
	}
	// A connection's first statements (the pragmas above) wait out another
	// connection's write lock for the busy timeout; a file that many
	// processes write can keep one waiting longer (a test sharing one file
	// among 30 handles on a loaded machine did). Opening tries again for
	// openBusyFor, since nothing was done yet.
	deadline := time.Now().Add(openBusyFor)
	for attempt := 0; ; attempt++ {
		err := db.Ping()
		if err == nil {
			return db, nil
		}
		if !isSQLiteBusy(err) || time.Now().After(deadline) {
			db.Close()
			return nil, fmt.Errorf("sqlfence: open sqlite %s: %w", path, err)
		}
		_ = (fence.Backoff{Min: 10 * time.Millisecond, Max: 500 * time.Millisecond}).Sleep(context.Background(), attempt)
	}
}

// isSQLiteBusy reports an SQLITE_BUSY error (any extended code): the file's
// lock stayed taken past the busy timeout, or the call's context ended while
// it waited; the statement did nothing.
func isSQLiteBusy(err error) bool {
	var se *sqlite.Error
	return errors.As(err, &se) && se.Code()&0xff == sqliteBusy
}

// sqliteBusy is SQLite's primary result code SQLITE_BUSY.
const sqliteBusy = 5

// openBusyFor is how long OpenSQLite keeps trying after its first
// connection's pragmas found the file locked past the busy timeout.
const openBusyFor = time.Minute
