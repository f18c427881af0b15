package redislua

import (
	"strings"

	"github.com/fencekit/fencekit/fence"
)

// DefaultPrefix starts every key this package writes, unless options say otherwise.
const DefaultPrefix = "fence:"

// checkPrefix refuses a prefix with braces: the hash tag that follows must be the
// first one in the key.
func checkPrefix(op, prefix string) error {
	if strings.ContainsAny(prefix, "{}") {
		return &fence.InvalidError{Op: op, Arg: "prefix", Reason: "contains { or }, which would move the hash tag"}
	}
	return nil
}

// checkTagged refuses a name or key that cannot sit inside a hash tag.
func checkTagged(op, arg, s string) error {
	if s == "" {
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "empty"}
	}
	if strings.ContainsAny(s, "{}") {
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "contains { or }, which Redis Cluster reads as a hash tag"}
	}
	return nil
}

// lockKeys returns the lock key and the token counter key of name, which share
// the hash tag {name} and so one Cluster slot.
func lockKeys(prefix, name string) (lock, counter string) {
	base := prefix + "{" + name + "}"
	return base + ":lock", base + ":token"
}
