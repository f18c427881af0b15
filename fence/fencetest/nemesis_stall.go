package fencetest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/nemesisrun"
)

// spanStart records the start of a fault span of client (-1: the backend's
// not-run window).
func (h *history) spanStart(client int) *nemesisrun.Span {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.spans.Start(client, h.now())
}

// spanEnd records the end of sp, if it has not ended.
func (h *history) spanEnd(sp *nemesisrun.Span) {
	h.mu.Lock()
	defer h.mu.Unlock()
	sp.End(h.now())
}

// stallBounds are the margins of the stall check: latency, the most a
// request without a partition may take to land after its call returned;
// settle, how long after its last obstacle (a partition of its client, a
// not-run window) a step that gives a name back (a waiter's leave, a
// TryAcquire's cleanup) may take to land; expiry, how long past a lease's
// ttl the backend may hold a name nobody renewed.
type stallBounds struct {
	latency, settle, expiry time.Duration
}

// heldUntil is when a request that client sent before t may land at the
// latest (see nemesisrun.Spans.HeldUntil).
func (h *history) heldUntil(client int, t time.Duration, b stallBounds) time.Duration {
	return h.spans.HeldUntil(client, t, b.latency)
}

// settledBy is when a step that client starts at t to give a name back (a
// waiter's leave, a TryAcquire's cleanup) has landed at the latest (see
// nemesisrun.Spans.SettledBy).
func (h *history) settledBy(client int, t time.Duration, b stallBounds) time.Duration {
	return h.spans.SettledBy(client, t, b.latency, b.settle)
}

// refusal reports whether err is the backend's answer that the name is held:
// ErrHeld, neither in doubt (ErrUnknown) nor cut short by the call's context
// (a call that ran out of time with its own grant in flight answers ErrHeld
// joined with the context's error once it gave that grant back: its own
// grant may have held the name, so it is in doubt, not a refusal).
func refusal(err error) bool {
	return errors.Is(err, fence.ErrHeld) && !errors.Is(err, fence.ErrUnknown) &&
		!errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled)
}

// inDoubt reports whether op, a grant call that returned without a lease,
// may have made a grant all the same: an error other than ErrInvalid and a
// TryAcquire's refusal.
func inDoubt(op *nemOp) bool {
	return op.err != nil && !errors.Is(op.err, fence.ErrInvalid) && !(op.kind == "TryAcquire" && refusal(op.err))
}

// stallBounds returns the margins of the stall check for s.
func (s NemesisSuite) stallBounds() stallBounds {
	ttl := s.ShortTTL
	return stallBounds{latency: ttl/6 + 10*time.Millisecond, settle: ttl/3 + s.ExpiryLag, expiry: s.ExpiryLag + ttl/6}
}

// prober tries a name, with the Direct acquirer, shortly after a grant call
// of unknown outcome on it has been given back by the stall check's bounds
// (settledBy): the stretch where a give-back that did not land (a leave
// taken as done though the backend did not run it, a cleanup that gave up
// before a held grant request landed) holds the name for nobody. The
// clients alone seldom try the name then. Its grants are released at once.
type prober struct {
	s  NemesisSuite
	h  *history
	a  fence.Acquirer
	id int // its client id in the history: after the clients'
	wg sync.WaitGroup
}

// after starts the probes that follow op, a grant call of unknown outcome:
// once settledBy of op's return has passed (recomputed as partitions and
// not-run windows end), at a twentieth, a sixth and a third of the ttl past
// it, while the run lasts.
func (p *prober) after(op *nemOp) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		ttl, b := p.s.ShortTTL, p.s.stallBounds()
		for {
			p.h.mu.Lock()
			end := p.h.settledBy(op.client, op.ret, b)
			p.h.mu.Unlock()
			wait := end - p.h.now()
			if wait <= 0 {
				break
			}
			if p.h.now()+min(wait, ttl/10) >= p.s.Duration {
				return
			}
			time.Sleep(min(wait, ttl/10)) // until the bound, recomputed: a span may end or begin
		}
		from := p.h.now()
		for _, d := range []time.Duration{ttl / 20, ttl / 6, ttl / 3} {
			at := from + d
			if at >= p.s.Duration {
				return
			}
			time.Sleep(at - p.h.now()) // the probe's time, not a synchronisation
			ctx, cancel := context.WithTimeout(context.Background(), ttl)
			pop := p.h.begin(p.id, "TryAcquire", op.name, 0, "")
			l, err := p.a.TryAcquire(ctx, op.name, ttl)
			cancel()
			if rec := p.h.granted(pop, l, err); rec != nil {
				ctx, cancel := context.WithTimeout(context.Background(), ttl)
				rop := p.h.releasing(p.id, rec)
				p.h.end(rop, l.Release(ctx))
				cancel()
				return // the name was free
			}
		}
	}()
}

// checkStalls reports a TryAcquire refused (ErrHeld) while, by the
// history, nothing could hold its name: no lease whose grant had been asked
// for and that was not yet released, or past its last renewal that may
// have landed by a ttl and the expiry margin; and no grant call of unknown
// outcome (a lost reply, or a wait that gave up) whose give-back may not
// have landed yet (settledBy); with splitVotes, also no other refused
// TryAcquire whose give-back may not have landed yet (NemesisSuite.SplitVotes).
// A name held by nobody for a ttl after a waiter left or a TryAcquire's reply
// was lost fails it: HAZARDS class 6.
func (h *history) checkStalls(fail func(string, ...any), ttl time.Duration, b stallBounds, splitVotes bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	holds := map[string][]holdSpan{}
	for _, op := range h.ops {
		if op.client < 0 || (op.kind != "TryAcquire" && op.kind != "Acquire") || op.ret < 0 {
			continue
		}
		if op.err == nil && op.lease != nil {
			holds[op.name] = append(holds[op.name], holdSpan{op.call, h.leaseEnd(op.lease, ttl, b), op})
			continue
		}
		if !inDoubt(op) {
			if splitVotes && op.kind == "TryAcquire" && refusal(op.err) {
				// A grant on a majority refused: it may have locked a
				// minority of the servers, which refuses a contender
				// until its give-back lands (a split vote).
				holds[op.name] = append(holds[op.name], holdSpan{op.call, h.settledBy(op.client, op.ret, b), op})
			}
			continue
		}
		// A grant that may have been made for this call: given back by
		// settledBy.
		holds[op.name] = append(holds[op.name], holdSpan{op.call, h.settledBy(op.client, op.ret, b), op})
	}
	n := 0
	for _, op := range h.ops {
		if op.client < 0 || op.kind != "TryAcquire" || op.ret < 0 || !refusal(op.err) {
			continue
		}
		covered := false
		for _, v := range holds[op.name] {
			if v.op != op && v.from <= op.ret && v.to >= op.call { // a refusal does not account for itself
				covered = true
				break
			}
		}
		if !covered {
			if n++; n <= 5 {
				fail("liveness: client %d's TryAcquire of %q at %v..%v was refused (%v) although no lease could hold the name then and every grant in doubt had been given back: a name held by nobody (the test process ran up to %v late in the ttl before)%s",
					op.client, op.name, op.call.Round(time.Microsecond), op.ret.Round(time.Microsecond), op.err,
					h.lags.In(op.call-ttl, op.ret).Round(time.Microsecond), h.nearStall(op, holds[op.name], ttl))
			}
		}
	}
	if n > 5 {
		fail("liveness: ... and %d more refusals of a name held by nobody", n-5)
	}
}

// holdSpan is when a grant call (op) may have held its name, by the stall
// check's bounds.
type holdSpan struct {
	from, to time.Duration
	op       *nemOp
}

// nearStall describes, for a refusal (op) the stall check reports, what
// might have held the name: the spans of its grants that ended within a ttl
// before the refusal, and every call on the name from a ttl before it to its
// end; h.mu is held.
func (h *history) nearStall(op *nemOp, spans []holdSpan, ttl time.Duration) string {
	var b strings.Builder
	for _, v := range spans {
		if v.to < op.call && v.to >= op.call-ttl {
			fmt.Fprintf(&b, "\n    held by the check until %v: ", v.to.Round(time.Microsecond))
			h.opLine(&b, v.op)
		}
	}
	b.WriteString("\n    calls on the name from a ttl before:")
	for _, o := range h.ops {
		if o.name == op.name && o.call <= op.ret && (o.ret < 0 || o.ret >= op.call-ttl) {
			b.WriteString("\n      ")
			h.opLine(&b, o)
		}
	}
	return b.String()
}

// leaseEnd is when l may stop holding its name at the latest: the return of
// a Release that succeeded, or else a ttl and the expiry margin past the
// latest renewal (or the grant) that may have landed.
func (h *history) leaseEnd(l *leaseRec, ttl time.Duration, b stallBounds) time.Duration {
	last := max(l.granted, l.renewedUntil)
	for _, op := range h.ops {
		if op.name != l.name || op.token != l.token || op.client != l.client || op.ret < 0 {
			continue
		}
		switch {
		case op.kind == "Release" && op.err == nil:
			return op.ret
		case op.kind != "Renew":
		case op.err == nil:
			last = max(last, op.ret)
		default:
			// Also a Renew that returned ErrLost: its renewal may have
			// landed after the local deadline, holding the name until
			// the give-back that Renew sends before it returns (or, if
			// that fails, for a ttl).
			last = max(last, h.heldUntil(op.client, op.ret, b))
		}
	}
	return last + ttl + b.expiry
}
