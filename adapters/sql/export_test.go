package sqlfence

import (
	"context"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// LineLen returns how many Acquire calls of a wait in name's line.
func LineLen(a *Acquirer, name string) int { return a.line.Len(name) }

// SetLineStall sets how long the head of a's lines may spend in one attempt
// before the waiters behind it try too (wakeup.Line.StallLimit).
func SetLineStall(a *Acquirer, d time.Duration) { a.line.StallLimit = d }

// LineHeadTrying reports whether the head of name's line is inside an
// attempt now.
func LineHeadTrying(a *Acquirer, name string) bool { return a.line.HeadStalled(name, 0) }

// DisableHandoff makes a's releases release only, never grant to the head of
// its line (see transfer.go).
func DisableHandoff(a *Acquirer) { a.transfer = "" }

// LineHeadWaiting reports whether the head of a's line for name has made an
// attempt and now waits between attempts (wakeup.Line.HeadWaiting).
func LineHeadWaiting(a *Acquirer, name string) bool { return a.line.HeadWaiting(name) }

// BellPinned returns how many connections a has pinned for bells (MySQL);
// -1 when a has no bells.
func BellPinned(a *Acquirer) int {
	if a.bells == nil {
		return -1
	}
	a.bells.mu.Lock()
	defer a.bells.mu.Unlock()
	return a.bells.pinned
}

// BellKey returns the GET_LOCK name of name's bell for a (MySQL).
func BellKey(a *Acquirer, name string) string { return a.bells.key(name) }

// BellFree reports whether a's ringer for name keeps a connection that holds
// the bell: for its head's next grant (bell.go's ringer.free), or given back
// by a woken head that found the row held (ringer.held, and the ringer
// watching the row).
func BellFree(a *Acquirer, name string) bool {
	a.bells.mu.Lock()
	defer a.bells.mu.Unlock()
	r := a.bells.names[name]
	return r != nil && (r.free != nil || r.held != nil || r.watching)
}

// BellOff reports whether a's bells were turned off (the server refused
// GET_LOCK).
func BellOff(a *Acquirer) bool { return a.bells.off.Load() }

// GrantWatchMax is how long watchGrant may run: it keeps reading the row
// (each read bounded by its own timeout) for as long as reads fail.
const GrantWatchMax = grantWatchMax

// HintOwner returns a grant owner of a's, as a handoff's hint carries.
func HintOwner(a *Acquirer) string { return a.opts.Owner + nonceSep + nonce() }

// GrantAs grants name as owner (what a handoff or a ringer's grant whose
// reply was lost may have done), keeping no connection.
func GrantAs(ctx context.Context, a *Acquirer, name, owner string, ttl time.Duration) error {
	_, c, err := a.grantRow(ctx, name, owner, ttl)
	if c != nil {
		a.bells.unpin(c, false)
	}
	return err
}

// AcquireHinted runs one attempt of a's Acquire with the hint of a ringer's
// grant of owner whose reply was lost, as the head runs it.
func AcquireHinted(ctx context.Context, a *Acquirer, name, owner string, ttl time.Duration) (fence.Lease, error) {
	return a.tryAcquire(ctx, name, ttl, 0, handHint{owner: owner, sent: time.Now(), ttl: ttl})
}
