// Package idempotency makes a side effect that cannot be fenced (charging a card,
// sending an email) happen at most once per key, and says plainly when it cannot
// know whether it happened.
//
// # The state machine
//
// Every key has a record at the store. Each change is one atomic
// compare-and-set on the record's state and fence, decided on the store's clock:
//
//		(none) --claim--> claimed --arm--> armed --+--> completed   (result stored, replayed)
//		                     |                      +--> failed      (definitive failure, replayed)
//		                     |                      +--> released    (provably not sent: claim again)
//		                     |                      +--> unknown     (may have happened: never retried blindly)
//		                     +--> released
//
//	  - claimed: an owner holds the key under a lease; the effect has not started.
//	  - armed: recorded durably before the effect is called: from here on, the
//	    effect may have happened.
//	  - completed / failed: the effect's result (or its definitive failure) is
//	    stored and replayed to every later caller with the same key, until the
//	    retention passes.
//	  - released: the effect provably did not happen; the key can be claimed again.
//	  - unknown: the owner crashed or got an ambiguous error after arming, and no
//	    Reconcile hook could tell whether the effect happened. An operator
//	    resolves it ([Resolve]); Do never runs the effect again on its own.
//
// Every claim and takeover raises the record's fence, and every later change is
// conditional on it, so an owner that was taken over cannot complete, release or
// renew the key: it gets fence.ErrStale.
package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// State is a record's state.
type State string

// The states of a record.
const (
	Claimed   State = "claimed"
	Armed     State = "armed"
	Completed State = "completed"
	Failed    State = "failed"
	Released  State = "released"
	Unknown   State = "unknown"
)

// Record is a key's record as the store holds it.
type Record struct {
	// Key is the idempotency key, as the caller gave it.
	Key string
	// Fingerprint is what the claim said the request was; a later call with
	// the same key and another fingerprint gets ErrFingerprintMismatch.
	Fingerprint string
	// State is where the record is in its state machine.
	State State
	// Fence is the claim's fence: it grows with every takeover and never goes
	// down for a key, so an older owner's update is refused.
	Fence fence.Token
	// Owner is the claim's owner. Do records Options.Owner, "#" and a random
	// nonce of the claim, so that no two claims share an owner.
	Owner string
	// LeaseLeft is how long the owner's lease has left, on the store's clock
	// when the record was read; zero or less when it has expired.
	LeaseLeft time.Duration
	// InProgressFor is how long the current owner has held the key, on the
	// store's clock.
	InProgressFor time.Duration
	// Result is the stored result (completed) or failure message (failed).
	Result []byte
	// ResultDropped reports a completed record whose result was over the size
	// limit: the effect happened, but its result cannot be replayed.
	ResultDropped bool
}

// Change is the new content of a record in Store.Update.
type Change struct {
	State State       // the new state
	Fence fence.Token // the new fence: the same, or larger on a takeover
	Owner string      // the new owner (see Record.Owner)
	// Lease is the new lease, from now on the store's clock (claimed, armed).
	Lease time.Duration
	// Result is stored with completed and failed.
	Result []byte
	// ResultDropped marks a completed record whose result was over the size
	// limit and is not stored (see Record.ResultDropped).
	ResultDropped bool
	// Retention keeps a completed or failed record this long, then Purge
	// removes it and the key may be claimed anew.
	Retention time.Duration
	// Restart resets InProgressFor (a takeover by a new owner).
	Restart bool
}

// Store holds the records. Each method is one atomic step at the store, decided
// on the store's clock. The suite in idempotencytest checks a Store.
type Store interface {
	// Begin claims key for owner with a lease, if the key has no record, or a
	// released one, or one past its retention: the new record has a fence
	// larger than any the key had before, also when an earlier record was
	// removed by Purge or by the store's own expiry, and created is true.
	// Otherwise it changes nothing and returns the existing record with
	// created false.
	//
	// The stores in this module keep that promise without keeping removed
	// records: a fence is never below the store's clock in microseconds at the
	// moment it was granted (a new record starts there), so it holds as long as
	// the store's clock does not step back by more than the time since the
	// earlier fence was granted, which is at least the removed record's
	// retention or lease. Expiry of leases already trusts the same clock.
	Begin(ctx context.Context, key, fingerprint, owner string, lease time.Duration) (rec Record, created bool, err error)

	// Update replaces the record of key with change if and only if it is in
	// state from and holds fence fromFence. A record holding another fence
	// returns a *fence.StaleError; another state returns ErrStateChanged; no
	// record returns fence.ErrNotFound.
	Update(ctx context.Context, key string, from State, fromFence fence.Token, change Change) (Record, error)

	// Get returns the record of key, or fence.ErrNotFound.
	Get(ctx context.Context, key string) (Record, error)

	// Purge removes completed and failed records past their retention, and
	// released ones, and returns how many it removed. A key claimed again
	// after its record was removed gets a larger fence than it ever had.
	Purge(ctx context.Context) (int, error)
}

// Notifier is implemented by stores that can wake a Do waiting for a key, so
// Wait does not rely on polling alone.
type Notifier interface {
	// Subscribe returns a channel that receives after key's record may have
	// changed, and the function that ends the subscription.
	Subscribe(key string) (<-chan struct{}, func())
}

var (
	// ErrFingerprintMismatch: the key was used before with a different request
	// (the HTTP analogue is 422).
	ErrFingerprintMismatch = errors.New("idempotency: key reused with a different request")
	// ErrInProgress: another owner holds the key (409). errors.As gives an
	// *InProgressError with the time left on its lease.
	ErrInProgress = errors.New("idempotency: key in progress elsewhere")
	// ErrUnknown: the effect may or may not have happened, and nothing could
	// tell; the key stays unknown until an operator resolves it.
	ErrUnknown = errors.New("idempotency: effect outcome unknown")
	// ErrFailed: the effect failed definitively; the failure is replayed.
	ErrFailed = errors.New("idempotency: effect failed")
	// ErrStateChanged: Update found the record in another state.
	ErrStateChanged = errors.New("idempotency: record changed state")
	// ErrNotRecorded: the effect completed but its result could not be
	// recorded; the record stays armed (a later caller reconciles it). When
	// the error also matches fence.ErrUnknown, a completion whose reply never
	// came may still land: the record then becomes completed with the result.
	ErrNotRecorded = errors.New("idempotency: completion not recorded")
	// ErrResultNotStored: the key completed, but its result was over the size
	// limit and was not kept, so it cannot be replayed.
	ErrResultNotStored = errors.New("idempotency: completed, result too large to keep")
)

// InProgressError reports a key held by another owner.
type InProgressError struct {
	Key   string // the key asked for
	Owner string // the owner holding it (see Record.Owner)
	// LeaseLeft is the time left on that owner's lease, on the store's clock:
	// a retry after it may take the key over.
	LeaseLeft time.Duration
}

// Error names the key, its owner and the time left on its lease.
func (e *InProgressError) Error() string {
	return fmt.Sprintf("idempotency: key %q in progress (owner %s, lease %v left)", e.Key, e.Owner, e.LeaseLeft.Round(time.Millisecond))
}

// Unwrap returns ErrInProgress.
func (e *InProgressError) Unwrap() error { return ErrInProgress }

// FailedError is a replayed definitive failure.
type FailedError struct {
	Key     string // the key asked for
	Message string // the recorded failure's message (the effect's Definitive error)
}

// Error names the key and the replayed failure.
func (e *FailedError) Error() string {
	return fmt.Sprintf("idempotency: key %q failed: %s", e.Key, e.Message)
}

// Unwrap returns ErrFailed.
func (e *FailedError) Unwrap() error { return ErrFailed }

// StateError reports an Update that found the record in another state.
type StateError struct {
	Key string // the record's key
	// Want is the state the Update expected, Got the state the record was in.
	Want, Got State
}

// Error names the key and both states.
func (e *StateError) Error() string {
	return fmt.Sprintf("idempotency: key %q is %s, not %s", e.Key, e.Got, e.Want)
}

// Unwrap returns ErrStateChanged.
func (e *StateError) Unwrap() error { return ErrStateChanged }
