package fence

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fencekit/fencekit/fence/internal/testbug"
)

// releaseTimeout bounds the release that Hold makes after the work returns.
const releaseTimeout = 5 * time.Second

// Hold acquires name with a for ttl, runs work, and releases the lease afterwards,
// also when work panics, calls runtime.Goexit, or its context is cancelled.
//
// While work runs, Hold renews the lease every ttl/3. When the lease tells its
// local deadline (leases built on leasekit.Base do), the first renewal comes
// at once if that deadline is nearer than 2ttl/3 away (a grant that answered
// late), and the next ones within a third of the time left before it (a
// drift margin over a third of the ttl), never less than ttl/12 apart. The context passed to work is
// cancelled, with cause ErrLost, as soon as a renewal returns ErrLost or the lease's
// local deadline passes without a confirmed renewal; transient renewal errors are
// retried until then. It is also cancelled when ctx is. The renewals stop
// when work returns or panics, before the release, whatever Release returns.
//
// Hold returns the error of Acquire if the lease was never granted. Otherwise it
// returns work's error, joined with an error matching ErrLost when this lease was
// lost while work ran (or Release found it already lost), and with any other
// Release error. A lease that work released itself is not a loss, and is not
// released again; an end after work returned (a deadline passing while a
// renewal stalls) is not counted as a loss while work ran. A ctx cancelled with cause ErrLost (an outer Hold's lease
// lost) cancels work but does not make this lease's result ErrLost. Work should pass l.Token() to every fenced write: Hold cannot
// stop a process that pauses between checking ctx and writing, the fence can.
func Hold(ctx context.Context, a Acquirer, name string, ttl time.Duration, work func(ctx context.Context, l Lease) error) error {
	if err := checkContext("hold", ctx); err != nil {
		return err
	}
	if a == nil {
		return &InvalidError{Op: "hold", Arg: "acquirer", Reason: "nil"}
	}
	if work == nil {
		return &InvalidError{Op: "hold", Arg: "work", Reason: "nil function"}
	}
	if err := checkTTL("hold", ttl); err != nil {
		return err
	}
	l, err := a.Acquire(ctx, name, ttl)
	if err != nil {
		return err
	}

	workCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// ownLost records the loss of this lease alone: a ctx that ended with
	// ErrLost as its cause (an outer Hold's lease lost) says nothing of it.
	// Only an end while work runs counts: once work has returned, a
	// deadline that passes (a renewal stalled at that moment) is not its
	// loss; the release says whether the lease was still held.
	var ownLost, workReturned, workPanicked atomic.Bool
	markLost := func() {
		if workReturned.Load() {
			return
		}
		ownLost.Store(true)
		cancel(lostError(l))
	}
	// lostNow reports whether the lease's context has ended by a loss; an
	// end with another cause is a release (work released the lease
	// itself), not a loss.
	lostNow := func() bool {
		lc := l.Context()
		return lc.Err() != nil && errors.Is(context.Cause(lc), ErrLost)
	}
	lossSeen := make(chan struct{}) // closed once the loss hook has run
	stopLoss := context.AfterFunc(l.Context(), func() {
		defer close(lossSeen)
		if lostNow() {
			markLost()
		}
	})

	stop, stopCancel := context.WithCancel(context.WithoutCancel(ctx))
	watchdog := make(chan struct{})
	go func() {
		defer close(watchdog)
		renewLoop(ctx, stop, l, ttl, markLost)
	}()
	// The renewals stop when work returns or panics, before the release, so
	// a release that fails cannot leave them running. A renewal in flight is
	// cancelled, not waited for.
	stopRenewals := sync.OnceFunc(func() {
		if testbug.HoldRenewsAfterPanic.Load() && workPanicked.Load() {
			return
		}
		stopCancel()
		<-watchdog
		if !stopLoss() {
			// The lease's context ended and its hook has started: wait
			// for it to finish.
			<-lossSeen
		}
	})
	defer stopRenewals()

	workErr := runWork(workCtx, l, work, stopRenewals, &workPanicked)
	// The context's done channel closes before its AfterFunc hooks start:
	// work can see the end and return before the hook ran. The lease ended
	// while work ran all the same.
	if lostNow() {
		markLost()
	}
	workReturned.Store(true)
	stopRenewals()

	lost := ownLost.Load()
	var relErr error
	if releasable(l) {
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		relErr = l.Release(rctx)
		rcancel()
	}
	if errors.Is(relErr, ErrLost) {
		lost, relErr = true, nil
	}
	var lostErr error
	if lost && !errors.Is(workErr, ErrLost) {
		lostErr = lostError(l)
	}
	return errors.Join(workErr, lostErr, relErr)
}

// releasable reports whether Hold releases l once work has ended: unless
// work released it itself (its context ended with a cause other than
// ErrLost). A lease work released is not released again: the name may be
// another's by then.
func releasable(l Lease) bool {
	lc := l.Context()
	return lc.Err() == nil || errors.Is(context.Cause(lc), ErrLost)
}

func lostError(l Lease) error {
	return fmt.Errorf("fence: lease %q (token %d): %w", l.Name(), l.Token(), ErrLost)
}

// runWork calls work. When work panics, it stops the renewals, releases the
// lease and re-raises the panic, so that it is not swallowed. When work ends
// its goroutine with runtime.Goexit (t.FailNow in a test), it stops the
// renewals and releases the lease too, and the goroutine goes on exiting.
func runWork(ctx context.Context, l Lease, work func(context.Context, Lease) error, stopRenewals func(), panicked *atomic.Bool) (err error) {
	returned := false
	defer func() {
		if returned {
			return
		}
		p := recover() // nil for runtime.Goexit
		if p != nil && testbug.HoldRenewsAfterPanic.Load() {
			panicked.Store(true)
			panic(p)
		}
		stopRenewals()
		if releasable(l) {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
			_ = l.Release(rctx)
			cancel()
		}
		if p != nil {
			panic(p)
		}
	}()
	err = work(ctx, l)
	returned = true
	return err
}

// localDeadliner is a lease that tells its local deadline (leasekit.Base
// does, and so do the leases of every acquirer built on it).
type localDeadliner interface{ LocalDeadline() time.Time }

// localDeadline returns l's local deadline, when l tells it.
func localDeadline(l Lease) (time.Time, bool) {
	d, ok := l.(localDeadliner)
	if !ok {
		return time.Time{}, false
	}
	dl := d.LocalDeadline()
	return dl, !dl.IsZero()
}

// firstRenewal is how long after Hold got l its first renewal is due: a third
// of the ttl (interval), or at once when l's local deadline is nearer than
// two intervals away. A grant whose answer came back late (a loaded machine,
// a retried request) has used part of its lease already; renewing a third of
// the ttl after the answer could then come after the local deadline, and the
// work would be cancelled with nothing failed.
func firstRenewal(l Lease, interval time.Duration) time.Duration {
	dl, ok := localDeadline(l)
	if !ok {
		return interval
	}
	left := time.Until(dl)
	if left <= 2*interval {
		return 0
	}
	return interval
}

// nextRenewal is how long after a confirmed renewal the next is due: a
// third of the ttl (interval), or a third of the time left before l's local
// deadline when that is less (a drift margin over a third of the ttl leaves
// less than two intervals after each renewal), but never sooner than retry,
// so a renewal that is confirmed without moving the deadline does not spin.
func nextRenewal(l Lease, interval, retry time.Duration) time.Duration {
	dl, ok := localDeadline(l)
	if !ok {
		return interval
	}
	return min(interval, max(retry, time.Until(dl)/3))
}

// renewLoop renews l every ttl/3 until stop is done or the lease ends (stop also cancels a renewal in flight). A renewal
// that fails with a transient error is retried sooner; the lease's own local
// deadline ends it if no renewal is confirmed in time.
func renewLoop(ctx, stop context.Context, l Lease, ttl time.Duration, lost func()) {
	interval := ttl / 3
	if interval <= 0 {
		interval = ttl
	}
	retry := interval / 4
	if retry <= 0 {
		retry = interval
	}
	timer := time.NewTimer(firstRenewal(l, interval))
	defer timer.Stop()
	for {
		select {
		case <-stop.Done():
			return
		case <-l.Context().Done():
			return
		case <-timer.C:
		}
		// A lease that ended as the timer fired (both ready, select picked
		// the timer: a first renewal due at once for a grant that answered
		// after its lease was over) is not renewed.
		if l.Context().Err() != nil {
			return
		}
		select {
		case <-stop.Done():
			return
		default:
		}
		rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), interval)
		// Work's return cancels a renewal in flight: the release follows
		// at once, not after a stalled renewal's timeout.
		unhook := context.AfterFunc(stop, rcancel)
		err := l.Renew(rctx)
		unhook()
		rcancel()
		switch {
		case err == nil:
			timer.Reset(nextRenewal(l, interval, retry))
		case errors.Is(err, ErrLost):
			lost()
			return
		default:
			timer.Reset(retry)
		}
	}
}
