package gcsfence_test

import (
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// FuzzGCSEntryPoints drives the public entry points with arbitrary keys,
// names, ttls, tokens and values on the in-process fake. Every call either
// succeeds with the documented outcome or fails with a documented error
// (ErrInvalid before any request, ErrStale, ErrHeld): never a panic, never a
// raw GCS error for a name that should have been refused, never a lease that
// does not exclude.
func FuzzGCSEntryPoints(f *testing.F) {
	f.Add("k", "n", int64(time.Second), uint64(1), []byte("v"))
	f.Add("", "", int64(0), uint64(0), []byte(nil))
	f.Add("nul\x00", "bad\xff", int64(-1), uint64(math.MaxUint64), []byte{0})
	f.Add("k", "n", int64(math.MaxInt64), uint64(fence.MaxToken), []byte("top"))
	f.Add("line\nfeed", "cr\r", int64(math.MinInt64), uint64(fence.MaxToken+1), []byte(""))
	f.Add(".", "..", int64(99*time.Millisecond), uint64(2), []byte("x"))
	f.Add("a/../b", "é e\u0301 ", int64(100*time.Millisecond), uint64(3), []byte("y"))
	f.Add(strings.Repeat("k", 1100), "#?[]*%", int64(time.Minute), uint64(4), []byte("z"))
	e := fakeGCS(f)
	prefix := fencetest.Name("fuzz") + "/"
	w, err := gcsfence.NewWriter(e.b(), &gcsfence.WriterOptions{Prefix: prefix})
	if err != nil {
		f.Fatal(err)
	}
	a, err := gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{Prefix: prefix + "locks/"})
	if err != nil {
		f.Fatal(err)
	}
	limit := gcsfence.MaxKeyBytes - len(prefix) - len("locks/")
	ep := &fencetest.EntryPoints{Writer: w, Acquirer: a, MinTTL: gcsfence.MinAcquirerTTL, MaxTTL: gcsfence.MaxAcquirerTTL,
		// GCS object names: UTF-8 without NUL, CR or LF, 1024 bytes with the prefix.
		Refuses: func(s string) bool {
			return len(s) > limit || !utf8.ValidString(s) || strings.ContainsAny(s, "\x00\r\n")
		}}
	f.Fuzz(func(t *testing.T, key, name string, ttlNs int64, token uint64, value []byte) {
		ep.Check(t, key, name, ttlNs, token, value)
	})
}
