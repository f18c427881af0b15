package sqlfence

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/wakeup"
)

// A handoff: on PostgreSQL, a release through an Acquirer whose own Acquire
// calls wait for the name grants the lock to the head of that line in the
// release's statement, as a grant would (a new token, larger than the
// released one and never below the server's clock in microseconds; the
// head's owner, with a nonce of its own; the head's ttl from the server's
// clock), and hands the lease to the head, which then holds without a
// statement of its own. It saves the head's grant statement and the wake-up
// of a second backend: one statement and one commit per handoff, where a
// release and a grant take two.
//
// It is made only where the release is its own transaction (not inside a
// caller's transaction, whose rollback would take the grant back after the
// head was told), without AdvanceGuards (whose guard advance the grant
// statement carries), and for at most maxChain handoffs in a row: then the
// lock is released as usual without poking this Acquirer's head: the
// notification (or the backoff, without notifications) wakes the waiters of
// other processes and this Acquirer's head alike, so that they can be
// granted before this Acquirer's next waiter. Without notifications that
// costs this Acquirer's line up to one backoff delay every maxChain + 1
// grants.
// Within one Acquirer the line keeps its order: the head is granted first.
//
// Every outcome is settled: a grant whose reply was lost is recognised by
// its owner (the release retries, and the head's own next attempt runs as
// that owner); a head that gave up while the statement ran gets nothing and
// the releaser gives the grant back at once; a grant that came back past the
// head's local deadline is given back (see giveBackLate); a released lease
// that was already lost hands nothing, and the head tries on its own.

// maxChain is the number of handoffs in a row within one Acquirer after
// which a release lets the waiters of other processes try (see above).
const maxChain = 8

// endsChain reports whether l's release ends a chain of maxChain handoffs:
// the head of this Acquirer's line is then not poked, and learns of the
// release as the waiters of other processes do, from the server's
// notification or at its next backoff delay.
func (l *lease) endsChain() bool { return l.chain >= maxChain && l.a.transfer != "" }

// handReq is a waiter's request, which the releaser reads to grant it.
type handReq struct{ ttl time.Duration }

// transferStatement builds a's handoff statement; next is the grant's new
// token expression over cur.
func (a *Acquirer) transferStatement(t, next string) {
	d := a.db.d
	if d != postgresDialect || a.guards != nil {
		return
	}
	durable := pgDurable
	if a.opts.AsyncGrants {
		durable = pgNoFlushUpToClock // the handoff is always its own transaction
	}
	a.transfer = fmt.Sprintf("WITH g AS (UPDATE %s AS cur SET token = %s, owner = $3, expires_at = %s + $4 "+
		"WHERE cur.name = $1 AND cur.token = $2 AND cur.expires_at > %s RETURNING token) SELECT token FROM g WHERE %s",
		t, next, d.nowMs, d.nowMs, durable)
}

// transfer releases l by granting the lock to p, the head of its line (see
// above), and hands the new lease to it. It returns what Release returns
// for l.
func (l *lease) transfer(ctx context.Context, p *wakeup.Place, r *handReq) error {
	a, name := l.a, l.Name()
	owner := a.opts.Owner + nonceSep + nonce()
	args := []any{a.db.text(name), int64(l.Token()), a.db.text(owner), ttlMs(r.ttl)}
	sent := time.Now() // the earliest the grant can have been made
	uncertain := false
	var (
		tok int64
		err error
	)
	for i := 0; ; i++ {
		err = a.db.queryRow(ctx, a.transfer, args, &tok)
		if uncertain && (errors.Is(err, errNoRows) || a.db.ambiguous(err)) {
			if t, rerr := a.held(ctx, name, owner); rerr == nil {
				tok, err = t, nil
			}
		}
		if !a.db.ambiguous(err) {
			break
		}
		uncertain = true
		if i+1 >= maxAmbiguousRetries || !retryPause(ctx, i) {
			break
		}
	}
	switch {
	case err == nil:
		nl := &lease{Base: leasekit.New(name, fence.Token(tok), r.ttl, a.opts.Drift, sent), a: a, chain: l.chain + 1}
		if nl.Context().Err() != nil {
			// Past the head's local deadline already: it holds nothing.
			_ = a.giveBackLate(ctx, nl)
			a.line.Hand(p, wakeup.Handoff{})
			return nil
		}
		if !a.line.Hand(p, wakeup.Handoff{Lease: nl}) {
			// The head gave up while the statement ran: given back, to
			// the next waiter or to everyone.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			_ = nl.Release(rctx)
		}
		return nil
	case a.db.ambiguous(err):
		// The grant may have landed: the head's next attempt runs as its
		// owner and finds it.
		a.line.Hand(p, wakeup.Handoff{Hint: owner})
		return a.wrap("release", a.db.unknown(err))
	case errors.Is(err, errNoRows) && uncertain:
		a.line.Hand(p, wakeup.Handoff{Hint: owner})
		return l.released(ctx)
	case errors.Is(err, errNoRows):
		// Not held by l (expired, or granted again): nothing changed.
		a.line.Hand(p, wakeup.Handoff{})
		return l.lost()
	case a.db.d.checkViolation(err):
		// The counter is at MaxToken: the grant was refused, and the
		// release is made without it; the head then learns of the
		// exhausted counter from its own attempt.
		rerr := l.releaseOnly(ctx)
		a.line.Hand(p, wakeup.Handoff{})
		return rerr
	default:
		// Refused as a whole (a missing table, a connection that could not
		// be had): nothing changed, l still holds.
		a.line.Hand(p, wakeup.Handoff{Hint: ownerIf(uncertain, owner)})
		return a.wrap("release", err)
	}
}

// ownerIf returns owner when an attempt whose reply was lost may have made
// its grant, "" otherwise.
func ownerIf(uncertain bool, owner string) string {
	if uncertain {
		return owner
	}
	return ""
}
