package sqlfence_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// The peer on MySQL and MariaDB: GET_LOCK and RELEASE_LOCK on one
// connection, a named lock in the server's memory with no fencing token and
// no ttl of its own (it ends with the session).

// getLockName is the GET_LOCK name of these benchmarks. The peer's
// statements carry it as a literal, one round trip each (a parameter would
// make the driver prepare them first), as sqlfence's own statements do.
const getLockName = "fencekit-bench-peer"

// BenchmarkMySQLVsGetLock/uncontended interleaves an uncontended TryAcquire
// + Release with GET_LOCK + RELEASE_LOCK on a connection of the same pool
// (benchutil.Pair: subject fencekit, baseline GET_LOCK).
//
// /increments runs 8 workers x 25 locked increments of a counter row (a
// SELECT and an UPDATE under the lock) in this process, fencekit's workers
// sharing one Acquirer and the GET_LOCK workers a connection each, the two
// alternating over 5 rounds (each first in turn); it reports the medians and
// their ratio, and fails when a counter does not end exact.
//
// /handoff-getlock measures the time from the start of RELEASE_LOCK to the
// return of a GET_LOCK already waiting (seen in the process list), for
// BenchmarkMySQLHandoff's figure.
func BenchmarkMySQLVsGetLock(b *testing.B) {
	db, fdb := openMySQL(b, "")
	ctx := context.Background()
	a, err := sqlfence.NewAcquirer(fdb, nil)
	if err != nil {
		b.Fatal(err)
	}
	if err := a.CreateTable(ctx); err != nil {
		b.Fatal(err)
	}
	getLock := func(ctx context.Context, c *sql.Conn) (func() error, error) {
		var ok int
		if err := c.QueryRowContext(ctx, "SELECT GET_LOCK('"+getLockName+"', 60)").Scan(&ok); err != nil {
			return nil, err
		} else if ok != 1 {
			return nil, fmt.Errorf("GET_LOCK did not grant: %d", ok)
		}
		return func() error { _, err := c.ExecContext(ctx, "SELECT RELEASE_LOCK('"+getLockName+"')"); return err }, nil
	}
	b.Run("uncontended", func(b *testing.B) {
		name := fencetest.Name("uncontended")
		benchutil.Pair(b, func(int) error {
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				return err
			}
			return l.Release(ctx)
		}, func(int) error {
			c, err := db.Conn(ctx)
			if err != nil {
				return err
			}
			defer c.Close()
			unlock, err := getLock(ctx, c)
			if err != nil {
				return err
			}
			return unlock()
		})
	})
	b.Run("increments", func(b *testing.B) {
		workersDB, _ := openMySQL(b, "") // the workers' connections, apart from the acquirer's pool
		workersDB.SetMaxIdleConns(16)
		if _, err := workersDB.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS fence_bench_counter (name VARBINARY(200) PRIMARY KEY, v BIGINT NOT NULL)"); err != nil {
			b.Fatal(err)
		}
		const workers, each, rounds = 8, 25, 5
		var fk, gl []time.Duration
		for i := 0; i < b.N; i++ {
			for r := 0; r < rounds; r++ {
				for k := 0; k < 2; k++ {
					useFencekit := (r%2 == 0) == (k == 0)
					name := fencetest.Name("incr")
					if _, err := workersDB.ExecContext(ctx, "INSERT INTO fence_bench_counter VALUES (?, 0)", name); err != nil {
						b.Fatal(err)
					}
					lock := getLock
					if useFencekit {
						lock = func(ctx context.Context, _ *sql.Conn) (func() error, error) {
							l, err := a.Acquire(ctx, name, time.Minute)
							if err != nil {
								return nil, err
							}
							return func() error { return l.Release(ctx) }, nil
						}
					}
					d := mysqlLockedIncrements(b, workersDB, lock, name, workers, each)
					if useFencekit {
						fk = append(fk, d)
					} else {
						gl = append(gl, d)
					}
				}
			}
		}
		slices.Sort(fk)
		slices.Sort(gl)
		mf, mg := fk[len(fk)/2], gl[len(gl)/2]
		b.ReportMetric(float64(mf.Milliseconds()), "fencekit-ms")
		b.ReportMetric(float64(mg.Milliseconds()), "getlock-ms")
		b.ReportMetric(float64(mf)/float64(mg), "fencekit/getlock")
	})
	b.Run("handoff-getlock", func(b *testing.B) {
		holder, err := db.Conn(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer holder.Close()
		waiter, err := db.Conn(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer waiter.Close()
		var waiterID int64
		if err := waiter.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&waiterID); err != nil {
			b.Fatal(err)
		}
		handoffs := make([]time.Duration, 0, b.N)
		for i := 0; i < b.N; i++ {
			unlock, err := getLock(ctx, holder)
			if err != nil {
				b.Fatal(err)
			}
			granted := make(chan time.Time, 1)
			go func() {
				wunlock, err := getLock(ctx, waiter)
				if err != nil {
					b.Error(err)
					granted <- time.Time{}
					return
				}
				at := time.Now()
				if err := wunlock(); err != nil {
					b.Error(err)
				}
				granted <- at
			}()
			for {
				var n int
				if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND INFO LIKE 'SELECT GET_LOCK%'", waiterID).Scan(&n); err != nil {
					b.Fatal(err)
				}
				if n > 0 {
					break
				}
			}
			time.Sleep(time.Duration(i%20) * time.Millisecond) // the workload's shape, as benchutil.Handoff
			start := time.Now()
			if err := unlock(); err != nil {
				b.Fatal(err)
			}
			at := <-granted
			if at.IsZero() {
				b.FailNow()
			}
			handoffs = append(handoffs, at.Sub(start))
		}
		slices.Sort(handoffs)
		b.ReportMetric(float64(handoffs[len(handoffs)/2].Microseconds()), "p50-µs")
		b.ReportMetric(float64(handoffs[len(handoffs)*9/10].Microseconds()), "p90-µs")
	})
}

// mysqlLockedIncrements is pgLockedIncrements on MySQL.
func mysqlLockedIncrements(b *testing.B, db *sql.DB, lock func(context.Context, *sql.Conn) (func() error, error), name string, workers, each int) time.Duration {
	return lockedIncrements(b, workers, each, func(ctx context.Context) error {
		c, err := db.Conn(ctx)
		if err != nil {
			return err
		}
		defer c.Close()
		for range each {
			unlock, err := lock(ctx, c)
			if err != nil {
				return err
			}
			var v int64
			if err := c.QueryRowContext(ctx, "SELECT v FROM fence_bench_counter WHERE name = ?", name).Scan(&v); err != nil {
				return err
			}
			if _, err := c.ExecContext(ctx, "UPDATE fence_bench_counter SET v = ? WHERE name = ?", v+1, name); err != nil {
				return err
			}
			if err := unlock(); err != nil {
				return err
			}
		}
		return nil
	}, func(ctx context.Context) (v int64, err error) {
		err = db.QueryRowContext(ctx, "SELECT v FROM fence_bench_counter WHERE name = ?", name).Scan(&v)
		return v, err
	})
}
