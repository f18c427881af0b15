package sqlfence_test

import (
	"bytes"
	"math"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// FuzzSQLiteEntryPoints drives the public entry points with arbitrary keys,
// names, ttls, tokens and values. Every call either succeeds with the documented
// outcome or fails with a documented error (ErrInvalid before touching the
// database, ErrStale, ErrHeld): never a panic, never a raw driver error from
// input that should have been refused, never a lease that does not exclude.
func FuzzSQLiteEntryPoints(f *testing.F) {
	f.Add("k", "n", int64(time.Second), uint64(1), []byte("v"))
	f.Add("", "", int64(0), uint64(0), []byte(nil))
	f.Add("nul\x00", "bad\xff", int64(-1), uint64(math.MaxUint64), []byte{0})
	f.Add("k", "n", int64(math.MaxInt64), uint64(fence.MaxToken), []byte("top"))
	f.Add("k", "n", int64(math.MinInt64), uint64(fence.MaxToken+1), []byte(""))
	f.Add(string(bytes.Repeat([]byte("k"), 1025)), "n", int64(1), uint64(2), []byte("x"))
	_, fdb := openSQLite(f)
	w, a := newSQLiteWriter(f, fdb), newSQLiteAcquirer(f, fdb)
	e := &fencetest.EntryPoints{Writer: w, Acquirer: a, MinTTL: 3 * time.Millisecond, MaxTTL: sqlfence.MaxTTL,
		Refuses: func(s string) bool { return leasekit.CheckText("", "", s, sqlfence.MaxKeyBytes) != nil }}
	f.Fuzz(func(t *testing.T, key, name string, ttlNs int64, token uint64, value []byte) {
		e.Check(t, key, name, ttlNs, token, value)
	})
}
