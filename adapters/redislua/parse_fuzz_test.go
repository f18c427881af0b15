package redislua

import (
	"testing"
)

// FuzzParseRecord: the idempotency record parser never panics on what a script
// (or someone else's data in the hash) returns, and keeps what it accepts.
func FuzzParseRecord(f *testing.F) {
	f.Add("fp", "armed", "3", "owner", "120", "40", "result", "0", true)
	f.Add("", "", "", "", "", "", "", "", false)
	f.Add("fp", "completed", "18446744073709551615", "o", "-5", "9999999999999", "", "1", true)
	f.Add("fp", "claimed", "x", "o", "1.5", "2", "", "0", false)
	f.Fuzz(func(t *testing.T, fp, state, fence, owner, lease, started, result, dropped string, hasResult bool) {
		in := []any{fp, state, fence, owner, lease, started, nil, dropped}
		if hasResult {
			in[6] = result
		}
		r, err := parseRecord("k", in)
		if err != nil {
			return
		}
		if r.Key != "k" || r.Fingerprint != fp || string(r.State) != state || r.Owner != owner {
			t.Fatalf("parsed %v into %+v", in, r)
		}
		if hasResult && string(r.Result) != result {
			t.Fatalf("result %q parsed as %q", result, r.Result)
		}
	})
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
