package azfence_test

import (
	"bytes"
	"math"
	"strings"
	"testing"
	"time"

	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// refuses reports the keys and names Azure cannot store byte for byte (the
// writer's and acquirer's documented rules), for a blob name prefix.
func refuses(prefix string) func(string) bool {
	return func(s string) bool {
		n := prefix + s
		if leasekit.CheckText("", "", s, azfence.MaxKeyBytes-len(prefix)) != nil || strings.Contains(s, "\\") ||
			strings.HasSuffix(n, ".") || strings.HasSuffix(n, "/") {
			return true
		}
		for _, seg := range strings.Split(n, "/") {
			if seg == "." || seg == ".." {
				return true
			}
		}
		return false
	}
}

// FuzzEntryPoints drives the public entry points with arbitrary keys, names,
// ttls, tokens and values against Azurite: every call succeeds with the
// documented outcome or fails with a documented error.
func FuzzEntryPoints(f *testing.F) {
	f.Add("k", "n", int64(20*time.Second), uint64(1), []byte("v"))
	f.Add("", "", int64(0), uint64(0), []byte(nil))
	f.Add("nul\x00", "bad\xff", int64(-1), uint64(math.MaxUint64), []byte{0})
	f.Add("k", "n", int64(math.MaxInt64), uint64(fence.MaxToken), []byte("top"))
	f.Add("dot.", "a/../b", int64(time.Second), uint64(fence.MaxToken+1), []byte(""))
	f.Add("back\\slash", "slash/", int64(61*time.Second), uint64(2), []byte("x"))
	f.Add("k2", "n2", int64(time.Millisecond), uint64(3), []byte("short ttl"))
	f.Add(string(bytes.Repeat([]byte("k"), 1025)), "n", int64(60*time.Second), uint64(2), []byte("x"))
	e := newEnv(f)
	p := &fencetest.EntryPoints{Writer: newWriter(f, e.c, nil), Acquirer: newAcquirer(f, e.c), MinTTL: azfence.MinAcquirerTTL, MaxTTL: azfence.MaxAcquirerTTL}
	keyRefused, nameRefused := refuses(""), refuses("fencekit-locks/")
	p.Refuses = func(s string) bool { return keyRefused(s) || nameRefused(s) }
	f.Fuzz(func(t *testing.T, key, name string, ttlNs int64, token uint64, value []byte) {
		p.Check(t, key, name, ttlNs, token, value)
	})
}
