package fencetest

import (
	"fmt"
	"slices"
	"strings"
)

// confusable is two names (or keys) that differ, byte for byte, in a way some
// collation, character set or normalisation would erase.
type confusable struct {
	what string
	a, b string
	long bool // 1024-byte names: a backend may refuse both for their length
}

// confusablePairs returns pairs built on base: case, a trailing space, a tab,
// two 4-byte characters (a 3-byte character set turns both into '?'), NFC and
// NFD forms of one letter, and two 1024-byte names that differ in their last
// byte.
func confusablePairs(base string) []confusable {
	long := base + strings.Repeat("x", 1023-len(base))
	return []confusable{
		{what: "case", a: base + "-Lock", b: base + "-lock"},
		{what: "trailing space", a: base, b: base + " "},
		{what: "two trailing spaces", a: base + " ", b: base + "  "},
		{what: "trailing tab", a: base, b: base + "\t"},
		{what: "tab and space", a: base + "\tx", b: base + " x"},
		{what: "4-byte characters", a: base + "-\U0001F600", b: base + "-\U0001F601"},
		{what: "4-byte character and '?'", a: base + "-\U0001F600", b: base + "-?"},
		{what: "NFC and NFD", a: base + "-caf\u00e9", b: base + "-cafe\u0301"},
		{what: "1024 bytes, last byte differs", a: long + "a", b: long + "b", long: true},
	}
}

// skip reports whether either name of p is one the harness declared bad.
func (p confusable) skip(bad []string) bool {
	return slices.Contains(bad, p.a) || slices.Contains(bad, p.b)
}

// shortName quotes s, cut to 40 bytes with its length when longer.
func shortName(s string) string {
	if len(s) > 40 {
		return fmt.Sprintf("%.40q... (%d bytes)", s, len(s))
	}
	return fmt.Sprintf("%q", s)
}
