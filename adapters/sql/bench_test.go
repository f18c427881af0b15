package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"testing"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/benchutil"
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
		l, err := a.TryAcquire(ctx, "bench", 1e10)
		if err != nil {
			b.Fatal(err)
		}
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
			w, err := sqlfence.NewWriter(sqlfence.Pgx(p), nil)
			if err != nil {
				b.Fatal(err)
			}
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
	a, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), nil)
	if err != nil {
		b.Fatal(err)
	}
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
		a, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), opts)
		if err != nil {
			b.Fatal(err)
		}
		other, err := sqlfence.NewAcquirer(sqlfence.Pgx(p), opts)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(mode+"/same-acquirer", func(b *testing.B) { benchutil.Handoff(b, a, a, fencetest.Name("handoff")) })
		b.Run(mode+"/other-acquirer", func(b *testing.B) { benchutil.Handoff(b, a, other, fencetest.Name("handoff")) })
	}
}
