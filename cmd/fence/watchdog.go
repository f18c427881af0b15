package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// faultyAcquirer wraps the backend's acquirer to play what a holder's process
// goes through: its renewals can freeze (the whole process is paused) or fail
// (the lock backend is unreachable from this holder).
type faultyAcquirer struct {
	fence.Acquirer
	frozen  atomic.Pointer[chan struct{}] // non-nil: Renew waits until the channel is closed
	failing atomic.Bool                   // Renew fails with a transient error
	renews  atomic.Int32
}

type faultyLease struct {
	fence.Lease
	f *faultyAcquirer
}

func (f *faultyAcquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	l, err := f.Acquirer.Acquire(ctx, name, ttl)
	if err != nil {
		return nil, err
	}
	return &faultyLease{l, f}, nil
}

// LocalDeadline is the wrapped lease's, so that fence.Hold renews a grant
// that answered late in time (every demo backend's lease tells it).
func (l *faultyLease) LocalDeadline() time.Time {
	if d, ok := l.Lease.(interface{ LocalDeadline() time.Time }); ok {
		return d.LocalDeadline()
	}
	return time.Time{}
}

func (l *faultyLease) Renew(ctx context.Context) error {
	if ch := l.f.frozen.Load(); ch != nil {
		<-*ch
	}
	if l.f.failing.Load() {
		return errors.New("connection refused (simulated)")
	}
	err := l.Lease.Renew(ctx)
	if err == nil {
		l.f.renews.Add(1)
	}
	return err
}

// freeze pauses the "process": renewals wait until the returned resume is called.
func (f *faultyAcquirer) freeze() (resume func()) {
	ch := make(chan struct{})
	f.frozen.Store(&ch)
	return func() { f.frozen.Store(nil); close(ch) }
}

// watchdog: what Hold does for a slow step inside the work, for a holder cut
// off from the lock backend, and what it cannot do for a holder paused whole.
func (d *demo) watchdog(ctx context.Context) error {
	d.printf("4. The watchdog (fence.Hold renews every ttl/3 and cancels the work when it cannot)\n")
	for _, sc := range []struct {
		title string
		run   func(context.Context, string) error
	}{
		{"a. A slow step inside A's work loop, the watchdog running", d.slowStep},
		{"b. A cut off from the lock backend during a slow step", d.cutOff},
		{"c. The whole of A paused between its check and its write (or its write delayed on the way)", d.wholePause},
	} {
		d.printf("   %s\n", sc.title)
		name := fmt.Sprintf("watchdog-%d", time.Now().UnixNano())
		if err := sc.run(ctx, name); err != nil {
			return err
		}
	}
	return nil
}

// watchdogRun is what one watchdog scenario saw.
type watchdogRun struct {
	f        *faultyAcquirer
	log      *storageLog
	bWrote   chan struct{} // closed once B's write is done (or B failed)
	bArrived time.Time     // when B asked for the lock (A holding it)
	bGranted time.Time     // when B was granted the lock
	holdErr  error         // what A's fence.Hold returned
	final    []byte        // the stored value at the end
}

// raceB runs A's work under fence.Hold (through a faultyAcquirer) while B arrives
// once A's work has started (A holds the lock), waits for the lock, writes and
// releases. It prints the storage log and the final value.
func (d *demo) raceB(ctx context.Context, name string, work func(ctx context.Context, l fence.Lease, r *watchdogRun) error) (*watchdogRun, error) {
	r := &watchdogRun{f: &faultyAcquirer{Acquirer: d.b.acq}, log: &storageLog{}, bWrote: make(chan struct{})}
	bDone := make(chan error, 1)
	aHolds, holdReturned := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(r.bWrote)
		select {
		case <-aHolds:
		case <-holdReturned: // A never got the lock: B still runs, alone
		}
		r.bArrived = time.Now()
		l, err := d.b.acq.Acquire(ctx, name, d.lease)
		if err != nil {
			bDone <- fmt.Errorf("client B: %w", err)
			return
		}
		r.bGranted = time.Now()
		bDone <- errors.Join(d.fencedWrite(ctx, r.log, name, "B", l.Token()), l.Release(ctx))
	}()
	r.holdErr = fence.Hold(ctx, r.f, name, d.lease, func(ctx context.Context, l fence.Lease) error {
		close(aHolds)
		return work(ctx, l, r)
	})
	close(holdReturned)
	if err := <-bDone; err != nil {
		return nil, err
	}
	return r, nil
}

// report prints the storage log and the final value.
func (d *demo) report(ctx context.Context, name string, r *watchdogRun) error {
	for _, e := range r.log.entries {
		d.printf("     storage: %s\n", e)
	}
	final, _, err := d.b.fenced.Read(ctx, name)
	if err != nil {
		return err
	}
	r.final = final
	d.printf("     final value: %q\n", final)
	return nil
}

// fencedWrite writes "written by who" with tok and logs the outcome; a stale
// rejection is logged, not returned.
func (d *demo) fencedWrite(ctx context.Context, log *storageLog, key, who string, tok fence.Token) error {
	value := []byte("written by " + who)
	err := d.b.fenced.Write(ctx, key, value, tok)
	var se *fence.StaleError
	switch {
	case err == nil:
		log.add("ok        %-14q token %d", value, tok)
	case errors.As(err, &se):
		log.add("REJECTED  %-14q token %d (the key already holds token %d)", value, tok, se.Current)
		return nil
	}
	return err
}

// slowStep: A's work stalls in one step for longer than the lease; Hold keeps
// renewing, so B waits until A is done. No overlap, no stale write.
func (d *demo) slowStep(ctx context.Context, name string) error {
	var aDone time.Time
	r, err := d.raceB(ctx, name, func(ctx context.Context, l fence.Lease, r *watchdogRun) error {
		select { // the slow step: a call that honours ctx
		case <-time.After(d.stall):
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		err := d.fencedWrite(ctx, r.log, name, "A", l.Token())
		aDone = time.Now()
		return err
	})
	if err == nil {
		err = r.holdErr
	}
	if err != nil {
		return err
	}
	d.printf("     A's watchdog renewed the lease %d times during the %v step; B was granted %v after it arrived, once A had finished.\n",
		r.f.renews.Load(), d.stall, r.bGranted.Sub(r.bArrived).Round(10*time.Millisecond))
	if err := d.report(ctx, name, r); err != nil {
		return err
	}
	d.check(r.bGranted.After(aDone) && string(r.final) == "written by B" && len(r.log.entries) == 2 && r.f.renews.Load() >= 2,
		"the watchdog kept A's lease through the slow step: B waited, and both writes were accepted in order")
	return nil
}

// cutOff: A's renewals fail while its slow step runs; when the lease's local
// deadline passes, Hold cancels A's work before it writes. The step lasts until
// B has written: a watchdog that did not cancel A would let it write after B.
func (d *demo) cutOff(ctx context.Context, name string) error {
	var (
		cause   error
		byClock bool // the lease's clock told A, before the timer cancelled its ctx
	)
	r, err := d.raceB(ctx, name, func(ctx context.Context, l fence.Lease, r *watchdogRun) error {
		r.f.failing.Store(true)
		select {
		case <-r.bWrote:
			// "Do I still hold the lock?", asked of the lease's clock
			// before the write: its Err does not wait for the timer that
			// cancels ctx, which a loaded machine runs late (a loaded run
			// saw B write first and A's ctx still live). B was granted
			// only after A's lease expired on the backend, so after A's
			// local deadline: A learns here that it lost the lease.
			if ctx.Err() != nil || l.Context().Err() != nil {
				cause = context.Cause(ctx)
				if cause == nil {
					cause, byClock = context.Cause(l.Context()), true
				}
				return nil
			}
			return d.fencedWrite(ctx, r.log, name, "A", l.Token())
		case <-ctx.Done():
			cause = context.Cause(ctx)
			return nil // A stops: it never writes
		}
	})
	if err != nil {
		return err
	}
	how := "A's work context was cancelled"
	if byClock {
		how = "A's check of its lease's clock found it lost (the timer that cancels its work context had not run yet)"
	}
	d.printf("     %s (cause: %s) before its write; Hold returned: %s\n", how, result(cause), result(r.holdErr))
	if err := d.report(ctx, name, r); err != nil {
		return err
	}
	what := "Hold cancelled A's work when its lease could not be renewed; A never wrote"
	if byClock {
		what = "A's lease, not renewed, was lost by its own clock before its write, and Hold returned the loss; A never wrote"
	}
	d.check(errors.Is(cause, fence.ErrLost) && errors.Is(r.holdErr, fence.ErrLost) && len(r.log.entries) == 1 && string(r.final) == "written by B", what)
	return nil
}

// wholePause: A checks that it still holds the lock, then the whole process
// pauses (renewals too) past the lease. B takes over and writes. A wakes and
// writes at once: no watchdog can catch that, and the fence rejects it.
func (d *demo) wholePause(ctx context.Context, name string) error {
	var aWrote time.Time
	r, err := d.raceB(ctx, name, func(ctx context.Context, l fence.Lease, r *watchdogRun) error {
		if ctx.Err() != nil { // "do I still hold the lock?" yes
			return context.Cause(ctx)
		}
		// The write is on its way: a request already sent cannot be called back by
		// cancelling ctx, so it is not tied to the lease's context.
		inFlight := context.WithoutCancel(ctx)
		resume := r.f.freeze() // the process stops here: work and watchdog alike
		<-r.bWrote             // until B, granted after A's lease expired, has written
		resume()
		aWrote = time.Now()
		return d.fencedWrite(inFlight, r.log, name, "A", l.Token())
	})
	if err != nil {
		return err
	}
	bFirst := r.bGranted.Before(aWrote)
	d.printf("     B was granted while A was paused: %v; A's write went out as it woke; Hold returned: %s\n", bFirst, result(r.holdErr))
	if err := d.report(ctx, name, r); err != nil {
		return err
	}
	rejected := len(r.log.entries) == 2 && strings.HasPrefix(r.log.entries[1], "REJECTED")
	d.check(bFirst && rejected && errors.Is(r.holdErr, fence.ErrLost) && string(r.final) == "written by B",
		"the watchdog could not stop a paused process, but the fence rejected A's stale write")
	return nil
}
