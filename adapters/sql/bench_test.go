package sqlfence_test

import (
	"context"
	"testing"

	"github.com/fencekit/fencekit/fence"
)

// BenchmarkWrite compares a fenced write with a plain UPDATE of the same row, on
// the same SQLite file in the same run. Both store a changed value on every
// write (SQLite skips writing a row whose bytes do not change, which would make
// an unchanged plain UPDATE an unfair baseline). Compare the two ns/op figures;
// the target is fenced/plain <= 1.10.
func BenchmarkWrite(b *testing.B) {
	db, fdb := openSQLite(b)
	w := newSQLiteWriter(b, fdb)
	ctx := context.Background()
	value := []byte("a value of a typical small size, 64 bytes long.................")
	if err := w.Write(ctx, "row", value, 1); err != nil {
		b.Fatal(err)
	}
	tok := fence.Token(1)
	b.Run("fenced", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			tok++ // a new grant each time: the fence moves on every write
			value[0] = byte(i)
			if err := w.Write(ctx, "row", value, tok); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("plain", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			value[0] = byte(i)
			if _, err := db.ExecContext(ctx, `UPDATE fence_values SET value = $1 WHERE key = $2`, value, "row"); err != nil {
				b.Fatal(err)
			}
		}
	})
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
