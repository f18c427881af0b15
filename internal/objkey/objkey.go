// Package objkey checks object names for the object-store adapters. Users
// must not depend on it.
package objkey

import (
	"strings"

	"github.com/fencekit/fencekit/fence"
)

// CheckPath returns a *fence.InvalidError naming arg when the whole object
// name could reach another object on a server that stores names as file
// paths or resolves its URL's path (versitygw's posix backend, MinIO,
// Azure): an empty path segment (a leading or trailing slash, or "//"), or a
// segment "." or "..". Such a server takes "a//b" and "a/./b" for "a/b",
// and "x/../b" for "b", so two keys would share one object; refusing them
// keeps every other name as it was.
func CheckPath(op, arg, name string) error {
	for seg := range strings.SplitSeq(name, "/") {
		switch seg {
		case "":
			return &fence.InvalidError{Op: op, Arg: arg, Reason: "an empty path segment (a slash at either end, or two in a row), which a server storing objects as files drops"}
		case ".", "..":
			return &fence.InvalidError{Op: op, Arg: arg, Reason: "a path segment " + seg + ", which a server storing objects as files resolves"}
		}
	}
	return nil
}

// CheckPrefix returns a *fence.InvalidError naming arg when every name
// under prefix would be refused by CheckPath: prefix is checked as the
// start of a name that goes on after it.
func CheckPrefix(op, arg, prefix string) error {
	if prefix == "" {
		return nil
	}
	return CheckPath(op, arg, prefix+"x")
}
