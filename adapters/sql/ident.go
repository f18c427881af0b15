package sqlfence

import (
	"fmt"
	"strings"

	"github.com/fencekit/fencekit/fence"
)

// maxIdent is PostgreSQL's identifier length limit; SQLite has none, and the
// stricter one keeps a table name portable.
const maxIdent = 63

// quoteIdent checks an SQL identifier (optionally schema-qualified, "schema.table")
// and returns it quoted. Only letters, digits and underscores are allowed, and the
// first character of each part is not a digit, so nothing needs escaping; the
// quotes keep keywords such as "key" and "value" usable and case exact.
//
// Identifiers are quoted the dialect's way: "double quotes", or `backticks` on
// MySQL, where double quotes are string literals.
func (d *dialect) quoteIdent(op, what, name string, qualified bool) (string, error) {
	bad := func(reason string) error {
		return &fence.InvalidError{Op: op, Arg: what, Reason: fmt.Sprintf("%q %s", name, reason)}
	}
	parts := []string{name}
	if qualified {
		parts = strings.Split(name, ".")
		if len(parts) > 2 {
			return "", bad("has more than one dot; use table or schema.table")
		}
	}
	quoted := make([]string, len(parts))
	for i, p := range parts {
		if p == "" {
			return "", bad("has an empty part")
		}
		if len(p) > maxIdent {
			return "", bad(fmt.Sprintf("is longer than %d characters", maxIdent))
		}
		for j, r := range p {
			ok := r == '_' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (j > 0 && r >= '0' && r <= '9')
			if !ok {
				return "", bad("is not a plain SQL identifier (letters, digits and _, not starting with a digit)")
			}
		}
		quoted[i] = d.quoteChar + p + d.quoteChar
	}
	return strings.Join(quoted, "."), nil
}
