package idempotencytest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/nemesisrun"
)

// The outcomes an effect is planned to have when its context is live at its
// commit step.
const (
	outSuccess       = "success"        // happened, returns a result
	outFailed        = "failed"         // happened as a definitive failure (Definitive)
	outNotSent       = "not-sent"       // did not happen (NotSent)
	outAmbiguousDone = "ambiguous-done" // happened, returns an ambiguous error
	outAmbiguous     = "ambiguous"      // did not happen, returns an ambiguous error
	outCancelled     = "cancelled"      // its context was done at the commit step: did not happen (NotSent)
)

// effectPlan is what one Do's effect does: pause (sleeping through its
// context's end, or returning to its commit step when it ends), then its
// outcome.
type effectPlan struct {
	pause   time.Duration
	sleeps  bool
	outcome string
}

// doOp is one call of Do.
type doOp struct {
	id              int
	client          int  // -1: the liveness check after the run
	probe           bool // a probe after a give-back (see prober)
	key             string
	plan            effectPlan
	wait, reconcile bool
	leaves          time.Duration // the caller's context ends this long after the call; 0: 8 leases
	leaveAt         string        // the caller's context ends as its claim's reply comes (leaveClaim) or as its arm is sent (leaveArm)
	completeTimeout time.Duration
	claims          claimTrace // its claims as the store saw them

	call, ret  time.Duration
	res        idempotency.Result
	err        error
	runs       []*effectRun // the runs of its effect: one at most
	reconciled []string     // what its Reconcile hook answered
}

// effectRun is one run of an effect: the ledger's entry.
type effectRun struct {
	op         *doOp
	key, ek    string
	start, end time.Duration // end -1 while it runs
	// lastLive is when the run last found its context live (read before
	// the check, so no later than the moment the context was live); -1 if
	// it never did.
	lastLive time.Duration
	outcome  string
	happened bool          // the effect happened (success, failed, ambiguous-done)
	at       time.Duration // when it happened
	value    []byte        // success, ambiguous-done: the result
	message  string        // failed: the failure's message
}

// idemHistory is the record of one run: every Do and every run of an effect,
// on one monotonic clock (since start). Its lock also makes an effect's
// commit step and a Reconcile's look at the ledger atomic, as a provider's
// own record would: a Reconcile sees a run's effect as happened or, if not,
// that run's later check of its context finds it done.
type idemHistory struct {
	start time.Time

	mu   sync.Mutex
	dos  []*doOp
	runs []*effectRun
	byEK map[string][]*effectRun
	// reconciledDone holds the effect keys a Reconcile hook found done.
	reconciledDone map[string]bool
	// owners maps the owner of every claim and takeover a client sent to
	// its Do.
	owners map[string]*doOp
	// spans are the clients' partitions, as applied.
	spans nemesisrun.Spans
	// lags are the moments the test process ran late.
	lags nemesisrun.Lags
}

func newIdemHistory() *idemHistory {
	return &idemHistory{start: time.Now(), byEK: map[string][]*effectRun{}, reconciledDone: map[string]bool{}, owners: map[string]*doOp{}}
}

func (h *idemHistory) now() time.Duration { return time.Since(h.start) }

// begin records the call of op.
func (h *idemHistory) begin(op *doOp) {
	h.mu.Lock()
	defer h.mu.Unlock()
	op.id, op.call, op.ret = len(h.dos), h.now(), -1
	h.dos = append(h.dos, op)
}

// end records op's return.
func (h *idemHistory) end(op *doOp, res idempotency.Result, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	op.ret, op.res, op.err = h.now(), res, err
}

// keys returns every key called, sorted.
func (h *idemHistory) keys() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var ks []string
	for _, op := range h.dos {
		if !slices.Contains(ks, op.key) {
			ks = append(ks, op.key)
		}
	}
	slices.Sort(ks)
	return ks
}

// effect is op's effect: it records its run in the ledger, pauses as planned,
// then in one step with the ledger checks its context and, live, happens (or
// not) as planned.
func (h *idemHistory) effect(op *doOp) idempotency.Effect {
	return func(ctx context.Context, ek string) ([]byte, error) {
		h.mu.Lock()
		r := &effectRun{op: op, key: op.key, ek: ek, start: h.now(), end: -1, lastLive: -1}
		op.runs = append(op.runs, r)
		h.runs = append(h.runs, r)
		h.byEK[ek] = append(h.byEK[ek], r)
		h.mu.Unlock()
		defer func() {
			h.mu.Lock()
			r.end = h.now()
			h.mu.Unlock()
		}()
		if p := op.plan.pause; p > 0 {
			if op.plan.sleeps {
				time.Sleep(p) // an effect that does not watch its context
			} else {
				t := time.NewTimer(p)
				select {
				case <-ctx.Done():
				case <-t.C:
				}
				t.Stop()
			}
		}
		h.mu.Lock()
		defer h.mu.Unlock()
		checked := h.now()
		if err := ctx.Err(); err != nil {
			r.outcome = outCancelled
			return nil, idempotency.NotSent(fmt.Errorf("nemesis effect: not sent, its context ended: %w", context.Cause(ctx)))
		}
		r.lastLive, r.outcome = checked, op.plan.outcome
		switch op.plan.outcome {
		case outSuccess:
			r.happened, r.at, r.value = true, checked, []byte(fmt.Sprintf("%s/do%d", op.key, op.id))
			return bytes.Clone(r.value), nil
		case outFailed:
			r.happened, r.at, r.message = true, checked, fmt.Sprintf("declined: do%d", op.id)
			return nil, idempotency.Definitive(errors.New(r.message))
		case outNotSent:
			return nil, idempotency.NotSent(errors.New("nemesis effect: refused before sending"))
		case outAmbiguousDone:
			r.happened, r.at, r.value = true, checked, []byte(fmt.Sprintf("%s/do%d/ambiguous", op.key, op.id))
			return nil, errors.New("nemesis effect: timed out after sending")
		}
		return nil, errors.New("nemesis effect: timed out, not sent")
	}
}

// reconcile is op's Reconcile hook: it asks the ledger, as a provider would
// be asked, whether the run with effectKey happened with a result. A run that
// failed definitively did not (the provider did nothing), so the key may run
// again.
func (h *idemHistory) reconcile(op *doOp) idempotency.Reconcile {
	return func(_ context.Context, ek string) (bool, []byte, error) {
		h.mu.Lock()
		defer h.mu.Unlock()
		for _, r := range h.byEK[ek] {
			if r.happened && r.value != nil {
				op.reconciled = append(op.reconciled, fmt.Sprintf("%s at %v: done by do%d", ek[:8], h.now().Round(time.Microsecond), r.op.id))
				h.reconciledDone[ek] = true
				return true, bytes.Clone(r.value), nil
			}
		}
		op.reconciled = append(op.reconciled, fmt.Sprintf("%s at %v: not done", ek[:8], h.now().Round(time.Microsecond)))
		return false, nil, nil
	}
}

// outcomes counts the runs by outcome.
func (h *idemHistory) outcomes() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := map[string]int{}
	for _, r := range h.runs {
		n[r.outcome]++
	}
	var parts []string
	for _, k := range []string{outSuccess, outFailed, outNotSent, outAmbiguousDone, outAmbiguous, outCancelled} {
		if n[k] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n[k], k))
		}
	}
	perKey, again, reconciled := map[string]int{}, 0, 0
	for _, r := range h.runs {
		if perKey[r.key]++; perKey[r.key] == 2 {
			again++
		}
	}
	for _, op := range h.dos {
		reconciled += len(op.reconciled)
	}
	parts = append(parts, fmt.Sprintf("%d keys ran again, %d Reconcile calls", again, reconciled))
	return strings.Join(parts, ", ")
}

// check runs the checks of the history after the run; recs holds the
// records read back (a missing key has none).
func (h *idemHistory) check(fail func(string, ...any), recs map[string]*idempotency.Record) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	report := func(format string, args ...any) {
		n++
		if n <= 20 {
			fail(format, args...)
		} else if n == 21 {
			fail("... and more violations")
		}
	}
	byKey := map[string][]*effectRun{}
	for _, r := range h.runs {
		byKey[r.key] = append(byKey[r.key], r)
	}
	for _, k := range slices.Sorted(maps.Keys(byKey)) {
		h.checkRuns(report, k, byKey[k])
	}
	h.checkDos(report, recs)
	h.checkRecords(report, recs, byKey)
}

func (r *effectRun) String() string {
	return fmt.Sprintf("do%d's run (client %d, effect key %s, %v..%v)", r.op.id, r.op.client, r.ek[:8], r.start.Round(time.Microsecond), r.end.Round(time.Microsecond))
}

// checkRuns checks one key's runs, sorted by start.
//
// The package documentation: Do runs the effect at most once per key (while
// the record is kept: the suite's Retention is an hour); the effect's context
// is cancelled before the lease ends at the store, and an effect that goes on
// regardless may overlap with a takeover. So two runs overlap only where one
// of them can no longer see a live context: a run that found its context live
// at lastLive ended its time as owner no earlier, and a later run starts only
// after a takeover, which comes after that owner's lease ended at the store.
// A run that happened with a result (success, or an ambiguous error after it
// happened: the Reconcile hook finds it done, and without one the key becomes
// unknown) is never followed by another run. A definitive failure is recorded
// as failed and replayed; only when that record could not be written (its Do
// returned ErrNotRecorded) does the key stay armed, and a Reconcile hook that
// finds nothing done lets it run again.
func (h *idemHistory) checkRuns(report func(string, ...any), key string, runs []*effectRun) {
	slices.SortStableFunc(runs, func(a, b *effectRun) int { return int(a.start - b.start) })
	for i, a := range runs {
		for _, b := range runs[i+1:] {
			if a.lastLive >= 0 && b.lastLive >= 0 && a.lastLive >= b.start {
				report("key %q: two runs of the effect at once: %v found its context live at %v, after %v started (and found its own live at %v)",
					key, a, a.lastLive.Round(time.Microsecond), b, b.lastLive.Round(time.Microsecond))
			}
			if !a.happened || b.start < a.at {
				continue
			}
			switch {
			case a.value != nil:
				report("key %q: the effect ran again after it had happened: %v happened at %v (%s), then %v started",
					key, a, a.at.Round(time.Microsecond), a.outcome, b)
			case !errors.Is(a.op.err, idempotency.ErrNotRecorded):
				report("key %q: the effect ran again after a definitive failure that its Do did not report as not recorded: %v failed at %v (Do returned %v), then %v started",
					key, a, a.at.Round(time.Microsecond), a.op.err, b)
			}
		}
	}
}

// happenedWith returns the runs of key in runs that happened with a result.
func happenedWith(runs []*effectRun) []*effectRun {
	var out []*effectRun
	for _, r := range runs {
		if r.happened && r.value != nil {
			out = append(out, r)
		}
	}
	return out
}

// checkDos checks each Do's result against the ledger, as Do documents its
// results: a nil error with a fresh result is the result of the effect this
// call ran, which happened; a replay (Replayed) is the recorded result of the
// key's run that happened (or what a Reconcile hook found done); an error
// from a call whose effect succeeded is ErrNotRecorded ("the effect completed
// but the result could not be recorded"), and from one whose effect failed
// definitively a *FailedError; a replayed *FailedError carries a failure the
// effect returned. Other errors (ErrUnknown, ErrInProgress, a store's error
// before the effect, the effect's own NotSent or ambiguous error) are allowed
// whatever the ledger holds, as long as they did not hide a run of this call
// that succeeded. docs/idempotency.md adds that Do "never reports 'not
// recorded' for a completion that landed": ErrNotRecorded from a call whose
// key ends completed with its run's result, which no Reconcile hook found
// done (so the completion is this call's own), is a violation, unless it
// also matches fence.ErrUnknown (a try still on its way may land, as the docs
// say of a completion whose tries got no reply before CompleteTimeout).
func (h *idemHistory) checkDos(report func(string, ...any), recs map[string]*idempotency.Record) {
	for _, op := range h.dos {
		if len(op.runs) > 1 {
			report("do%d (client %d, key %q) ran its effect %d times", op.id, op.client, op.key, len(op.runs))
		}
		var own *effectRun
		if len(op.runs) > 0 {
			own = op.runs[0]
		}
		var fe *idempotency.FailedError
		switch {
		case op.err == nil && !op.res.Replayed:
			if own == nil || own.outcome != outSuccess || !bytes.Equal(op.res.Value, own.value) {
				report("do%d (client %d, key %q) returned a fresh result %q, but its own run is %s", op.id, op.client, op.key, op.res.Value, describe(own))
			}
		case op.err == nil:
			if own != nil {
				report("do%d (client %d, key %q) returned a replay %q, but ran the effect itself: %s", op.id, op.client, op.key, op.res.Value, describe(own))
			}
			found := false
			for _, r := range h.runs {
				found = found || (r.key == op.key && r.happened && r.value != nil && bytes.Equal(r.value, op.res.Value))
			}
			if !found {
				report("do%d (client %d, key %q) replayed %q, which no run of the effect returned", op.id, op.client, op.key, op.res.Value)
			}
		case own != nil && own.outcome == outSuccess:
			if !errors.Is(op.err, idempotency.ErrNotRecorded) {
				report("do%d (client %d, key %q): its effect succeeded (%q), but Do returned %v, not ErrNotRecorded", op.id, op.client, op.key, own.value, op.err)
			}
			if rec := recs[op.key]; rec != nil && rec.State == idempotency.Completed && bytes.Equal(rec.Result, own.value) && !h.reconciledDone[own.ek] && !errors.Is(op.err, fence.ErrUnknown) {
				report("do%d (client %d, key %q) reported its completion not recorded (%v), but it landed: the record is completed with its result (fence %d), and no Reconcile found it done",
					op.id, op.client, op.key, op.err, rec.Fence)
			}
		case own != nil && own.outcome == outFailed:
			if !errors.Is(op.err, idempotency.ErrFailed) {
				report("do%d (client %d, key %q): its effect failed definitively, but Do returned %v, not ErrFailed", op.id, op.client, op.key, op.err)
			}
		case own == nil && errors.As(op.err, &fe):
			found := false
			for _, r := range h.runs {
				found = found || (r.key == op.key && r.outcome == outFailed && r.message == fe.Message)
			}
			if !found {
				report("do%d (client %d, key %q) replayed the failure %q, which no run of the effect returned", op.id, op.client, op.key, fe.Message)
			}
		}
	}
}

func describe(r *effectRun) string {
	if r == nil {
		return "none"
	}
	return fmt.Sprintf("%v: %s %q", r, r.outcome, r.value)
}

// checkRecords checks each key's record, read back after the run (and the
// liveness check's calls), against the ledger. The documentation: completed
// and failed records are kept, and replayed, until their retention passes
// (an hour here); an armed record whose owner is gone stays armed until a
// caller finds it, then becomes unknown or what Reconcile finds, and unknown
// stays until Resolve; released means the effect provably did not happen. So:
// completed holds the result of the key's run that happened; failed holds a
// failure the effect returned, and no run happened with a result; released,
// claimed and no record at all come only when no run happened with a result;
// armed and unknown are allowed (nothing could tell) unless a Do reported
// the key completed or its failure recorded.
func (h *idemHistory) checkRecords(report func(string, ...any), recs map[string]*idempotency.Record, byKey map[string][]*effectRun) {
	keys := map[string]bool{}
	for _, op := range h.dos {
		keys[op.key] = true
	}
	for _, k := range slices.Sorted(maps.Keys(keys)) {
		done := happenedWith(byKey[k])
		var reported, failReported *doOp // a Do that reported the key completed, or its failure recorded
		for _, op := range h.dos {
			var fe *idempotency.FailedError
			switch {
			case op.key != k:
			case op.err == nil:
				reported = op
			case errors.As(op.err, &fe) && !errors.Is(op.err, idempotency.ErrNotRecorded):
				failReported = op
			}
		}
		rec := recs[k]
		state := idempotency.State("none")
		if rec != nil {
			state = rec.State
		}
		switch state {
		case idempotency.Completed:
			if len(done) == 0 || !bytes.Equal(rec.Result, done[0].value) {
				report("key %q: the record is completed with %q (fence %d), but the run that happened with a result is %s", k, rec.Result, rec.Fence, describe(first(done)))
			}
			continue
		case idempotency.Failed:
			found := false
			for _, r := range byKey[k] {
				found = found || (r.outcome == outFailed && r.message == string(rec.Result))
			}
			if !found || len(done) > 0 {
				report("key %q: the record is failed with %q (fence %d), but no run failed so, or one happened with a result (%s)", k, rec.Result, rec.Fence, describe(first(done)))
			}
			continue
		case idempotency.Armed, idempotency.Unknown:
		default:
			if len(done) > 0 {
				report("key %q: the record is %s, but %s happened with a result", k, state, done[0])
			}
		}
		if reported != nil {
			report("key %q: the record is %s, but do%d (client %d) returned %q (replayed %v) at %v", k, state, reported.id, reported.client, reported.res.Value, reported.res.Replayed, reported.ret.Round(time.Microsecond))
		}
		if failReported != nil {
			report("key %q: the record is %s, but do%d (client %d) returned the failure %v at %v, recorded", k, state, failReported.id, failReported.client, failReported.err, failReported.ret.Round(time.Microsecond))
		}
	}
}

func first(rs []*effectRun) *effectRun {
	if len(rs) == 0 {
		return nil
	}
	return rs[0]
}

// dump formats the history: every Do and every run of an effect, by time,
// then the records read back.
func (h *idemHistory) dump(recs map[string]*idempotency.Record) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	type line struct {
		at   time.Duration
		text string
	}
	var lines []line
	for _, op := range h.dos {
		who := fmt.Sprintf("client %d", op.client)
		switch {
		case op.client < 0:
			who = "liveness"
		case op.probe:
			who = "probe"
		}
		var opts []string
		if op.wait {
			opts = append(opts, "wait")
		}
		if op.reconcile {
			opts = append(opts, "reconcile")
		}
		if op.leaves > 0 {
			opts = append(opts, fmt.Sprintf("caller leaves at +%v", op.leaves.Round(time.Microsecond)))
		}
		switch {
		case !op.claims.left:
		case op.leaveAt == leaveClaim:
			opts = append(opts, "caller left at its claim's reply")
		case op.leaveAt == leaveArm:
			opts = append(opts, "caller left at its arm")
		}
		if ok, at := op.gaveBack(); ok {
			opts = append(opts, fmt.Sprintf("claim %s given back by %v", op.claims.last(), at.Round(time.Microsecond)))
		}
		opts = append(opts, fmt.Sprintf("complete within %v", op.completeTimeout.Round(time.Millisecond)))
		plan := op.plan.outcome
		if op.plan.pause > 0 {
			how := "watching its context"
			if op.plan.sleeps {
				how = "sleeping"
			}
			plan = fmt.Sprintf("pause %v %s, then %s", op.plan.pause.Round(time.Microsecond), how, plan)
		}
		out := ""
		switch {
		case op.err != nil:
			out = "error: " + op.err.Error()
		case op.res.Replayed:
			out = fmt.Sprintf("replayed %q (fence %d)", op.res.Value, op.res.Fence)
		default:
			out = fmt.Sprintf("%q (fence %d)", op.res.Value, op.res.Fence)
		}
		text := fmt.Sprintf("%9v..%-9v %s do%-4d Do %s [%s; effect: %s] -> %s", op.call.Round(time.Microsecond), op.ret.Round(time.Microsecond),
			who, op.id, op.key, strings.Join(opts, ", "), plan, out)
		if len(op.reconciled) > 0 {
			text += "; Reconcile: " + strings.Join(op.reconciled, "; ")
		}
		lines = append(lines, line{op.call, text})
	}
	for _, r := range h.runs {
		live := "never live"
		if r.lastLive >= 0 {
			live = fmt.Sprintf("live at %v", r.lastLive.Round(time.Microsecond))
		}
		what := r.outcome
		if r.happened {
			what += fmt.Sprintf(", happened at %v", r.at.Round(time.Microsecond))
		}
		lines = append(lines, line{r.start, fmt.Sprintf("%9v..%-9v   run of do%d %s effect key %s: %s, %s", r.start.Round(time.Microsecond), r.end.Round(time.Microsecond),
			r.op.id, r.key, r.ek[:8], live, what)})
	}
	slices.SortStableFunc(lines, func(a, b line) int { return int(a.at - b.at) })
	var b strings.Builder
	for i, l := range lines {
		if i == 3000 {
			fmt.Fprintf(&b, "... %d more\n", len(lines)-i)
			break
		}
		b.WriteString(l.text)
		b.WriteByte('\n')
	}
	b.WriteString("records after the run:\n")
	for _, k := range slices.Sorted(maps.Keys(recs)) {
		r := recs[k]
		fmt.Fprintf(&b, "  %s: %s fence %d owner %s result %q\n", k, r.State, r.Fence, r.Owner, r.Result)
	}
	return b.String()
}
