package fence

import (
	"context"
	"time"
)

// FencedWriter stores values under keys, fenced by token.
type FencedWriter interface {
	// Write stores value under key unless key has already accepted a larger token.
	// Equal tokens pass, so one grant may write a key many times. A rejected write
	// changes nothing and returns an error e with errors.Is(e, ErrStale); errors.As
	// gives *StaleError with the key, the token offered and the token the key holds.
	// An empty key or a token outside 1..MaxToken returns an error matching ErrInvalid.
	// A write whose outcome cannot be known (a lost response, a 5xx, a broken
	// connection, with nothing at the resource to tell) returns an error matching
	// ErrUnknown, never ErrStale: the value may have landed. Read the key, or write
	// again with the same token, to settle it.
	Write(ctx context.Context, key string, value []byte, token Token) error
}

// Reader is the optional read side of a FencedWriter.
type Reader interface {
	// Read returns the value stored under key and the token that wrote it.
	// A key never written, or deleted, returns ErrNotFound.
	Read(ctx context.Context, key string) (value []byte, token Token, err error)
}

// Deleter is the optional fenced delete of a FencedWriter.
type Deleter interface {
	// Delete removes the value under key unless key has accepted a larger token,
	// and keeps the fence (a tombstone holding token), so a later write with a
	// lower token is still rejected. A rejected delete returns a *StaleError.
	Delete(ctx context.Context, key string, token Token) error
}

// Acquirer grants leases. Every grant carries a token larger than every earlier
// grant's token for the same name; when the name's counter has reached MaxToken,
// Acquire and TryAcquire refuse with an error matching ErrTokensExhausted instead
// of granting a token that is not larger.
type Acquirer interface {
	// Acquire waits until the lease on name is granted. ctx bounds the wait; an
	// acquirer also gives up after its configured maximum wait when ctx has no
	// deadline. Giving up returns an error matching both ErrHeld and the
	// context error (context.DeadlineExceeded or context.Canceled).
	Acquire(ctx context.Context, name string, ttl time.Duration) (Lease, error)

	// TryAcquire grants the lease on name or returns ErrHeld at once. It may
	// also return an error matching ErrLost: the backend granted the name but
	// confirmed it only after the new lease's local deadline had passed (a
	// slow or cut connection), and the acquirer gave it back; it holds
	// nothing, and the name may be free. Never for a name another holds. An
	// acquirer that does not check may instead return such a lease with its
	// Context already done.
	TryAcquire(ctx context.Context, name string, ttl time.Duration) (Lease, error)
}

// Lease is one grant of a lock name.
type Lease interface {
	// Name returns the lock name.
	Name() string

	// Token returns the grant's fencing token.
	Token() Token

	// Context returns a context that is done once the lease is released, lost
	// (Renew or Release returned ErrLost), or past its local deadline without a
	// confirmed renewal. context.Cause gives ErrLost in the last two cases.
	// The local deadline is conservative: it is measured from before the grant
	// (or renewal) request was sent, less a margin for clock drift.
	Context() context.Context

	// Renew extends the lease by its ttl on the backend's clock. It returns an
	// error matching ErrLost when the lease is no longer held; then Context is
	// done. Other errors (a transient backend failure) leave the lease as it was.
	Renew(ctx context.Context) error

	// Release gives the lease up. It is token-checked: a lease that had already
	// expired, or was already released, returns ErrLost and does not touch the
	// next holder's lease. After Release returns, Context is done.
	Release(ctx context.Context) error
}
