package sqlfence_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The peer on PostgreSQL: a session advisory lock (pg_advisory_lock and
// pg_advisory_unlock on one connection), which lives in the server's memory,
// gives no fencing token and no ttl of its own (it ends with the session).
// These benchmarks run on the server's own synchronous_commit (on by
// default), as a user's would: the grant's commit waits for the disk, the
// release's does not (see Acquirer).

// advisoryKey is the advisory lock's key in these benchmarks.
const advisoryKey = 7_100_031

// BenchmarkPostgresVsAdvisory/uncontended interleaves an uncontended
// TryAcquire + Release with pg_advisory_lock + pg_advisory_unlock on a
// connection taken from the same pool (benchutil.Pair: subject fencekit,
// baseline the advisory lock); /uncontended-async-grants does the same with
// AsyncGrants.
//
// /increments runs 8 workers x 25 locked increments of a counter row (a
// SELECT and an UPDATE under the lock) in this process, fencekit's workers
// sharing one Acquirer (default, and AsyncGrants) and the advisory workers a
// connection each, the three in turn over 5 rounds, each first in turn; it
// reports each one's median and the ratios to the advisory lock, and fails
// when a counter does not end exact.
//
// /handoff-fencekit and /handoff-advisory measure the time from the start of
// a release to the grant of a waiter already waiting (p50, p90).
func BenchmarkPostgresVsAdvisory(b *testing.B) {
	p := pgPool(b, pgOpts{})
	ctx := context.Background()
	a, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), nil)
	if err != nil {
		b.Fatal(err)
	}
	if err := a.CreateTable(ctx); err != nil {
		b.Fatal(err)
	}
	async, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AsyncGrants: true})
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name string
		a    *sqlfence.Acquirer
	}{{"uncontended", a}, {"uncontended-async-grants", async}} {
		b.Run(c.name, func(b *testing.B) {
			name := fencetest.Name("uncontended")
			benchutil.Pair(b, func(int) error {
				l, err := c.a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					return err
				}
				return l.Release(ctx)
			}, func(int) error {
				return p.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
					if _, err := c.Exec(ctx, "SELECT pg_advisory_lock($1)", advisoryKey); err != nil {
						return err
					}
					_, err := c.Exec(ctx, "SELECT pg_advisory_unlock($1)", advisoryKey)
					return err
				})
			})
		})
	}
	b.Run("increments", func(b *testing.B) {
		// The workers' connections, one each for the run, from a pool of
		// their own: fencekit's acquirer keeps its pool to itself, as a user's
		// would when its workers hold connections.
		cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
		if err != nil {
			b.Fatal(err)
		}
		cfg.MaxConns = 16
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer p.Close()
		if _, err := p.Exec(ctx, "CREATE TABLE IF NOT EXISTS fence_bench_counter (name TEXT PRIMARY KEY, v BIGINT NOT NULL)"); err != nil {
			b.Fatal(err)
		}
		fencekit := func(a *sqlfence.Acquirer) func(string) lockFunc {
			return func(name string) lockFunc {
				return func(ctx context.Context, _ *pgxpool.Conn) (func() error, error) {
					l, err := a.Acquire(ctx, name, time.Minute)
					if err != nil {
						return nil, err
					}
					return func() error { return l.Release(ctx) }, nil
				}
			}
		}
		contenders := []struct {
			name string
			lock func(name string) lockFunc
		}{
			{"fencekit", fencekit(a)},
			{"async-grants", fencekit(async)},
			{"advisory", func(string) lockFunc {
				return func(ctx context.Context, c *pgxpool.Conn) (func() error, error) {
					if _, err := c.Exec(ctx, "SELECT pg_advisory_lock($1)", advisoryKey); err != nil {
						return nil, err
					}
					return func() error { _, err := c.Exec(ctx, "SELECT pg_advisory_unlock($1)", advisoryKey); return err }, nil
				}
			}},
		}
		const workers, each, rounds = 8, 25, 5
		times := make([][]time.Duration, len(contenders))
		for i := 0; i < b.N; i++ {
			for r := 0; r < rounds; r++ {
				for k := range contenders {
					j := (k + r) % len(contenders) // each contender first in turn
					name := fencetest.Name("incr")
					if _, err := p.Exec(ctx, "INSERT INTO fence_bench_counter VALUES ($1, 0)", name); err != nil {
						b.Fatal(err)
					}
					times[j] = append(times[j], pgLockedIncrements(b, p, contenders[j].lock(name), name, workers, each))
				}
			}
		}
		med := make([]time.Duration, len(contenders))
		for j, c := range contenders {
			slices.Sort(times[j])
			med[j] = times[j][len(times[j])/2]
			b.ReportMetric(float64(med[j].Milliseconds()), c.name+"-ms")
		}
		b.ReportMetric(float64(med[0])/float64(med[2]), "fencekit/advisory")
		b.ReportMetric(float64(med[1])/float64(med[2]), "async-grants/advisory")
	})
	b.Run("handoff-fencekit", func(b *testing.B) {
		benchutil.Handoff(b, a, a, fencetest.Name("handoff"))
	})
	b.Run("handoff-advisory", func(b *testing.B) {
		advisoryHandoff(b, p)
	})
}

// lockFunc takes a lock for a worker holding connection c, and returns its unlock.
type lockFunc func(ctx context.Context, c *pgxpool.Conn) (unlock func() error, err error)

// pgLockedIncrements runs workers x each increments of name's counter row,
// each under lock (given a connection of the worker's own, which the
// increment's statements also use), and returns the wall time; it fails
// unless the counter ends at workers x each.
func pgLockedIncrements(b *testing.B, p *pgxpool.Pool, lock lockFunc, name string, workers, each int) time.Duration {
	return lockedIncrements(b, workers, each, func(ctx context.Context) error {
		return p.AcquireFunc(ctx, func(c *pgxpool.Conn) error {
			for range each {
				unlock, err := lock(ctx, c)
				if err != nil {
					return err
				}
				var v int64
				if err := c.QueryRow(ctx, "SELECT v FROM fence_bench_counter WHERE name = $1", name).Scan(&v); err != nil {
					return err
				}
				if _, err := c.Exec(ctx, "UPDATE fence_bench_counter SET v = $1 WHERE name = $2", v+1, name); err != nil {
					return err
				}
				if err := unlock(); err != nil {
					return err
				}
			}
			return nil
		})
	}, func(ctx context.Context) (v int64, err error) {
		err = p.QueryRow(ctx, "SELECT v FROM fence_bench_counter WHERE name = $1", name).Scan(&v)
		return v, err
	})
}

// lockedIncrements runs worker (each's increments under the lock) in workers
// goroutines at once and returns the wall time; it fails on a worker's error
// and unless read gives workers x each afterwards.
func lockedIncrements(b *testing.B, workers, each int, worker func(context.Context) error, read func(context.Context) (int64, error)) time.Duration {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- worker(ctx)
		}()
	}
	wg.Wait()
	d := time.Since(start)
	close(errs)
	for err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	v, err := read(ctx)
	if err != nil {
		b.Fatal(err)
	}
	if v != int64(workers*each) {
		b.Fatalf("the counter is %d after %d locked increments", v, workers*each)
	}
	return d
}

// advisoryHandoff is benchutil.Handoff for the advisory lock: the release
// starts once the waiter's pg_advisory_lock is seen waiting in pg_locks, then
// 0-19ms later (the same shape).
func advisoryHandoff(b *testing.B, p *pgxpool.Pool) {
	ctx := context.Background()
	holder, err := p.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer holder.Release()
	waiter, err := p.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer waiter.Release()
	handoffs := make([]time.Duration, 0, b.N)
	for i := 0; i < b.N; i++ {
		if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock($1)", advisoryKey); err != nil {
			b.Fatal(err)
		}
		granted := make(chan time.Time, 1)
		go func() {
			if _, err := waiter.Exec(ctx, "SELECT pg_advisory_lock($1)", advisoryKey); err != nil {
				b.Error(err)
				granted <- time.Time{}
				return
			}
			at := time.Now()
			if _, err := waiter.Exec(ctx, "SELECT pg_advisory_unlock($1)", advisoryKey); err != nil {
				b.Error(err)
			}
			granted <- at
		}()
		for {
			var n int
			if err := p.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = $1", advisoryKey).Scan(&n); err != nil {
				b.Fatal(err)
			}
			if n > 0 {
				break
			}
		}
		time.Sleep(time.Duration(i%20) * time.Millisecond) // the workload's shape, as benchutil.Handoff
		start := time.Now()
		if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock($1)", advisoryKey); err != nil {
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
}
