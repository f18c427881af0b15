package sqlfence

import (
	"database/sql"
	"database/sql/driver"
	"fmt"
	"net/url"
	"strings"
	"time"

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
// WAL journal, synchronous=NORMAL, a 10s busy timeout, and IMMEDIATE transactions,
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
	if err := db.Ping(); err != nil {
		db.Close()
		return nil, fmt.Errorf("sqlfence: open sqlite %s: %w", path, err)
	}
	return db, nil
}
