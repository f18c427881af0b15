package fence

import (
	"context"
	"time"
)

// LockInfo is what an Inspector reports about a lock name.
type LockInfo struct {
	Name     string        // the lock name inspected
	Held     bool          // whether a lease on the name is live on the backend's clock
	Token    Token         // the holder's token; 0 when the lock is free
	Owner    string        // the holder's owner id, as the backend records it
	TimeLeft time.Duration // until the holder's lease expires, on the backend's clock
	// Counter is the largest token granted for the name so far: every later
	// grant's token is larger.
	Counter Token
}

// Inspector is the optional read side of an acquirer, for operators. Inspect
// returns ErrNotFound for a name never granted.
type Inspector interface {
	Inspect(ctx context.Context, name string) (LockInfo, error)
}

// Bumper is the optional repair of an acquirer's counter: Bump raises the token
// counter of name to at least to, so every later grant's token is larger (for
// example after a Redis failover lost the counter). It never lowers a counter:
// a counter already at or above to returns an error matching ErrInvalid.
type Bumper interface {
	Bump(ctx context.Context, name string, to Token) error
}
