// Package leasekit is the local half of a lease, for anyone writing a
// fence.Acquirer for another backend (DynamoDB, ZooKeeper, Consul, ...): the
// name and token, a conservative local deadline, and the lease's lifetime
// context. Every acquirer in this module is built on it.
//
// The rules it keeps, which a correct acquirer needs:
//
//   - The local deadline is measured from before the request that set the
//     lease on the backend (the grant, then each renewal), not from its reply,
//     and a drift margin is taken off: the holder stops believing it holds the
//     lease before the backend can grant it to anyone else, whatever the
//     network delay.
//   - The send times are time.Now() readings with their monotonic clock (see
//     New); expiry itself is decided by the backend on its own clock.
//   - A renewal confirmed after the local deadline has passed never revives the
//     lease: once Context is done, it stays done. The acquirer should not send
//     a renewal for a lease whose Context is done (it would hold the lock on
//     the backend for nobody), and should release one confirmed too late.
//   - Context is done, with cause fence.ErrLost, when the local deadline
//     passes, or with the cause given to End (context.Canceled for a release).
//
// An acquirer's lease type embeds *Base, which provides Name, Token and
// Context; the acquirer calls New after a grant, Extend after each confirmed
// renewal, and End when the lease is released or found lost. Run
// fence/fencetest's AcquirerSuite against the acquirer.
//
// # Helpers for adapters
//
// The other helpers here serve anyone writing an acquirer, a fenced writer or
// an idempotency store; users of fencekit do not need them:
//
//   - Acquire and Retry are the waiting loop of an acquirer's Acquire, paced
//     by the fence.Backoff of its options; CheckBackoff validates that Backoff.
//   - CheckContext, CheckName, CheckKey, CheckText, CheckTTL and CheckToken
//     return the *fence.InvalidError (matching fence.ErrInvalid) for bad
//     input, before any request.
//   - CeilDiv rounds a ttl up to the unit a backend counts in.
package leasekit

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// DefaultDrift is the clock-drift margin taken off a lease's local deadline when an
// adapter's options leave it at zero: 1% of the ttl plus 2ms.
func DefaultDrift(ttl time.Duration) time.Duration { return ttl/100 + 2*time.Millisecond }

// Base is the local half of a lease. It is safe for concurrent use.
// Embed a *Base, made by New, in a lease type.
type Base struct {
	name  string
	token fence.Token
	ttl   time.Duration
	drift time.Duration

	ctx    context.Context
	cancel context.CancelCauseFunc

	mu       sync.Mutex
	ended    bool
	timer    *time.Timer
	deadline time.Time
}

// New returns the local state of a grant of name with token, whose request was sent
// at sent. drift <= 0 means DefaultDrift(ttl).
//
// sent is a time.Now() taken just before the request that set the lease on the
// backend (before its first attempt, when an ambiguous grant is recognised on a
// later attempt: the lease may date from the first one). It should keep its
// monotonic reading: time.Now().UTC(), Round(0), a time parsed or read from a
// backend has none, and a deadline on the wall clock would move with every
// step of it (after a step back the context could stay alive for as long as the
// step). New re-anchors such a time on the monotonic clock, taking the wall
// clock's reading of the time since sent; a sent after the wall clock's now
// (the wall clock stepped back since, or a time from another clock) cannot be
// anchored, and the lease ends at once with cause fence.ErrLost. So does a
// sent after now on the monotonic clock (a time.Now() plus a duration): no
// request was sent then.
//
// The local deadline is only the holder's side. The backend must decide expiry
// on its own clock (a TTL it runs, its own now(), its Date header), never on a
// time the client sends: the drift margin covers clock rates, not offsets.
func New(name string, token fence.Token, ttl, drift time.Duration, sent time.Time) *Base {
	if drift <= 0 {
		drift = DefaultDrift(ttl)
	}
	b := &Base{name: name, token: token, ttl: ttl, drift: drift}
	b.ctx, b.cancel = context.WithCancelCause(context.Background())
	sent, ok := monotonic(sent)
	if !ok {
		b.ended = true // no timer: End and Extend see ended first
		b.cancel(errUnanchored)
		return b
	}
	b.deadline = sent.Add(ttl - drift)
	b.timer = time.AfterFunc(time.Until(b.deadline), b.expire)
	return b
}

// errUnanchored ends a lease whose send time is after now.
var errUnanchored = fmt.Errorf("leasekit: the grant's send time is after now: %w", fence.ErrLost)

// monotonic returns t with a monotonic reading: t itself when it has one;
// otherwise now less the wall clock's time since t. It reports false when t is
// after now (on the monotonic clock when t has a reading, else on the wall
// clock): no request was sent then.
func monotonic(t time.Time) (time.Time, bool) {
	now := time.Now()
	if t != t.Round(0) {
		return t, !t.After(now) // it has a monotonic reading
	}
	since := now.Round(0).Sub(t)
	if since < 0 {
		return time.Time{}, false
	}
	return now.Add(-since), true
}

// Name returns the lock name.
func (b *Base) Name() string { return b.name }

// Token returns the grant's token.
func (b *Base) Token() fence.Token { return b.token }

// TTL returns the lease length.
func (b *Base) TTL() time.Duration { return b.ttl }

// Context is done once End was called or the local deadline passed.
//
// Its Done channel is closed by a timer, which a loaded machine can run late by
// its scheduling delay; the lease's drift margin must cover that delay. Err
// does not wait for the timer: called after the local deadline, it ends the
// lease itself and returns the error, so a holder that checks Err before each
// write never writes past the deadline believing it holds the lease. A context
// derived from this one (context.WithCancel, Hold's work context) learns of the
// end through Done, so the timer's delay applies to it.
func (b *Base) Context() context.Context { return leaseContext{b.ctx, b} }

// LocalDeadline returns the lease's local deadline: when its context ends
// unless a renewal is confirmed first (the zero time for a lease that ended at
// New). fence.Hold reads it to renew a lease whose grant answered late before
// that deadline, rather than a third of the ttl after it got the lease.
func (b *Base) LocalDeadline() time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.deadline
}

// leaseContext is a lease's context whose Err reads the clock.
type leaseContext struct {
	context.Context
	b *Base
}

// Err returns the context's error, ending the lease first when its local
// deadline has passed and the timer has not run yet.
func (c leaseContext) Err() error {
	if err := c.Context.Err(); err != nil {
		return err
	}
	c.b.expire()
	return c.Context.Err()
}

// Extend moves the local deadline after a renewal that the backend confirmed, whose
// request was sent at sent (a time.Now() with its monotonic reading, as for
// New; one without is re-anchored, and one after now leaves the deadline where
// it was). It returns false when the lease had already ended locally: a late
// confirmation never revives a lease whose context is done.
func (b *Base) Extend(sent time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ended || b.ctx.Err() != nil {
		return false
	}
	sent, ok := monotonic(sent)
	if !ok {
		return true
	}
	if d := sent.Add(b.ttl - b.drift); d.After(b.deadline) {
		b.deadline = d
		b.timer.Reset(time.Until(d))
	}
	return true
}

// expire ends the lease when its local deadline has passed. A timer that fired
// just before Extend moved the deadline finds it in the future and does nothing.
func (b *Base) expire() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ended || b.deadline.IsZero() || time.Now().Before(b.deadline) {
		return
	}
	b.ended = true
	b.cancel(fence.ErrLost)
}

// End finishes the lease locally with cause (ErrLost, or context.Canceled for a
// release). Only the first call has an effect.
func (b *Base) End(cause error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ended {
		return
	}
	b.ended = true
	b.timer.Stop()
	b.cancel(cause)
}
