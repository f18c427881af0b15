package leasekit

import (
	"context"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/fencekit/fencekit/fence"
)

// CheckName returns a *fence.InvalidError when name is empty, for op.
func CheckName(op, name string) error {
	if name == "" {
		return &fence.InvalidError{Op: op, Arg: "name", Reason: "empty"}
	}
	return nil
}

// CheckKey returns a *fence.InvalidError when key is empty, for op.
func CheckKey(op, key string) error {
	if key == "" {
		return &fence.InvalidError{Op: op, Arg: "key", Reason: "empty"}
	}
	return nil
}

// CheckText returns a *fence.InvalidError, naming arg and the limit, when s is empty,
// longer than maxBytes bytes (maxBytes > 0), not valid UTF-8, or holds a NUL
// byte: the rules of a backend that stores s as indexed text.
func CheckText(op, arg, s string, maxBytes int) error {
	switch {
	case s == "":
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "empty"}
	case maxBytes > 0 && len(s) > maxBytes:
		return &fence.InvalidError{Op: op, Arg: arg, Reason: fmt.Sprintf("%d bytes, over this backend's limit of %d", len(s), maxBytes)}
	case !utf8.ValidString(s):
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "not valid UTF-8, which this backend needs"}
	case strings.IndexByte(s, 0) >= 0:
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "holds a NUL byte, which this backend cannot store"}
	}
	return nil
}

// CheckContext returns a *fence.InvalidError when ctx is nil, for op.
func CheckContext(op string, ctx context.Context) error {
	if ctx == nil {
		return &fence.InvalidError{Op: op, Arg: "ctx", Reason: "nil context (use context.Background())"}
	}
	return nil
}

// CheckTTL returns a *fence.InvalidError when ttl is below min (and always when ttl
// <= 0) or above max (when max > 0), for op.
func CheckTTL(op string, ttl, min, max time.Duration) error {
	if ttl <= 0 {
		return &fence.InvalidError{Op: op, Arg: "ttl", Reason: fmt.Sprintf("%v is not positive", ttl)}
	}
	if ttl < min {
		return &fence.InvalidError{Op: op, Arg: "ttl", Reason: fmt.Sprintf("%v is below this backend's minimum %v", ttl, min)}
	}
	if max > 0 && ttl > max {
		return &fence.InvalidError{Op: op, Arg: "ttl", Reason: fmt.Sprintf("%v is above this backend's maximum %v", ttl, max)}
	}
	return nil
}

// CheckToken returns a *fence.InvalidError when t is outside 1..fence.MaxToken, for op.
func CheckToken(op string, t fence.Token) error {
	if !t.Valid() {
		return &fence.InvalidError{Op: op, Arg: "token", Reason: fmt.Sprintf("%d is outside 1..%d", uint64(t), uint64(fence.MaxToken))}
	}
	return nil
}

// CeilDiv returns d divided by unit, rounded up, without overflowing for any
// positive d (the lease lengths a backend counts in milliseconds or seconds).
func CeilDiv(d, unit time.Duration) int64 {
	n := d / unit
	if d%unit > 0 {
		n++
	}
	return int64(n)
}
