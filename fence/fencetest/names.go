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
	// path: a is b spelled with a path segment that a server mapping names
	// to files resolves (an empty, "." or ".." segment, a slash at either
	// end). A backend may refuse a with ErrInvalid, and must then still
	// store b.
	path bool
}

// confusablePairs returns pairs built on base: case, a trailing space, a tab,
// two 4-byte characters (a 3-byte character set turns both into '?'), NFC and
// NFD forms of one letter, two 1024-byte names that differ in their last
// byte, and path spellings that a server storing names as file paths
// resolves to one file (a//b, a/./b, x/../b, a/b/, ./a, /a).
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
		// Each path pair has names of its own, under no other pair's name: a
		// server storing objects as files cannot hold both "x" and "x/y".
		{what: "doubled slash", a: base + "-d/a//b", b: base + "-d/a/b", path: true},
		{what: "dot segment", a: base + "-o/a/./b", b: base + "-o/a/b", path: true},
		{what: "dot-dot segment", a: base + "-u/x/../b", b: base + "-u/b", path: true},
		{what: "trailing slash", a: base + "-t/a/b/", b: base + "-t/a/b", path: true},
		{what: "leading dot segment", a: "./" + base + "-l", b: base + "-l", path: true},
		{what: "leading slash", a: "/" + base + "-r", b: base + "-r", path: true},
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
