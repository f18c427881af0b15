package fencetest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/nemesisrun"
)

// history is the record of one nemesis run: every call with its invocation
// and completion times (monotonic, since start), every lease granted, every
// deletion of a name's state, and the violations seen while it ran (the
// exclusion checks read the leases' contexts at the moment of each grant).
type history struct {
	start time.Time

	mu         sync.Mutex
	ops        []*nemOp
	leases     map[string][]*leaseRec
	deletes    map[string][]*nemOp // each DeleteState call, ret -1 while it runs
	spans      nemesisrun.Spans    // partitions and not-run windows, for checkStalls
	lags       nemesisrun.Lags     // moments the test process ran late, for checkStalls
	violations []string
}

// nemOp is one call.
type nemOp struct {
	client      int // -1: the check after the run
	kind, name  string
	token       fence.Token // a write's, a renewal's or release's lease's, a grant's
	value       string      // a write's value, a read's result
	call, ret   time.Duration
	err         error
	lease       *leaseRec
	readOK      bool
	readMissing bool
}

// leaseRec is one lease granted during a run.
type leaseRec struct {
	name    string
	token   fence.Token
	client  int
	lease   fence.Lease
	asked   time.Duration // when the grant was asked for
	granted time.Duration // when the grant returned
	release time.Duration // when its Release was first asked for; -1 before
	ended   atomic.Int64  // when its context was seen done (ns since start); 0 before

	// renewedUntil: when a renewal sent by Hold's watchdog may have landed
	// at the latest; 0 for a lease the client renews itself.
	renewedUntil time.Duration

	// The client's own: when it renews next, and whether it let the lease
	// lapse (it writes with its token before that renewal).
	nextRenew time.Time
	lapsed    bool
}

func newHistory() *history {
	return &history{start: time.Now(), leases: map[string][]*leaseRec{}, deletes: map[string][]*nemOp{}}
}

func (h *history) now() time.Duration { return time.Since(h.start) }

func (h *history) violate(format string, args ...any) {
	h.violations = append(h.violations, fmt.Sprintf(format, args...))
}

// begin records the invocation of a call.
func (h *history) begin(client int, kind, name string, tok fence.Token, value string) *nemOp {
	h.mu.Lock()
	defer h.mu.Unlock()
	op := &nemOp{client: client, kind: kind, name: name, token: tok, value: value, call: h.now(), ret: -1}
	h.ops = append(h.ops, op)
	return op
}

// end records the completion of a call.
func (h *history) end(op *nemOp, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	op.ret, op.err = h.now(), err
}

// deleting records that the state of name is about to be deleted; end the
// returned op when DeleteState returns. The deletion may take effect at any
// moment in between: a backend may hold it behind a grant in progress (a
// row lock) or a loaded server may run it late.
func (h *history) deleting(name string) *nemOp {
	h.mu.Lock()
	defer h.mu.Unlock()
	op := &nemOp{client: -1, kind: "DeleteState", name: name, call: h.now(), ret: -1}
	h.deletes[name] = append(h.deletes[name], op)
	h.ops = append(h.ops, op)
	return op
}

// deletedSince reports whether the state of name may have been deleted at or
// after from: a DeleteState call that returned then or later, or is still
// running.
func (h *history) deletedSince(name string, from time.Duration) bool {
	for _, d := range h.deletes[name] {
		if d.ret < 0 || d.ret >= from {
			return true
		}
	}
	return false
}

// granted records a grant's completion. For a lease, it checks at this moment
// that no other lease of the name has a live context while this one's is
// live, leaving out a lease whose Release was asked for (the backend may have
// freed the name before the lease's context ended) and a pair where the
// name's state may have been deleted since either was asked for (deletedSince).
func (h *history) granted(op *nemOp, l fence.Lease, err error) *leaseRec {
	h.mu.Lock()
	defer h.mu.Unlock()
	op.ret, op.err = h.now(), err
	if err != nil {
		if l != nil {
			h.violate("%s of %q by client %d returned a lease together with the error %v", op.kind, op.name, op.client, err)
		}
		return nil
	}
	if l == nil {
		h.violate("%s of %q by client %d returned neither a lease nor an error", op.kind, op.name, op.client)
		return nil
	}
	rec := &leaseRec{name: op.name, token: l.Token(), client: op.client, lease: l, asked: op.call, granted: op.ret, release: -1}
	op.token, op.lease = rec.token, rec
	if l.Name() != op.name || !rec.token.Valid() {
		h.violate("%s of %q by client %d returned a lease on %q with token %d", op.kind, op.name, op.client, l.Name(), rec.token)
	}
	if l.Context().Err() == nil {
		for _, o := range h.leases[op.name] {
			if o.release >= 0 || h.deletedSince(op.name, min(o.asked, op.call)) {
				continue
			}
			if o.lease.Context().Err() == nil {
				h.violate("two live leases of %q at %v: client %d's token %d (granted at %v) had a live context when client %d's %s returned token %d (asked at %v)",
					op.name, op.ret, o.client, o.token, o.granted, op.client, op.kind, rec.token, op.call)
			}
		}
	}
	h.leases[op.name] = append(h.leases[op.name], rec)
	context.AfterFunc(l.Context(), func() { rec.ended.Store(int64(h.now())) })
	return rec
}

// renewed records a Renew's completion and checks that it did not succeed
// if it was asked for after a later grant of the name had returned (one
// asked for after this lease's grant returned): the backend had given the
// name to another by then.
func (h *history) renewed(op *nemOp, l *leaseRec, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	op.ret, op.err = h.now(), err
	if err != nil {
		return
	}
	for _, o := range h.leases[l.name] {
		if o.asked > l.granted && o.granted < op.call {
			h.violate("client %d's Renew of %q token %d, asked at %v, succeeded although client %d had been granted the name since (token %d, asked at %v, granted at %v)",
				op.client, l.name, l.token, op.call, o.client, o.token, o.asked, o.granted)
			return
		}
	}
}

// releasing records the invocation of a Release of l.
// heldBy records that Hold, which renewed l, has returned: its renewals
// may land as late as a request of client's sent now.
func (h *history) heldBy(l *leaseRec, client int, b stallBounds) {
	h.mu.Lock()
	defer h.mu.Unlock()
	l.renewedUntil = h.heldUntil(client, h.now(), b)
}

func (h *history) releasing(client int, l *leaseRec) *nemOp {
	h.mu.Lock()
	defer h.mu.Unlock()
	op := &nemOp{client: client, kind: "Release", name: l.name, token: l.token, call: h.now(), ret: -1}
	if l.release < 0 {
		l.release = op.call
	}
	h.ops = append(h.ops, op)
	return op
}

// read records a Read's completion.
func (h *history) read(op *nemOp, value string, tok fence.Token, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	op.ret, op.err = h.now(), err
	switch {
	case err == nil:
		op.readOK, op.value, op.token = true, value, tok
	case errors.Is(err, fence.ErrNotFound):
		op.readOK, op.readMissing = true, true
	}
}

func (h *history) grants() int {
	n := 0
	for _, ls := range h.leases {
		n += len(ls)
	}
	return n
}

// check runs the checks of the history after the run: the violations seen
// while it ran, the tokens' order, and each key's linearizability.
func (h *history) check(t *testing.T, fail func(string, ...any)) {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, v := range h.violations {
		if i == 20 {
			fail("... and %d more violations", len(h.violations)-i)
			break
		}
		fail("%s", v)
	}
	for _, name := range sortedKeys(h.leases) {
		h.checkTokens(fail, name, h.leases[name])
	}
	keys := map[string]bool{}
	for _, op := range h.ops {
		if op.kind == "Write" || op.kind == "Read" {
			keys[op.name] = true
		}
	}
	for _, key := range sortedKeys(keys) {
		h.checkRegister(fail, key)
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// checkTokens: no token is granted twice, and a grant that returned before
// another was asked for has the smaller token.
func (h *history) checkTokens(fail func(string, ...any), name string, ls []*leaseRec) {
	seen := map[fence.Token]*leaseRec{}
	for _, l := range ls {
		if o := seen[l.token]; o != nil {
			fail("token %d of %q granted twice: to client %d at %v and to client %d at %v", l.token, name, o.client, o.granted, l.client, l.granted)
		}
		seen[l.token] = l
	}
	for _, a := range ls {
		for _, b := range ls {
			if a.granted < b.asked && a.token >= b.token {
				fail("tokens of %q out of order: client %d was granted %d at %v, before client %d asked (at %v) and was granted %d",
					name, a.client, a.token, a.granted, b.client, b.asked, b.token)
			}
		}
	}
}

// regIn and regOut are a fenced register's operations for porcupine.
type regIn struct {
	write bool
	token fence.Token
	value string
}

type regOut struct {
	outcome string // write: "ok", "stale" or "unknown"
	value   string // read
	token   fence.Token
}

type regState struct {
	value string
	token fence.Token
}

// fencedRegister is the model of one key: a write whose token is not below
// the stored one is stored, a lower one changes nothing, a write of unknown
// outcome may or may not have been stored, and a read returns the stored
// value and token ("" and 0 for a key never written).
var fencedRegister = (&porcupine.NondeterministicModel{
	Init: func() []any { return []any{regState{}} },
	Step: func(state, input, output any) []any {
		st, in, out := state.(regState), input.(regIn), output.(regOut)
		if !in.write {
			if out.value == st.value && out.token == st.token {
				return []any{st}
			}
			return nil
		}
		next := regState{value: in.value, token: in.token}
		switch fits := in.token >= st.token; {
		case out.outcome == "ok" && fits:
			return []any{next}
		case out.outcome == "stale" && !fits:
			return []any{st}
		case out.outcome == "unknown" && fits:
			return []any{st, next}
		case out.outcome == "unknown":
			return []any{st}
		}
		return nil
	},
	DescribeOperation: func(input, output any) string {
		in, out := input.(regIn), output.(regOut)
		if in.write {
			return fmt.Sprintf("write(%d, %q) -> %s", in.token, in.value, out.outcome)
		}
		return fmt.Sprintf("read() -> %q token %d", out.value, out.token)
	},
}).ToModel()

// checkRegister checks the writes and reads of key with porcupine.
func (h *history) checkRegister(fail func(string, ...any), key string) {
	var ops []porcupine.Operation
	for _, op := range h.ops {
		if op.name != key {
			continue
		}
		p := porcupine.Operation{ClientId: op.client + 1, Call: int64(op.call), Return: int64(op.ret)}
		switch op.kind {
		case "Write":
			in := regIn{write: true, token: op.token, value: op.value}
			out := regOut{outcome: "unknown"}
			switch {
			case op.err == nil:
				out.outcome = "ok"
			case errors.Is(op.err, fence.ErrStale), errors.Is(op.err, fence.ErrInvalid):
				out.outcome = "stale"
				var se *fence.StaleError
				if errors.As(op.err, &se) && se.Current <= op.token {
					fail("Write(%q, token %d) by client %d at %v refused as stale although the key holds %d, not more", key, op.token, op.client, op.call, se.Current)
				}
			default:
				// It may have been applied at any moment after it was
				// sent, even after the error (a request held by a
				// partition and delivered on heal).
				p.Return = math.MaxInt64
			}
			p.Input, p.Output = in, out
		case "Read":
			if !op.readOK {
				continue
			}
			p.Input, p.Output = regIn{}, regOut{value: op.value, token: op.token}
		default:
			continue
		}
		ops = append(ops, p)
	}
	switch porcupine.CheckOperationsTimeout(fencedRegister, ops, 30*time.Second) {
	case porcupine.Illegal:
		fail("key %q: the %d writes and reads are not linearizable as a fenced register (a stale write accepted, an accepted write lost, or a read of a refused write)", key, len(ops))
	case porcupine.Unknown:
		// Not evidence of a bug: the checker ran out of time.
		fail("key %q: the linearizability check of %d operations timed out (inconclusive; shorten the run)", key, len(ops))
	}
}

// dump formats the history, one call a line.
func (h *history) dump() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var b strings.Builder
	for i, op := range h.ops {
		if i == 3000 {
			fmt.Fprintf(&b, "... %d more\n", len(h.ops)-i)
			break
		}
		h.opLine(&b, op)
		b.WriteByte('\n')
	}
	return b.String()
}

// opLine writes op as dump shows it, without a line end; h.mu is held.
func (h *history) opLine(b *strings.Builder, op *nemOp) {
	who := fmt.Sprintf("client %d", op.client)
	if op.client < 0 {
		who = "nemesis "
	}
	fmt.Fprintf(b, "%9v..%-9v %s %-11s %s", op.call.Round(time.Microsecond), op.ret.Round(time.Microsecond), who, op.kind, op.name)
	switch op.kind {
	case "Write":
		fmt.Fprintf(b, " token %d %q", op.token, op.value)
	case "Read":
		if op.readOK && !op.readMissing {
			fmt.Fprintf(b, " -> %q token %d", op.value, op.token)
		}
	case "Renew", "Release":
		fmt.Fprintf(b, " token %d", op.token)
	case "TryAcquire", "Acquire":
		if op.lease != nil {
			ended := "live at the end"
			if e := op.lease.ended.Load(); e != 0 {
				ended = fmt.Sprintf("context done at %v", time.Duration(e).Round(time.Microsecond))
			}
			fmt.Fprintf(b, " -> token %d (%s)", op.token, ended)
		}
	}
	if op.err != nil {
		fmt.Fprintf(b, ": %v", op.err)
	}
}
