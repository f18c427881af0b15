package sqlfence

import (
	"bytes"
	"encoding/base64"
	"reflect"
	"testing"
)

// TestMySQLInline: arguments become literals only where the literal means the
// same whatever the session (hex for bytes, NULL for a nil slice, decimal for
// integers, plain ASCII strings quoted); a longer []byte or any other string
// becomes a base64 parameter the server decodes, which no character set
// conversion changes; anything else stays a parameter as it is.
func TestMySQLInline(t *testing.T) {
	big := bytes.Repeat([]byte{'a'}, mysqlInlineMax+1)
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	for _, c := range []struct {
		q        string
		args     []any
		max      int
		want     string // "" : unchanged
		wantArgs []any
	}{
		{"SELECT ?, ?, ?", []any{int64(-7), 12, []byte("a'\\?\x00\xff")}, mysqlInlineMax, "SELECT -7, 12, X'61275c3f00ff'", nil},
		{"SELECT ?", []any{[]byte{}}, mysqlInlineMax, "SELECT X''", nil},
		{"SELECT ?", []any{[]byte{}}, 0, "SELECT X''", nil},
		{"SELECT ?", []any{""}, mysqlInlineMax, "SELECT X''", nil},
		{"SELECT ?", []any{[]byte(nil)}, mysqlInlineMax, "SELECT NULL", nil},
		{"SELECT GET_LOCK(?, ?)", []any{"fencekit:0a1b", 1}, mysqlInlineMax, "SELECT GET_LOCK('fencekit:0a1b', 1)", nil},
		{"SELECT ?", []any{"it's"}, mysqlInlineMax, "SELECT FROM_BASE64(?)", []any{b64("it's")}},
		{"SELECT ?", []any{"é"}, mysqlInlineMax, "SELECT FROM_BASE64(?)", []any{b64("é")}},
		{"SELECT ?", []any{1.5}, mysqlInlineMax, "SELECT ?", []any{1.5}},
		{"SELECT ?", []any{nil}, mysqlInlineMax, "SELECT ?", []any{nil}},
		{"SELECT ?, ?", []any{big, []byte("é")}, mysqlInlineMax, "SELECT FROM_BASE64(?), X'c3a9'", []any{b64(string(big))}},
		{"SELECT ?, ?", []any{[]byte("é"), int64(3)}, 0, "SELECT FROM_BASE64(?), 3", []any{b64("é")}},
		{"SELECT ?, ?", []any{int64(1)}, mysqlInlineMax, "", nil},
		{"SELECT ?", []any{int64(1), int64(2)}, mysqlInlineMax, "", nil},
	} {
		got, args := mysqlInline(c.q, c.args, c.max)
		if c.want == "" {
			if got != c.q || len(args) != len(c.args) {
				t.Errorf("%q %v: got %q %v, want it unchanged", c.q, c.args, got, args)
			}
			continue
		}
		if got != c.want || len(args) != len(c.wantArgs) || len(args) > 0 && !reflect.DeepEqual(args, c.wantArgs) {
			t.Errorf("%q %v (max %d): got %q %v, want %q %v", c.q, c.args, c.max, got, args, c.want, c.wantArgs)
		}
	}
}
