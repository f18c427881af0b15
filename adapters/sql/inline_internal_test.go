package sqlfence

import (
	"bytes"
	"testing"
)

// TestMySQLInline: arguments become literals only where the literal means the
// same whatever the session (hex for bytes, NULL for a nil slice, decimal for
// integers, plain ASCII strings quoted); anything else leaves the statement
// to the driver's parameters, unchanged.
func TestMySQLInline(t *testing.T) {
	big := bytes.Repeat([]byte{'a'}, mysqlInlineMax+1)
	for _, c := range []struct {
		q    string
		args []any
		want string // "" : unchanged
	}{
		{"SELECT ?, ?, ?", []any{int64(-7), 12, []byte("a'\\?\x00\xff")}, "SELECT -7, 12, X'61275c3f00ff'"},
		{"SELECT ?", []any{[]byte{}}, "SELECT X''"},
		{"SELECT ?", []any{[]byte(nil)}, "SELECT NULL"},
		{"SELECT GET_LOCK(?, ?)", []any{"fencekit:0a1b", 1}, "SELECT GET_LOCK('fencekit:0a1b', 1)"},
		{"SELECT ?", []any{"it's"}, ""},
		{"SELECT ?", []any{"é"}, ""},
		{"SELECT ?", []any{1.5}, ""},
		{"SELECT ?", []any{nil}, ""},
		{"SELECT ?", []any{big}, ""},
		{"SELECT ?, ?", []any{int64(1)}, ""},
		{"SELECT ?", []any{int64(1), int64(2)}, ""},
	} {
		got, args := mysqlInline(c.q, c.args)
		if c.want == "" {
			if got != c.q || len(args) != len(c.args) {
				t.Errorf("%q %v: got %q %v, want it unchanged", c.q, c.args, got, args)
			}
			continue
		}
		if got != c.want || len(args) != 0 {
			t.Errorf("%q %v: got %q %v, want %q and no arguments", c.q, c.args, got, args, c.want)
		}
	}
}
