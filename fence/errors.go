package fence

import (
	"context"
	"errors"
	"fmt"
	"time"
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
	// (it expired, was released, or a newer grant exists), by Hold when the
	// lease was lost while the work ran, and by TryAcquire for a grant
	// confirmed only after its local deadline, given back.
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

// checkContext returns an *InvalidError when ctx is nil, for op
// (leasekit.CheckContext for adapters).
func checkContext(op string, ctx context.Context) error {
	if ctx == nil {
		return &InvalidError{Op: op, Arg: "ctx", Reason: "nil context (use context.Background())"}
	}
	return nil
}

// checkTTL returns an *InvalidError when ttl <= 0, for op.
func checkTTL(op string, ttl time.Duration) error {
	if ttl <= 0 {
		return &InvalidError{Op: op, Arg: "ttl", Reason: fmt.Sprintf("%v is not positive", ttl)}
	}
	return nil
}
