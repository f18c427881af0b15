package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/nemesisrun"
)

// The moments at which the nemesis ends a caller's context while its Do
// holds a claim whose effect has not started.
const (
	leaveClaim = "claim" // as the reply of its claim (or takeover) comes
	leaveArm   = "arm"   // as its arm is about to be sent
)

// spanStart records the start of a partition of client.
func (h *idemHistory) spanStart(client int) *nemesisrun.Span {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.spans.Start(client, h.now())
}

// spanEnd records the heal of sp, if it has not healed.
func (h *idemHistory) spanEnd(sp *nemesisrun.Span) {
	h.mu.Lock()
	defer h.mu.Unlock()
	sp.End(h.now())
}

// stallBounds are the margins of the stall check: latency, the most a
// request may take to land after its call returned, partitions aside;
// settle, how long after its last partition a give-back that Do sends
// again until the store answers may take to land; expiry, how long past a
// lease the store may still report a claim nobody renewed as live.
type stallBounds struct {
	latency, settle, expiry time.Duration
}

// stallBounds returns the margins of the stall check for s.
func (s NemesisSuite) stallBounds() stallBounds {
	return stallBounds{latency: s.Lease/6 + 10*time.Millisecond, settle: s.Lease / 3, expiry: s.Lease / 6}
}

// heldUntil is when a request that client sent before t may land at the
// latest (see nemesisrun.Spans.HeldUntil). Called with h.mu held.
func (h *idemHistory) heldUntil(client int, t time.Duration, b stallBounds) time.Duration {
	return h.spans.HeldUntil(client, t, b.latency)
}

// settledBy is when a give-back that client started by t (and sends again
// until the store answers) has landed at the latest (see
// nemesisrun.Spans.SettledBy). Called with h.mu held.
func (h *idemHistory) settledBy(client int, t time.Duration, b stallBounds) time.Duration {
	return h.spans.SettledBy(client, t, b.latency, b.settle)
}

// claimTrace is what the store saw of one Do's claims: the owners of the
// claims and takeovers it sent, and what became of the last of them.
type claimTrace struct {
	owners []string // in the order they were first sent
	// About the last owner:
	answered   bool          // its claim's (or takeover's) reply came: Do knew it held the key
	armSent    bool          // an arm under it was sent
	left       bool          // the nemesis ended the caller's context at its reply or its arm
	seen       bool          // after that, a read found the key claimed or armed under it
	released   bool          // a release under it returned without error
	releasedAt time.Duration // when that release returned
}

// last is the owner of the trace's last claim, "" if none was sent.
func (t *claimTrace) last() string {
	if len(t.owners) == 0 {
		return ""
	}
	return t.owners[len(t.owners)-1]
}

// nemCall is what a client's store learns of the Do it serves, from the
// context: its op, and how to end its caller's context.
type nemCall struct {
	h     *idemHistory
	op    *doOp
	leave context.CancelFunc
	once  sync.Once
}

type nemCallKey struct{}

// callOf returns the nemCall that ctx carries, or nil. Contexts Do detaches
// from the caller's keep it.
func callOf(ctx context.Context) *nemCall {
	nc, _ := ctx.Value(nemCallKey{}).(*nemCall)
	return nc
}

// claiming records that a claim or takeover under owner is about to be sent.
func (nc *nemCall) claiming(owner string) {
	if nc == nil {
		return
	}
	nc.h.mu.Lock()
	defer nc.h.mu.Unlock()
	if nc.h.owners[owner] != nil {
		return // a resend of the same claim
	}
	nc.h.owners[owner] = nc.op
	nc.op.claims = claimTrace{owners: append(nc.op.claims.owners, owner)}
}

// answered records that the reply of owner's claim came: Do holds the key.
// The caller leaves now when its op says so.
func (nc *nemCall) answered(owner string) {
	if nc == nil {
		return
	}
	nc.h.mu.Lock()
	t := &nc.op.claims
	mine := t.last() == owner
	t.answered = t.answered || mine
	leave := mine && nc.op.leaveAt == leaveClaim
	nc.h.mu.Unlock()
	if leave {
		nc.leaveNow()
	}
}

// arming records that an arm under owner is about to be sent; the caller
// leaves first when its op says so.
func (nc *nemCall) arming(owner string) {
	if nc == nil {
		return
	}
	nc.h.mu.Lock()
	t := &nc.op.claims
	mine := t.last() == owner
	t.armSent = t.armSent || mine
	leave := mine && t.answered && nc.op.leaveAt == leaveArm
	nc.h.mu.Unlock()
	if leave {
		nc.leaveNow()
	}
}

// leaveNow ends the caller's context, once.
func (nc *nemCall) leaveNow() {
	nc.once.Do(func() {
		nc.h.mu.Lock()
		nc.op.claims.left = true
		nc.h.mu.Unlock()
		nc.leave()
	})
}

// read records a read that found rec: after the caller left, the key
// claimed or armed under the last owner.
func (nc *nemCall) read(rec idempotency.Record) {
	if nc == nil {
		return
	}
	nc.h.mu.Lock()
	defer nc.h.mu.Unlock()
	t := &nc.op.claims
	if t.left && rec.Owner == t.last() && (rec.State == idempotency.Claimed || rec.State == idempotency.Armed) {
		t.seen = true
	}
}

// released records a release under owner that returned without error.
func (nc *nemCall) released(owner string) {
	if nc == nil {
		return
	}
	nc.h.mu.Lock()
	defer nc.h.mu.Unlock()
	if t := &nc.op.claims; t.last() == owner && !t.released {
		t.released, t.releasedAt = true, nc.h.now()
	}
}

// gaveBack reports whether op's last claim was given back, by the store's
// answer or by what Do promises: a release under it returned without error;
// or the caller left while Do held it, before the effect started (at the
// claim's reply, or at the arm with a read after it that found the key still
// claimed or armed under it), and Do then frees the key before it returns.
// It returns when the give-back was started at the latest. Called with h.mu
// held.
func (op *doOp) gaveBack() (bool, time.Duration) {
	t := &op.claims
	switch {
	case t.released:
		return true, max(op.ret, t.releasedAt)
	case t.answered && t.left && len(op.runs) == 0 && (!t.armSent || t.seen):
		return true, op.ret
	}
	return false, 0
}

// claimEnd is when the claim of op under owner cannot be live any more, by
// the history, and why: the give-back's settle bound when it was given
// back (gaveBack), else a lease and the expiry margin past the latest moment
// a request of op (its claim, arm or last renewal) may have landed. Called
// with h.mu held.
func (h *idemHistory) claimEnd(op *doOp, owner string, lease time.Duration, b stallBounds) (time.Duration, string) {
	if ok, at := op.gaveBack(); ok && owner == op.claims.last() {
		return h.settledBy(op.client, at, b), fmt.Sprintf("given back by do%d by %v", op.id, at.Round(time.Microsecond))
	}
	return h.heldUntil(op.client, op.ret, b) + lease + b.expiry, fmt.Sprintf("do%d returned at %v and its lease of %v ran out", op.id, op.ret.Round(time.Microsecond), lease)
}

// checkStalls reports a Do turned away because another owner's claim was
// live (an *InProgressError naming it, with lease left) while, by the
// history, that claim could not be live: its Do had given it back (see
// gaveBack) and the give-back had landed (settledBy), or its lease had run
// out past every request of its Do that may have landed. A key held by
// nobody for a lease after its caller left fails it: HAZARDS class 6.
func (h *idemHistory) checkStalls(fail func(string, ...any), lease time.Duration, b stallBounds) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, op := range h.dos {
		var ip *idempotency.InProgressError
		if op.client < 0 || op.ret < 0 || !errors.As(op.err, &ip) || ip.LeaseLeft <= 0 {
			continue // not a refusal that names a live claim
		}
		holder := h.owners[ip.Owner]
		if holder == nil || holder == op {
			continue
		}
		end, why := h.claimEnd(holder, ip.Owner, lease, b)
		if end >= op.call {
			continue
		}
		who := fmt.Sprintf("client %d's", op.client)
		if op.probe {
			who = "a probe's"
		}
		if n++; n <= 5 {
			fail("liveness: %s do%d on %q at %v..%v was turned away (%v) by do%d's claim (client %d, owner %s), which could not be live then: %s, so it was free from %v at the latest",
				who, op.id, op.key, op.call.Round(time.Microsecond), op.ret.Round(time.Microsecond), op.err,
				holder.id, holder.client, ip.Owner, why, end.Round(time.Microsecond))
		}
	}
	if n > 5 {
		fail("liveness: ... and %d more Do calls turned away by a claim held by nobody", n-5)
	}
}

// prober calls Do, not waiting, on the key of a Do whose caller left while
// it held a claim (gaveBack), shortly after that give-back has landed by the
// stall check's bounds: the stretch where a claim left behind holds the key
// for nobody, which the clients alone seldom look at. Its calls are in the
// history as client Clients's.
type prober struct {
	s  NemesisSuite
	h  *idemHistory
	c  *idemClient // on the Direct store, without a proxy
	wg sync.WaitGroup
}

// after starts the probes that follow op: once settledBy of its give-back
// has passed (recomputed as partitions heal), at a twentieth, a sixth and a
// third of the lease past it, until one is not turned away or the run ends.
func (p *prober) after(op *doOp) {
	p.h.mu.Lock()
	ok, at := op.gaveBack()
	left := op.claims.left
	p.h.mu.Unlock()
	if !ok || !left {
		return
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		lease, b := p.s.Lease, p.s.stallBounds()
		for {
			p.h.mu.Lock()
			end := p.h.settledBy(op.client, at, b)
			p.h.mu.Unlock()
			wait := end - p.h.now()
			if wait <= 0 {
				break
			}
			if p.h.now()+min(wait, lease/10) >= p.s.Duration {
				return
			}
			time.Sleep(min(wait, lease/10)) // until the bound, recomputed: a partition may heal or begin
		}
		from := p.h.now()
		for _, d := range []time.Duration{lease / 20, lease / 6, lease / 3} {
			when := from + d
			if when >= p.s.Duration {
				return
			}
			time.Sleep(when - p.h.now()) // the probe's time, not a synchronisation
			pop := &doOp{client: p.c.id, probe: true, key: op.key, plan: effectPlan{outcome: outSuccess}, reconcile: true}
			p.s.do(p.h, pop, p.c.store(), &idempotency.Options{Owner: fmt.Sprintf("c%d", p.c.id), Lease: lease, Retention: time.Hour, CompleteTimeout: lease}, 2*lease)
			if !errors.Is(pop.err, idempotency.ErrInProgress) {
				return
			}
		}
	}()
}

// stallCounts tells what the stall check had to look at: the claims given
// back after their callers left while Do held them, the probes, and the Do
// calls turned away by a claim the history knows.
func (h *idemHistory) stallCounts() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	left, atArm, probes, refused := 0, 0, 0, 0
	for _, op := range h.dos {
		var ip *idempotency.InProgressError
		switch {
		case op.claims.left:
			if ok, _ := op.gaveBack(); ok {
				left++
				if op.leaveAt == leaveArm {
					atArm++
				}
			}
		case op.probe:
			probes++
		}
		if op.client >= 0 && errors.As(op.err, &ip) && h.owners[ip.Owner] != nil {
			refused++
		}
	}
	return fmt.Sprintf("%d claims given back after their callers left (%d at the arm), %d probes, %d calls turned away by a known claim", left, atArm, probes, refused)
}
