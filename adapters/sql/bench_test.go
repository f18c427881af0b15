package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// BenchmarkWrite compares a fenced write (subject) with a plain UPDATE of the
// same row (baseline), on the same SQLite file, interleaved in one run. Both store a changed value on
// every write (SQLite skips writing a row whose bytes do not change, which would
// make an unchanged plain UPDATE an unfair baseline). The target is
// fenced/plain <= 1.10.
func BenchmarkWrite(b *testing.B) {
	db, fdb := openSQLite(b)
	pairWrites(b, newSQLiteWriter(b, fdb), "row", func(ctx context.Context, value []byte) (int64, error) {
		return rowsAffected(db.ExecContext(ctx, `UPDATE fence_values SET value = $1 WHERE key = $2`, value, "row"))
	})
}

// pairWrites interleaves fenced writes of key through w (subject) with plain
// updates of the same row (baseline), both storing a changed 64-byte value
// each time; every fenced write carries a new, larger token. plain returns
// the rows it changed, which must be 1; at the end the row must hold the last
// value written and the last token, so neither side can have skipped its work.
func pairWrites(b *testing.B, w *sqlfence.Writer, key string, plain func(ctx context.Context, value []byte) (int64, error)) {
	ctx := context.Background()
	value := []byte("a value of a typical small size, 64 bytes long.................")
	tok := fence.Token(1)
	if err := w.Write(ctx, key, value, tok); err != nil {
		b.Fatal(err)
	}
	benchutil.Pair(b, func(i int) error {
		tok++ // a new grant each time: the fence moves on every write
		value[0] = byte(i)
		return w.Write(ctx, key, value, tok)
	}, func(i int) error {
		value[0] = byte(i)
		n, err := plain(ctx, value)
		if err == nil && n != 1 {
			err = fmt.Errorf("the plain UPDATE changed %d rows, want 1", n)
		}
		return err
	})
	v, got, err := w.Read(ctx, key)
	if err != nil || !bytes.Equal(v, value) || got != tok {
		b.Fatalf("after the run the row holds %q with token %d (%v); want %q with token %d", v, got, err, value, tok)
	}
}

// rowsAffected is a database/sql result's rows affected.
func rowsAffected(r sql.Result, err error) (int64, error) {
	if err != nil {
		return 0, err
	}
	return r.RowsAffected()
}

// BenchmarkAcquireRelease measures an uncontended TryAcquire + Release on SQLite.
func BenchmarkAcquireRelease(b *testing.B) {
	_, fdb := openSQLite(b)
	a := newSQLiteAcquirer(b, fdb)
	ctx := context.Background()
	for i := 0; i < b.N; i++ {
		l := mustGrant(b, ctx, a, "bench", 1e10)
		if err := l.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPostgresWrite compares, on one PostgreSQL server in one run, a fenced
// write (subject) with a plain UPDATE of the same row storing a changed value
// (baseline), interleaved. In /synchronous-commit-on (the server's default)
// both commits wait for the disk, whose spread of flush times (tens of
// percent here) is in both. In /synchronous-commit-off the session asks for
// commits that do not wait: the plain UPDATE's does not, the fenced write's
// still does (an accepted fence must survive a crash, see Writer), and the
// ratio is the price of that flush.
func BenchmarkPostgresWrite(b *testing.B) {
	for _, mode := range []string{"on", "off"} {
		b.Run("synchronous-commit-"+mode, func(b *testing.B) {
			p := pgPool(b, pgOpts{params: map[string]string{"synchronous_commit": mode}})
			w := newWriterOn(b, sqlfence.Pgx(p), nil)
			key := fencetest.Name("bench")
			pairWrites(b, w, key, func(ctx context.Context, value []byte) (int64, error) {
				tag, err := p.Exec(ctx, `UPDATE fence_values SET value = $1 WHERE key = $2`, value, key)
				return tag.RowsAffected(), err
			})
		})
	}
}

// BenchmarkPostgresAcquireRelease measures an uncontended TryAcquire + Release
// (two statements, see TestRoundTrips) next to a plain SELECT 1 round trip (benchutil.AcquireRelease).
func BenchmarkPostgresAcquireRelease(b *testing.B) {
	p := pgPool(b, pgOpts{})
	a := newAcquirerOn(b, sqlfence.Pgx(p), nil)
	benchutil.AcquireRelease(b, a, func(ctx context.Context) error { _, err := p.Exec(ctx, "SELECT 1"); return err })
}

// BenchmarkPostgresHandoff measures the time from the start of a holder's
// Release to the grant of an Acquire already waiting, with waiters woken by
// LISTEN/NOTIFY and with polling alone (p50 and p90), for a waiter of the
// holder's own Acquirer (whose Release lets the head of its line try at
// once) and of another (as another process would see it: only the
// notification or the next poll wakes it).
func BenchmarkPostgresHandoff(b *testing.B) {
	p := pgPool(b, pgOpts{})
	for _, mode := range []string{"notify", "poll"} {
		opts := &sqlfence.AcquirerOptions{DisableNotify: mode == "poll"}
		a := newAcquirerOn(b, sqlfence.Pgx(p), opts)
		other := newAcquirerOn(b, sqlfence.Pgx(p), opts)
		b.Run(mode+"/same-acquirer", func(b *testing.B) { benchutil.Handoff(b, a, a, fencetest.Name("handoff")) })
		b.Run(mode+"/other-acquirer", func(b *testing.B) { benchutil.Handoff(b, a, other, fencetest.Name("handoff")) })
	}
}

// BenchmarkFlakyNetwork: 8 workers x 200 locked increments of one counter
// (Acquire, Read, fenced Write, Release) through a fault proxy with 1-3 ms
// jitter, then with 2% cuts too (benchutil.FlakyNetwork), on PostgreSQL and
// MariaDB. Run it alone, once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/sql/
func BenchmarkFlakyNetwork(b *testing.B) {
	benchutil.FlakyNetwork(b,
		benchutil.Flaky{Name: "postgres", Target: func(b *testing.B) string { return pgTarget(b) }, Open: sqlFlaky(flakyPostgres)},
		benchutil.Flaky{Name: "mysql", Target: func(b *testing.B) string { return mysqlAddr(b) }, Open: sqlFlaky(flakyMySQL)},
	)
}

// sqlFlaky returns a benchutil.Flaky's Open: an acquirer and a writer on the
// database open returns.
func sqlFlaky(open func(b *testing.B, p *faultnet.Proxy) *sqlfence.DB) func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
	return func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
		db := open(b, p)
		a := newAcquirerOn(b, db, nil)
		w := newWriterOn(b, db, nil)
		return a, w
	}
}

func flakyPostgres(b *testing.B, p *faultnet.Proxy) *sqlfence.DB {
	pgPool(b, pgOpts{}) // the default tables
	// pgx's default pool has max(4, CPUs) connections, one of them kept by
	// the release listener: size it for the 8 workers, as their user would.
	return sqlfence.Pgx(proxiedPool(b, p, 16))
}

func flakyMySQL(b *testing.B, p *faultnet.Proxy) *sqlfence.DB {
	openMySQL(b, "") // the default tables
	db := proxiedMySQL(b, p)
	// database/sql keeps 2 idle connections by default: 8 workers would
	// open a connection (a handshake through the jitter) for most requests.
	db.SetMaxIdleConns(16)
	return sqlfence.MySQL(db)
}

// The floors: what the designs weighed for a faster handoff between
// processes and for the uncontended and contended targets against the
// peer's lock could reach at best on this server, built in plain SQL with no library around them (no
// retries, no lost-reply handling, no Go-side line), next to the peer's
// own lock measured in the same run. A design that keeps fencekit's
// guarantees cannot beat its floor; where the floor is already past a
// target, that target cannot be reached without giving up the guarantee the
// floor pays for (a grant that survives a crash: its commit waits for the
// disk).
//
// Each iteration runs every mode once, in a random order, after an idle
// pause of 1-3ms (as between handoffs of a real workload: the CPUs halt
// when idle, and each wake-up pays for it). Each mode reports its p50 and
// p90 in microseconds, and its p50 over the peer's.

// floorMode is one way of doing the measured step; run returns its time.
type floorMode struct {
	name string
	run  func() time.Duration
}

func floorRun(b *testing.B, peer string, modes []floorMode) {
	b.Helper()
	res := map[string][]time.Duration{}
	order := slices.Clone(modes)
	for i := 0; i < b.N; i++ {
		rand.Shuffle(len(order), func(x, y int) { order[x], order[y] = order[y], order[x] })
		for _, m := range order {
			time.Sleep(time.Duration(1+rand.N(3)) * time.Millisecond) // the idle pause the step follows, not a synchronisation
			res[m.name] = append(res[m.name], m.run())
		}
	}
	p := func(name string, q int) time.Duration {
		s := slices.Clone(res[name])
		slices.Sort(s)
		return s[min(len(s)*q/100, len(s)-1)]
	}
	for _, m := range modes {
		b.ReportMetric(float64(p(m.name, 50).Microseconds()), m.name+"-p50-µs")
		b.ReportMetric(float64(p(m.name, 90).Microseconds()), m.name+"-p90-µs")
		if m.name != peer {
			b.ReportMetric(float64(p(m.name, 50))/float64(p(peer, 50)), m.name+"/"+peer)
		}
	}
}

// floorIncrements returns a mode that resets the counter, runs workers x
// each steps (step(w) is one locked increment of worker w) and fails b
// unless the counter then reads exact.
func floorIncrements(b *testing.B, workers, each int, reset func(), read func() int64, step func(w int) error) func() time.Duration {
	return func() time.Duration {
		reset()
		t0 := time.Now()
		var wg sync.WaitGroup
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range each {
					if err := step(w); err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		d := time.Since(t0)
		if v := read(); v != int64(workers*each) {
			b.Fatalf("counter %d, want %d", v, workers*each)
		}
		return d
	}
}

// floorMust returns a function that fails b on its error.
func floorMust(b *testing.B) func(any, error) {
	return func(_ any, err error) {
		b.Helper()
		if err != nil {
			b.Fatal(err)
		}
	}
}

const (
	pgNowUs = `(extract(epoch from clock_timestamp()) * 1000000)::bigint`
	myNowMs = `(UNIX_TIMESTAMP(NOW(6)) * 1000)`
)

// BenchmarkPostgresFloor/handoff: from the start of the releaser's
// statement to the moment the waiter (another connection, as in another
// process) knows it holds:
//   - advisory: pg_advisory_unlock to the return of the waiter's
//     pg_advisory_lock (the peer);
//   - queue-durable: the cross-process handoff design, a release that grants the head
//     of a waiter queue in its own statement and notifies it with the grant
//     (the waiter holds without a statement of its own), its commit waiting
//     for the disk as a grant's does;
//   - queue-async: the same with the commit not waiting (AsyncGrants);
//   - release-notify-grant: today's cross-process path at its floor, a
//     release that does not wait for the disk and notifies, then the
//     waiter's own grant, which does;
//   - durable-commit and notify-only: the two parts alone.
//
// /increments: 8 workers (a connection each) x 25 locked increments of a
// counter row, the time of the whole run:
//   - advisory: pg_advisory_lock, SELECT, UPDATE, pg_advisory_unlock;
//   - fenced-durable: the same advisory lock as the queue and wake-up (the
//     fastest there is here), plus what fencing adds at least: a grant of a
//     lease row with a new token whose commit waits for the disk before the
//     write, the write conditional on the token, a release that does not
//     wait for the disk;
//   - fenced-async: the same with a grant that does not wait (AsyncGrants);
//   - fenced-in-tx: the grant and the write in one transaction, one commit
//     that waits for the disk (as the peer's write alone), then the release.
//
// /uncontended: pg_advisory_lock + pg_advisory_unlock, against a lease row's
// grant (lease-row: its commit waits for the disk; lease-row-async: not) and
// release (not), the least a lease row can do.
//
// Every counter must end exact.
func BenchmarkPostgresFloor(b *testing.B) {
	ctx := context.Background()
	pool := pgPool(b, pgOpts{})
	conn := func() *pgx.Conn {
		c, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close(ctx) })
		return c
	}
	R := conn()
	floorMust(b)(R.Exec(ctx, `DROP TABLE IF EXISTS floor_lease, floor_queue, floor_counter`))
	floorMust(b)(R.Exec(ctx, `CREATE TABLE floor_lease (name text PRIMARY KEY, token bigint NOT NULL, owner text NOT NULL, expires_at bigint NOT NULL)`))
	floorMust(b)(R.Exec(ctx, `CREATE TABLE floor_queue (id bigserial PRIMARY KEY, name text NOT NULL, owner text NOT NULL, ttl_ms bigint NOT NULL, base bigint NOT NULL)`))
	floorMust(b)(R.Exec(ctx, `CREATE TABLE floor_counter (name text PRIMARY KEY, v bigint NOT NULL, fence bigint NOT NULL)`))
	b.Cleanup(func() { _, _ = R.Exec(ctx, `DROP TABLE IF EXISTS floor_lease, floor_queue, floor_counter`) })
	floorMust(b)(R.Exec(ctx, `INSERT INTO floor_lease VALUES ('h', 1, 'r', 0), ('i', 1, '', 0), ('u', 1, '', 0)`))

	b.Run("handoff", func(b *testing.B) {
		W := conn()
		floorMust(b)(W.Exec(ctx, `LISTEN floor_ch`))
		notified := func(t0 time.Time) time.Duration {
			_, err := W.WaitForNotification(ctx)
			floorMust(b)(nil, err)
			return time.Since(t0)
		}
		hold := func() {
			floorMust(b)(R.Exec(ctx, `UPDATE floor_lease SET owner = 'r', expires_at = `+pgNowUs+` + 10000000 WHERE name = 'h'`))
		}
		queue := func(sync string) func() time.Duration {
			q := `WITH head AS (SELECT id, owner, ttl_ms, base FROM floor_queue WHERE name = 'h' ORDER BY id LIMIT 1 FOR UPDATE),
upd AS (UPDATE floor_lease l SET token = GREATEST(l.token + 1, ` + pgNowUs + `), owner = head.owner, expires_at = head.base + head.ttl_ms * 1000
  FROM head WHERE l.name = 'h' AND l.owner = 'r' AND set_config('synchronous_commit', '` + sync + `', true) IS NOT NULL RETURNING l.token, head.owner, head.id),
del AS (DELETE FROM floor_queue q USING upd WHERE q.id = upd.id)
SELECT pg_notify('floor_ch', upd.owner || ':' || upd.token) FROM upd`
			return func() time.Duration {
				hold()
				floorMust(b)(W.Exec(ctx, `INSERT INTO floor_queue (name, owner, ttl_ms, base) VALUES ('h', 'w', 10000, `+pgNowUs+`)`))
				t0 := time.Now()
				floorMust(b)(R.Exec(ctx, q))
				return notified(t0)
			}
		}
		floorRun(b, "advisory", []floorMode{
			{"advisory", func() time.Duration {
				floorMust(b)(R.Exec(ctx, `SELECT pg_advisory_lock(7100032)`))
				done := make(chan time.Time, 1)
				go func() {
					_, err := W.Exec(ctx, `SELECT pg_advisory_lock(7100032)`)
					if err != nil {
						b.Error(err)
					}
					done <- time.Now()
				}()
				for waiting := false; !waiting; {
					floorMust(b)(nil, R.QueryRow(ctx, `SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = 7100032`).Scan(&waiting))
				}
				t0 := time.Now()
				floorMust(b)(R.Exec(ctx, `SELECT pg_advisory_unlock(7100032)`))
				d := (<-done).Sub(t0)
				floorMust(b)(W.Exec(ctx, `SELECT pg_advisory_unlock(7100032)`))
				return d
			}},
			{"queue-durable", queue("on")},
			{"queue-async", queue("off")},
			{"release-notify-grant", func() time.Duration {
				hold()
				t0 := time.Now()
				floorMust(b)(R.Exec(ctx, `WITH u AS (UPDATE floor_lease SET expires_at = 0 WHERE name = 'h' AND owner = 'r' AND set_config('synchronous_commit', 'off', true) IS NOT NULL RETURNING token) SELECT pg_notify('floor_ch', 'h') FROM u`))
				_, err := W.WaitForNotification(ctx)
				floorMust(b)(nil, err)
				ct, err := W.Exec(ctx, `UPDATE floor_lease SET token = GREATEST(token + 1, `+pgNowUs+`), owner = 'w', expires_at = `+pgNowUs+` + 10000000 WHERE name = 'h' AND expires_at <= `+pgNowUs)
				floorMust(b)(nil, err)
				if ct.RowsAffected() != 1 {
					b.Fatal("the waiter's grant found the row held")
				}
				return time.Since(t0)
			}},
			{"durable-commit", func() time.Duration {
				t0 := time.Now()
				floorMust(b)(R.Exec(ctx, `UPDATE floor_lease SET token = token + 1 WHERE name = 'h'`))
				return time.Since(t0)
			}},
			{"notify-only", func() time.Duration {
				t0 := time.Now()
				floorMust(b)(R.Exec(ctx, `SELECT pg_notify('floor_ch', 'x')`))
				return notified(t0)
			}},
		})
	})

	b.Run("uncontended", func(b *testing.B) {
		floorRun(b, "advisory", []floorMode{
			{"advisory", func() time.Duration {
				t0 := time.Now()
				floorMust(b)(R.Exec(ctx, `SELECT pg_advisory_lock(7100034)`))
				floorMust(b)(R.Exec(ctx, `SELECT pg_advisory_unlock(7100034)`))
				return time.Since(t0)
			}},
			{"lease-row", pgLeaseRow(b, R, "on")},
			{"lease-row-async", pgLeaseRow(b, R, "off")},
		})
	})

	b.Run("increments", func(b *testing.B) {
		const workers, each = 8, 25
		conns := make([]*pgx.Conn, workers)
		for i := range conns {
			conns[i] = conn()
		}
		step := func(c *pgx.Conn, w int, grant string) error {
			if _, err := c.Exec(ctx, `SELECT pg_advisory_lock(7100033)`); err != nil {
				return err
			}
			defer c.Exec(ctx, `SELECT pg_advisory_unlock(7100033)`) //nolint:errcheck // a failed unlock fails the count check
			var tok int64
			if grant == "in-tx" {
				return pgInTxStep(ctx, c, w)
			}
			if grant != "" {
				owner := fmt.Sprint(w)
				if err := c.QueryRow(ctx, `UPDATE floor_lease SET token = GREATEST(token + 1, `+pgNowUs+`), owner = $1, expires_at = `+pgNowUs+` + 10000000
WHERE name = 'i' AND expires_at <= `+pgNowUs+` AND set_config('synchronous_commit', '`+grant+`', true) IS NOT NULL RETURNING token`, owner).Scan(&tok); err != nil {
					return fmt.Errorf("grant: %w", err)
				}
				defer c.Exec(ctx, `UPDATE floor_lease SET expires_at = 0 WHERE name = 'i' AND token = $1 AND set_config('synchronous_commit', 'off', true) IS NOT NULL`, tok) //nolint:errcheck // a failed release fails the next grant
			}
			var v int64
			if err := c.QueryRow(ctx, `SELECT v FROM floor_counter WHERE name = 'c'`).Scan(&v); err != nil {
				return err
			}
			ct, err := c.Exec(ctx, `UPDATE floor_counter SET v = $1, fence = $2 WHERE name = 'c' AND fence <= $2`, v+1, tok)
			if err == nil && ct.RowsAffected() != 1 {
				err = fmt.Errorf("write refused at token %d", tok)
			}
			return err
		}
		run := func(grant string) func() time.Duration {
			return floorIncrements(b, len(conns), each, func() {
				floorMust(b)(R.Exec(ctx, `INSERT INTO floor_counter VALUES ('c', 0, 0) ON CONFLICT (name) DO UPDATE SET v = 0, fence = 0`))
			}, func() (v int64) {
				floorMust(b)(nil, R.QueryRow(ctx, `SELECT v FROM floor_counter WHERE name = 'c'`).Scan(&v))
				return v
			}, func(w int) error { return step(conns[w], w, grant) })
		}
		floorRun(b, "advisory", []floorMode{{"advisory", run("")}, {"fenced-durable", run("on")}, {"fenced-async", run("off")}, {"fenced-in-tx", run("in-tx")}})
	})
}

// pgLeaseRow is an uncontended grant of a lease row whose commit waits for
// the disk (sync "on") or not ("off"), and its release, which does not.
func pgLeaseRow(b *testing.B, c *pgx.Conn, sync string) func() time.Duration {
	return func() time.Duration {
		ctx := context.Background()
		t0 := time.Now()
		var tok int64
		floorMust(b)(nil, c.QueryRow(ctx, `UPDATE floor_lease SET token = GREATEST(token + 1, `+pgNowUs+`), owner = 'u', expires_at = `+pgNowUs+` + 10000000
WHERE name = 'u' AND expires_at <= `+pgNowUs+` AND set_config('synchronous_commit', '`+sync+`', true) IS NOT NULL RETURNING token`).Scan(&tok))
		floorMust(b)(c.Exec(ctx, `UPDATE floor_lease SET expires_at = 0 WHERE name = 'u' AND token = $1 AND set_config('synchronous_commit', 'off', true) IS NOT NULL`, tok))
		return time.Since(t0)
	}
}

// pgInTxStep is an increment of fenced-in-tx, under the caller's advisory
// lock: the grant, the read and the write in one transaction, then the
// release.
func pgInTxStep(ctx context.Context, c *pgx.Conn, w int) error {
	tx, err := c.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after a commit, a no-op
	var tok, v int64
	if err := tx.QueryRow(ctx, `UPDATE floor_lease SET token = GREATEST(token + 1, `+pgNowUs+`), owner = $1, expires_at = `+pgNowUs+` + 10000000
WHERE name = 'i' AND expires_at <= `+pgNowUs+` RETURNING token`, fmt.Sprint(w)).Scan(&tok); err != nil {
		return fmt.Errorf("grant: %w", err)
	}
	if err := tx.QueryRow(ctx, `SELECT v FROM floor_counter WHERE name = 'c'`).Scan(&v); err != nil {
		return err
	}
	ct, err := tx.Exec(ctx, `UPDATE floor_counter SET v = $1, fence = $2 WHERE name = 'c' AND fence <= $2`, v+1, tok)
	if err == nil && ct.RowsAffected() != 1 {
		err = fmt.Errorf("write refused at token %d", tok)
	}
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		return err
	}
	_, err = c.Exec(ctx, `UPDATE floor_lease SET expires_at = 0 WHERE name = 'i' AND token = $1 AND set_config('synchronous_commit', 'off', true) IS NOT NULL`, tok)
	return err
}

// BenchmarkMySQLFloor: as BenchmarkPostgresFloor, on MySQL/MariaDB, whose
// commits all wait for the disk (innodb_flush_log_at_trx_commit is the
// server's, not a transaction's, to set).
//
// /handoff, from the start of the releaser's statement to the moment the
// waiter (another connection) knows it holds:
//   - getlock: RELEASE_LOCK to the return of the waiter's GET_LOCK (the
//     peer);
//   - queue-bell-read: a release that grants the head of a waiter queue in
//     its own statement and lets the bell (a GET_LOCK) go in it; the waiter,
//     woken by the bell, reads the row with its shared lock (which waits for
//     the commit) and finds it holds: one commit;
//   - bell-read-grant: the bell's first path at its floor: the release
//     lets the bell go, the waiter reads the row, then makes its own grant:
//     two commits;
//   - bell-grant: the ringer's grant (bell.go's handOn) at its floor: the
//     waiter woken by the bell grants at once, its grant waiting for the
//     release's row lock: two commits, no read;
//   - durable-commit: one commit alone.
//
// /handoff-cold: the same, each release after the idle pause that
// BenchmarkMySQLHandoff's releases follow (benchutil.Handoff: 0-19ms with
// the waiter parked), instead of right after the busy wait for the waiter's
// GET_LOCK: the figures to hold the library's handoff against.
//
// /uncontended: GET_LOCK + RELEASE_LOCK, against a lease row's grant and
// release (two commits, the least a lease row can do).
//
// /increments: as on PostgreSQL, 8 workers x 25, GET_LOCK as the peer and
// as the floor's queue and wake-up.
func BenchmarkMySQLFloor(b *testing.B) {
	ctx := context.Background()
	db, _ := openMySQL(b, "")
	conn := func() *sql.Conn {
		c, err := db.Conn(ctx)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close() })
		return c
	}
	R := conn()
	floorMust(b)(R.ExecContext(ctx, `DROP TABLE IF EXISTS floor_lease, floor_queue, floor_counter`))
	floorMust(b)(R.ExecContext(ctx, `CREATE TABLE floor_lease (name varchar(64) PRIMARY KEY, token bigint NOT NULL, owner varchar(64) NOT NULL, expires_at bigint NOT NULL) ENGINE=InnoDB`))
	floorMust(b)(R.ExecContext(ctx, `CREATE TABLE floor_queue (id bigint AUTO_INCREMENT PRIMARY KEY, name varchar(64) NOT NULL, owner varchar(64) NOT NULL, ttl_ms bigint NOT NULL, granted int NOT NULL DEFAULT 0) ENGINE=InnoDB`))
	floorMust(b)(R.ExecContext(ctx, `CREATE TABLE floor_counter (name varchar(64) PRIMARY KEY, v bigint NOT NULL, fence bigint NOT NULL) ENGINE=InnoDB`))
	b.Cleanup(func() { _, _ = R.ExecContext(ctx, `DROP TABLE IF EXISTS floor_lease, floor_queue, floor_counter`) })
	floorMust(b)(R.ExecContext(ctx, `INSERT INTO floor_lease VALUES ('h', 1, 'r', 0), ('i', 1, '', 0)`))

	// handoff runs the handoff designs; cold: each release starts after the
	// idle pause benchutil.Handoff leaves before its release (0-19ms, the
	// waiter parked), where the CPUs and the server's threads have gone
	// idle, rather than right after the busy wait for the waiter's GET_LOCK.
	handoff := func(cold bool) func(b *testing.B) {
		return func(b *testing.B) {
			W := conn()
			n := 0
			idle := func() {
				if cold {
					time.Sleep(time.Duration(n%20) * time.Millisecond) // the workload's idle pause, not a synchronisation
					n++
				}
			}
			// waitLock starts the waiter's GET_LOCK and returns once the server
			// shows it waiting.
			waitLock := func() chan time.Time {
				var id int64
				floorMust(b)(nil, W.QueryRowContext(ctx, `SELECT CONNECTION_ID()`).Scan(&id))
				done := make(chan time.Time, 1)
				go func() {
					var got int
					if err := W.QueryRowContext(ctx, `SELECT GET_LOCK('floor_bell', 10)`).Scan(&got); err != nil || got != 1 {
						b.Errorf("GET_LOCK: %v %d", err, got)
					}
					done <- time.Now()
				}()
				for waiting := false; !waiting; {
					floorMust(b)(nil, R.QueryRowContext(ctx, `SELECT COUNT(*) > 0 FROM information_schema.PROCESSLIST WHERE ID = ? AND INFO LIKE 'SELECT GET_LOCK%'`, id).Scan(&waiting))
				}
				return done
			}
			// bell: the release lets the bell go; queue: it grants the head of
			// a waiter queue in its statement, and the woken waiter reads the
			// row; otherwise the woken waiter grants itself, after a read of
			// the row (read) or at once, its grant waiting for the release's
			// row lock (the ringer's grant of bell.go).
			bell := func(queue, read bool) func() time.Duration {
				return func() time.Duration {
					floorMust(b)(R.ExecContext(ctx, `UPDATE floor_lease SET owner = 'r', expires_at = `+myNowMs+` + 10000 WHERE name = 'h'`))
					floorMust(b)(R.ExecContext(ctx, `DO GET_LOCK('floor_bell', 1)`))
					if queue {
						floorMust(b)(W.ExecContext(ctx, `INSERT INTO floor_queue (name, owner, ttl_ms) VALUES ('h', 'w', 10000)`))
					}
					done := waitLock()
					idle()
					t0 := time.Now()
					if queue {
						floorMust(b)(R.ExecContext(ctx, `UPDATE floor_lease l JOIN floor_queue q ON q.name = l.name AND q.granted = 0
SET l.owner = q.owner, l.token = l.token + 1, l.expires_at = `+myNowMs+` + q.ttl_ms * RELEASE_ALL_LOCKS(), q.granted = 1 WHERE l.name = 'h' AND l.owner = 'r'`))
					} else {
						floorMust(b)(R.ExecContext(ctx, `UPDATE floor_lease SET expires_at = 0 * RELEASE_ALL_LOCKS() WHERE name = 'h' AND owner = 'r'`))
					}
					<-done
					var owner string
					if queue || read {
						floorMust(b)(nil, W.QueryRowContext(ctx, `SELECT owner FROM floor_lease WHERE name = 'h' LOCK IN SHARE MODE`).Scan(&owner))
					}
					if !queue {
						res, err := W.ExecContext(ctx, `UPDATE floor_lease SET token = token + 1, owner = 'w', expires_at = `+myNowMs+` + 10000 WHERE name = 'h' AND expires_at <= `+myNowMs)
						floorMust(b)(nil, err)
						if n, _ := res.RowsAffected(); n != 1 {
							b.Fatal("the waiter's grant found the row held")
						}
					} else if owner != "w" {
						b.Fatalf("the queue's head does not hold: owner %q", owner)
					}
					d := time.Since(t0)
					floorMust(b)(W.ExecContext(ctx, `DO RELEASE_ALL_LOCKS()`))
					floorMust(b)(W.ExecContext(ctx, `DELETE FROM floor_queue`))
					return d
				}
			}
			floorRun(b, "getlock", []floorMode{
				{"getlock", func() time.Duration {
					floorMust(b)(R.ExecContext(ctx, `DO GET_LOCK('floor_bell', 1)`))
					done := waitLock()
					idle()
					t0 := time.Now()
					floorMust(b)(R.ExecContext(ctx, `DO RELEASE_LOCK('floor_bell')`))
					d := (<-done).Sub(t0)
					floorMust(b)(W.ExecContext(ctx, `DO RELEASE_LOCK('floor_bell')`))
					return d
				}},
				{"queue-bell-read", bell(true, true)},
				{"bell-read-grant", bell(false, true)},
				{"bell-grant", bell(false, false)},
				{"durable-commit", func() time.Duration {
					idle()
					t0 := time.Now()
					floorMust(b)(R.ExecContext(ctx, `UPDATE floor_lease SET token = token + 1 WHERE name = 'h'`))
					return time.Since(t0)
				}},
			})
		}
	}
	b.Run("handoff", handoff(false))
	b.Run("handoff-cold", handoff(true))

	b.Run("uncontended", func(b *testing.B) {
		floorRun(b, "getlock", []floorMode{
			{"getlock", func() time.Duration {
				t0 := time.Now()
				floorMust(b)(R.ExecContext(ctx, `DO GET_LOCK('floor_u', 1)`))
				floorMust(b)(R.ExecContext(ctx, `DO RELEASE_LOCK('floor_u')`))
				return time.Since(t0)
			}},
			{"lease-row", func() time.Duration {
				t0 := time.Now()
				floorMust(b)(R.ExecContext(ctx, `UPDATE floor_lease SET token = token + 1, owner = 'r', expires_at = `+myNowMs+` + 10000 WHERE name = 'i' AND expires_at <= `+myNowMs))
				floorMust(b)(R.ExecContext(ctx, `UPDATE floor_lease SET expires_at = 0 WHERE name = 'i' AND owner = 'r'`))
				return time.Since(t0)
			}},
		})
	})

	b.Run("increments", func(b *testing.B) {
		const workers, each = 8, 25
		conns := make([]*sql.Conn, workers)
		for i := range conns {
			conns[i] = conn()
		}
		step := func(c *sql.Conn, w int, fenced bool) error {
			if _, err := c.ExecContext(ctx, `DO GET_LOCK('floor_i', 10)`); err != nil {
				return err
			}
			defer c.ExecContext(ctx, `DO RELEASE_LOCK('floor_i')`) //nolint:errcheck // a failed unlock fails the count check
			var tok int64
			if fenced {
				owner := fmt.Sprint(w)
				res, err := c.ExecContext(ctx, `UPDATE floor_lease SET token = LAST_INSERT_ID(token + 1), owner = ?, expires_at = `+myNowMs+` + 10000 WHERE name = 'i' AND expires_at <= `+myNowMs, owner)
				if err != nil {
					return fmt.Errorf("grant: %w", err)
				}
				if tok, err = res.LastInsertId(); err != nil || tok == 0 {
					return fmt.Errorf("grant: token %d, %v", tok, err)
				}
				defer c.ExecContext(ctx, `UPDATE floor_lease SET expires_at = 0 WHERE name = 'i' AND token = ?`, tok) //nolint:errcheck // a failed release fails the next grant
			}
			var v int64
			if err := c.QueryRowContext(ctx, `SELECT v FROM floor_counter WHERE name = 'c'`).Scan(&v); err != nil {
				return err
			}
			res, err := c.ExecContext(ctx, `UPDATE floor_counter SET v = ?, fence = ? WHERE name = 'c' AND fence <= ?`, v+1, tok, tok)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n != 1 {
				return fmt.Errorf("write refused at token %d", tok)
			}
			return nil
		}
		run := func(fenced bool) func() time.Duration {
			return floorIncrements(b, len(conns), each, func() {
				floorMust(b)(R.ExecContext(ctx, `INSERT INTO floor_counter VALUES ('c', 0, 0) ON DUPLICATE KEY UPDATE v = 0, fence = 0`))
			}, func() (v int64) {
				floorMust(b)(nil, R.QueryRowContext(ctx, `SELECT v FROM floor_counter WHERE name = 'c'`).Scan(&v))
				return v
			}, func(w int) error { return step(conns[w], w, fenced) })
		}
		floorRun(b, "getlock", []floorMode{{"getlock", run(false)}, {"fenced-durable", run(true)}})
	})
}

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
	a := newAcquirerOn(b, sqlfence.Pgx(p), nil)
	if err := a.CreateTable(ctx); err != nil {
		b.Fatal(err)
	}
	async := newAcquirerOn(b, sqlfence.Pgx(p), &sqlfence.AcquirerOptions{AsyncGrants: true})
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
			return incrementEach(each, func() (func() error, error) { return lock(ctx, c) }, func() (v int64, err error) {
				err = c.QueryRow(ctx, "SELECT v FROM fence_bench_counter WHERE name = $1", name).Scan(&v)
				return v, err
			}, func(v int64) error {
				_, err := c.Exec(ctx, "UPDATE fence_bench_counter SET v = $1 WHERE name = $2", v, name)
				return err
			})
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
	advisory := func(c *pgxpool.Conn) func() (func() error, error) {
		return func() (func() error, error) {
			if _, err := c.Exec(ctx, "SELECT pg_advisory_lock($1)", advisoryKey); err != nil {
				return nil, err
			}
			return func() error {
				_, err := c.Exec(ctx, "SELECT pg_advisory_unlock($1)", advisoryKey)
				return err
			}, nil
		}
	}
	peerHandoffs(b, advisory(holder), advisory(waiter), func() (bool, error) {
		var n int
		err := p.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = $1", advisoryKey).Scan(&n)
		return n > 0, err
	})
}

// peerHandoffs measures b.N handoffs of a peer's lock: the holder locks, the
// waiter's lock runs in a goroutine, and once waiting reports the waiter
// blocked, 0-19ms later (benchutil.Handoff's shape), the holder unlocks. It
// reports the 50th and 90th percentiles from that unlock to the waiter's
// grant.
func peerHandoffs(b *testing.B, holderLock, waiterLock func() (unlock func() error, err error), waiting func() (bool, error)) {
	handoffs := make([]time.Duration, 0, b.N)
	for i := 0; i < b.N; i++ {
		unlock, err := holderLock()
		if err != nil {
			b.Fatal(err)
		}
		granted := make(chan time.Time, 1)
		go func() {
			wunlock, err := waiterLock()
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
			blocked, err := waiting()
			if err != nil {
				b.Fatal(err)
			}
			if blocked {
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
}

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
	a := newAcquirerOn(b, fdb, nil)
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
		peerHandoffs(b, func() (func() error, error) { return getLock(ctx, holder) }, func() (func() error, error) { return getLock(ctx, waiter) }, func() (bool, error) {
			var n int
			err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND INFO LIKE 'SELECT GET_LOCK%'", waiterID).Scan(&n)
			return n > 0, err
		})
	})
}

// incrementEach increments a counter each times, each time under lock:
// lock, read the counter, write it plus one, unlock.
func incrementEach(each int, lock func() (func() error, error), read func() (int64, error), write func(int64) error) error {
	for range each {
		unlock, err := lock()
		if err != nil {
			return err
		}
		v, err := read()
		if err != nil {
			return err
		}
		if err := write(v + 1); err != nil {
			return err
		}
		if err := unlock(); err != nil {
			return err
		}
	}
	return nil
}

// mysqlLockedIncrements is pgLockedIncrements on MySQL.
func mysqlLockedIncrements(b *testing.B, db *sql.DB, lock func(context.Context, *sql.Conn) (func() error, error), name string, workers, each int) time.Duration {
	return lockedIncrements(b, workers, each, func(ctx context.Context) error {
		c, err := db.Conn(ctx)
		if err != nil {
			return err
		}
		defer c.Close()
		return incrementEach(each, func() (func() error, error) { return lock(ctx, c) }, func() (v int64, err error) {
			err = c.QueryRowContext(ctx, "SELECT v FROM fence_bench_counter WHERE name = ?", name).Scan(&v)
			return v, err
		}, func(v int64) error {
			_, err := c.ExecContext(ctx, "UPDATE fence_bench_counter SET v = ? WHERE name = ?", v, name)
			return err
		})
	}, func(ctx context.Context) (v int64, err error) {
		err = db.QueryRowContext(ctx, "SELECT v FROM fence_bench_counter WHERE name = ?", name).Scan(&v)
		return v, err
	})
}
