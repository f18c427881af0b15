package redislua

import (
	"math"
	"math/big"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// FuzzParseRecord: the idempotency record parser never panics on what a script
// (or someone else's data in the hash) returns, accepts exactly the records
// whose fence is a decimal uint64 and whose two times are decimal int64
// milliseconds (what the scripts produce), and keeps every field it accepts.
// The seeds include a record in every state as the scripts return it, which
// must parse: a parser that refuses everything fails here.
func FuzzParseRecord(f *testing.F) {
	// As the scripts return them: fence as stored, times as Lua's tostring of
	// an integer, a result or nil (hasResult false), dropped "1" or "0".
	for _, state := range []string{"claimed", "armed", "completed", "failed", "released", "unknown"} {
		f.Add("fp", state, "1733312345678901", "owner-1", "299", "1", "", "0", false)
	}
	f.Add("fp", "completed", "3", "o", "-12", "40", "result", "0", true)
	f.Add("fp", "completed", "9007199254740991", "o", "86399999", "7", "", "1", true)
	f.Add("fp", "armed", "3", "owner", "120", "40", "result", "0", true)
	// Not records: each must be refused.
	f.Add("", "", "", "", "", "", "", "", false)
	f.Add("fp", "completed", "18446744073709551616", "o", "-5", "9999999999999", "", "1", true)
	f.Add("fp", "claimed", "x", "o", "1.5", "2", "", "0", false)
	f.Add("fp", "claimed", "-1", "o", "1", "2", "", "0", false)
	f.Add("fp", "claimed", "1", "o", "1e+15", "2", "", "0", false)
	f.Fuzz(func(t *testing.T, fp, state, fenceText, owner, lease, started, result, dropped string, hasResult bool) {
		in := []any{fp, state, fenceText, owner, lease, started, nil, dropped}
		if hasResult {
			in[6] = result
		}
		r, err := parseRecord("k", in)
		wantFence, okFence := decimal(fenceText, false, math.MaxUint64)
		wantLease, okLease := decimal(lease, true, math.MaxInt64)
		wantStarted, okStarted := decimal(started, true, math.MaxInt64)
		if !okFence || !okLease || !okStarted {
			if err == nil {
				t.Fatalf("accepted %q: fence %q, times %q %q are not decimal integers in range", in, fenceText, lease, started)
			}
			return
		}
		if err != nil {
			t.Fatalf("refused the well-formed record %q: %v", in, err)
		}
		if r.Key != "k" || r.Fingerprint != fp || string(r.State) != state || r.Owner != owner ||
			r.Fence != fence.Token(wantFence.Uint64()) || r.ResultDropped != (dropped == "1") {
			t.Fatalf("parsed %q into %+v", in, r)
		}
		if hasResult != (r.Result != nil) || string(r.Result) != result && hasResult {
			t.Fatalf("result %q (present: %v) parsed as %q (nil: %v)", result, hasResult, r.Result, r.Result == nil)
		}
		// Milliseconds that fit a Duration keep their value.
		for _, c := range []struct {
			what string
			got  time.Duration
			ms   *big.Int
		}{{"lease left", r.LeaseLeft, wantLease}, {"in progress for", r.InProgressFor, wantStarted}} {
			if c.ms.CmpAbs(big.NewInt(math.MaxInt64/int64(time.Millisecond))) <= 0 && c.got != time.Duration(c.ms.Int64())*time.Millisecond {
				t.Fatalf("%s %s ms parsed as %v", c.what, c.ms, c.got)
			}
		}
	})
}

// decimal reads s as a base-10 integer of at most limit in absolute value:
// digits only, with a leading sign when signed.
func decimal(s string, signed bool, limit uint64) (*big.Int, bool) {
	digits := s
	if signed && len(s) > 0 && (s[0] == '-' || s[0] == '+') {
		digits = s[1:]
	}
	if digits == "" {
		return nil, false
	}
	for _, c := range digits {
		if c < '0' || c > '9' {
			return nil, false
		}
	}
	n, _ := new(big.Int).SetString(s, 10)
	lim := new(big.Int).SetUint64(limit)
	if n.Cmp(lim) > 0 || n.Sign() < 0 && new(big.Int).Neg(n).Cmp(new(big.Int).Add(lim, big.NewInt(1))) > 0 {
		return nil, false
	}
	return n, true
}

// FuzzParsePair: script replies of any shape are refused, not panicked on.
func FuzzParsePair(f *testing.F) {
	f.Add(int64(1), "42", true)
	f.Add(int64(0), "-1", false)
	f.Add(int64(-1), "x", true)
	f.Fuzz(func(t *testing.T, flag int64, n string, asString bool) {
		var second any = n
		if !asString {
			second = flag
		}
		got, _, err := parsePair([]any{flag, second})
		if err == nil && got != flag {
			t.Fatalf("flag %d read as %d", flag, got)
		}
		_, _, _ = parsePair(n)
		_, _, _ = parsePair([]any{n})
	})
}
