package fence

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

var (
	// ErrStale is matched (with errors.Is) by every rejected fenced write: the key
	// has already accepted a larger token, and the write changed nothing.
	// errors.As gives a *StaleError.
	ErrStale = errors.New("fence: stale token")

	// ErrHeld is returned by TryAcquire when another holder has the lease, and is
	// joined with the context's error when Acquire gives up waiting.
	ErrHeld = errors.New("fence: lease held by another holder")

	// ErrLost is returned by Renew and Release when the lease is no longer held
	// (it expired, was released, or a newer grant exists), and by Hold when the
	// lease was lost while the work ran.
	ErrLost = errors.New("fence: lease lost")

	// ErrUnknown is matched by a fenced write whose outcome cannot be known: an
	// attempt may have been applied (its response was lost, the connection
	// broke, the server answered 5xx), and what the resource holds now does
	// not tell whether it was. The value may have landed, and may since have
	// been replaced by a newer token's write. Unlike ErrStale, it does not
	// say that nothing changed. Read the key, or write again with the same
	// token, to settle it.
	ErrUnknown = errors.New("fence: write outcome unknown")

	// ErrNotFound is returned by Reader.Read for a key that was never written or
	// was deleted (a deleted key keeps its fence but has no value).
	ErrNotFound = errors.New("fence: not found")

	// ErrInvalid is matched by every error for bad input: an empty name or key, a
	// ttl <= 0, a token outside 1..MaxToken, a table or key not valid for the
	// backend. Such a call never writes anything.
	ErrInvalid = errors.New("fence: invalid argument")

	// ErrTokensExhausted is returned by an acquirer whose counter for a name has
	// reached MaxToken. Tokens never wrap; the name cannot be granted again.
	ErrTokensExhausted = errors.New("fence: token counter exhausted")
)

// StaleError describes a rejected fenced write. It matches ErrStale.
type StaleError struct {
	Key     string // the key that was written
	Offered Token  // the token the write carried
	Current Token  // the token the key held when the write was rejected (> Offered)
}

// Error names the key and both tokens.
func (e *StaleError) Error() string {
	return fmt.Sprintf("fence: stale token for key %q: offered %d, key holds %d", e.Key, e.Offered, e.Current)
}

// Unwrap returns ErrStale, so errors.Is(err, ErrStale) holds.
func (e *StaleError) Unwrap() error { return ErrStale }

// InvalidError describes bad input. It matches ErrInvalid.
type InvalidError struct {
	Op     string // the operation, such as "acquire" or "write"
	Arg    string // the argument, such as "ttl" or "token"
	Reason string // what is wrong with it
}

// Error names the operation, the argument and what is wrong with it.
func (e *InvalidError) Error() string {
	return fmt.Sprintf("fence: %s: invalid %s: %s", e.Op, e.Arg, e.Reason)
}

// Unwrap returns ErrInvalid, so errors.Is(err, ErrInvalid) holds.
func (e *InvalidError) Unwrap() error { return ErrInvalid }

// CheckName returns an *InvalidError when name is empty, for op.
func CheckName(op, name string) error {
	if name == "" {
		return &InvalidError{Op: op, Arg: "name", Reason: "empty"}
	}
	return nil
}

// CheckKey returns an *InvalidError when key is empty, for op.
func CheckKey(op, key string) error {
	if key == "" {
		return &InvalidError{Op: op, Arg: "key", Reason: "empty"}
	}
	return nil
}

// CheckText returns an *InvalidError, naming arg and the limit, when s is empty,
// longer than maxBytes bytes (maxBytes > 0), not valid UTF-8, or holds a NUL
// byte: the rules of a backend that stores s as indexed text.
func CheckText(op, arg, s string, maxBytes int) error {
	switch {
	case s == "":
		return &InvalidError{Op: op, Arg: arg, Reason: "empty"}
	case maxBytes > 0 && len(s) > maxBytes:
		return &InvalidError{Op: op, Arg: arg, Reason: fmt.Sprintf("%d bytes, over this backend's limit of %d", len(s), maxBytes)}
	case !utf8.ValidString(s):
		return &InvalidError{Op: op, Arg: arg, Reason: "not valid UTF-8, which this backend needs"}
	case strings.IndexByte(s, 0) >= 0:
		return &InvalidError{Op: op, Arg: arg, Reason: "holds a NUL byte, which this backend cannot store"}
	}
	return nil
}

// CheckContext returns an *InvalidError when ctx is nil, for op.
func CheckContext(op string, ctx context.Context) error {
	if ctx == nil {
		return &InvalidError{Op: op, Arg: "ctx", Reason: "nil context (use context.Background())"}
	}
	return nil
}

// CheckTTL returns an *InvalidError when ttl is below min (and always when ttl
// <= 0) or above max (when max > 0), for op.
func CheckTTL(op string, ttl, min, max time.Duration) error {
	if ttl <= 0 {
		return &InvalidError{Op: op, Arg: "ttl", Reason: fmt.Sprintf("%v is not positive", ttl)}
	}
	if ttl < min {
		return &InvalidError{Op: op, Arg: "ttl", Reason: fmt.Sprintf("%v is below this backend's minimum %v", ttl, min)}
	}
	if max > 0 && ttl > max {
		return &InvalidError{Op: op, Arg: "ttl", Reason: fmt.Sprintf("%v is above this backend's maximum %v", ttl, max)}
	}
	return nil
}

// CheckToken returns an *InvalidError when t is outside 1..MaxToken, for op.
func CheckToken(op string, t Token) error {
	if !t.Valid() {
		return &InvalidError{Op: op, Arg: "token", Reason: fmt.Sprintf("%d is outside 1..%d", uint64(t), uint64(MaxToken))}
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
