package sqlfence

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/wakeup"
)

// A handoff: on PostgreSQL and MySQL, a release through an Acquirer whose
// own Acquire calls wait for the name grants the lock to the head of that
// line in the release's statement, as a grant would (a new token, larger
// than the released one, and on PostgreSQL never below the server's clock in
// microseconds; the head's owner, with a nonce of its own; the head's ttl
// from the server's clock), and hands the lease to the head, which then holds without a
// statement of its own. It saves the head's grant statement and the wake-up
// of a second backend: one statement and one commit per handoff, where a
// release and a grant take two.
//
// It is made only where the release is its own transaction (not inside a
// caller's transaction, whose rollback would take the grant back after the
// head was told), without AdvanceGuards (whose guard advance the grant
// statement carries), and for at most maxChain handoffs in a row: then the
// lock is released as usual, and with notifications this Acquirer's head is
// not poked: the notification wakes the waiters of other processes and this
// Acquirer's head alike, so that they can be granted before this Acquirer's
// next waiter. (Without notifications the head is poked, as after any
// release: the waiters of other processes poll.)
// Within one Acquirer the line keeps its order: the head is granted first.
//
// Every outcome is settled: a grant whose reply was lost is recognised by
// its owner (the release retries, and the head's own next attempt runs as
// that owner, its local deadline counting from the handoff's first send); a
// head that gave up while the statement ran gets nothing, and the releaser
// gives the grant back at once; when the handoff's outcome is unknown, the
// row is watched until the handoff can no longer grant (see settleHandoff:
// in the background after two seconds, for at most the released grant's
// ttl and 2s), and whatever it granted is given back (on MySQL a
// statement whose context ended runs on in the server, waiting for a row
// another transaction holds, and landed seconds after the release had
// returned ErrUnknown); a grant that came back past the head's local deadline is given
// back (see giveBackLate); a released lease that was already lost hands
// nothing, and the head tries on its own. The released lease's context ends
// before the head is handed the new one.

// maxChain is the number of handoffs in a row within one Acquirer after
// which a release lets the waiters of other processes try (see above).
const maxChain = 8

// endsChain reports whether l's release ends a chain of maxChain handoffs
// and is announced to every waiter, by a notification or (MySQL) by the
// bell the release let go (rang; see bell.go): the head of this Acquirer's
// line is then not poked, and hears of the release with the waiters of
// other processes, in the order the server serves them. Otherwise it is
// poked as after any release (other processes' waiters poll).
func (l *lease) endsChain(rang bool) bool {
	if l.chain < maxChain || l.a.transfer == "" {
		return false
	}
	return l.a.db.listen != nil && !l.a.opts.DisableNotify || rang
}

// handReq is a waiter's request, which the releaser reads to grant it.
type handReq struct{ ttl time.Duration }

// transferStatement builds a's handoff statement; next is the grant's new
// token expression over cur.
func (a *Acquirer) transferStatement(t, next string) {
	d := a.db.d
	if a.guards != nil {
		return
	}
	if d == mysqlDialect {
		// LAST_INSERT_ID reports the new token, 0 when no row matched (see
		// execID); the grant's token is the counter + 1, as a grant's is on
		// MySQL. Its arguments come in the order of transferArgs.
		a.transfer = fmt.Sprintf("UPDATE %[1]s SET token = LAST_INSERT_ID(token + 1), owner = %[3]s, expires_at = %[2]s + ? "+
			"WHERE name = %[4]s AND token = ? AND expires_at > %[2]s", t, mysqlDialect.nowMs, mysqlMaybeEmpty, mysqlText)
		return
	}
	if d != postgresDialect {
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

// transferArgs are the handoff statement's arguments: name, the released
// token, the new owner and the ttl, or on MySQL owner, ttl, name, token (the
// order of its placeholders).
func (a *Acquirer) transferArgs(name string, tok fence.Token, owner string, ttl time.Duration) []any {
	if a.db.d == mysqlDialect {
		return []any{a.db.text(owner), ttlMs(ttl), a.db.text(name), int64(tok)}
	}
	return []any{a.db.text(name), int64(tok), a.db.text(owner), ttlMs(ttl)}
}

// transferRow runs the handoff statement once and returns the new token;
// errNoRows when the released lease no longer held the row.
func (a *Acquirer) transferRow(ctx context.Context, c *sql.Conn, args []any) (int64, error) {
	if a.db.d == mysqlDialect {
		var cn conn = a.db.c
		if c != nil {
			cn = a.db.on(c)
		}
		tok, err := a.db.execIDOn(ctx, cn, a.transfer, args...)
		if err == nil && tok == 0 {
			err = errNoRows
		}
		return tok, err
	}
	var tok int64
	err := a.db.queryRow(ctx, a.transfer, args, &tok)
	return tok, err
}

// handHint is what the head of a line needs to settle a handoff whose
// outcome was lost: the owner the grant would hold the row as, and when the
// handoff was first sent (the earliest the grant can have been made, where
// its local deadline counts from); and, to settle it when the head has
// gone, the released grant's token and ttl.
type handHint struct {
	owner    string
	sent     time.Time
	released fence.Token
	ttl      time.Duration // the released grant's
}

// abandon settles a handoff made to a waiter of name whose context ended
// before it received it: a handed lease is released, and a handoff whose
// outcome is unknown is settled (settleHandoff), so that nobody waits out
// its ttl.
func (a *Acquirer) abandon(ctx context.Context, name string, ttl time.Duration, h wakeup.Handoff) {
	if h.Lease != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = h.Lease.Release(rctx)
		return
	}
	hint, ok := h.Hint.(handHint)
	if !ok || hint.owner == "" {
		return
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	if a.settleHandoff(sctx, name, hint) {
		return
	}
	// Not settled within two seconds (the row locked by another
	// transaction, the server unreachable): on in the background, until
	// the released grant would have expired on the server (its ttl from
	// now, and 2s), after which the handoff can no longer land.
	go func() {
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), hint.ttl+2*time.Second)
		defer cancel()
		a.settleHandoff(bctx, name, hint)
	}()
}

// settleHandoff makes sure that a handoff whose outcome is unknown, made
// for a head that has gone, leaves no grant behind: it reports true once
// the row shows that the handoff can no longer grant (the released grant
// no longer holds the row) and that no grant of the hint's owner holds it.
// The handoff statement can still be on its way, or waiting for the row on
// the server (MySQL's driver only closes the connection when a context
// ends; the server runs the statement on): while the released grant holds
// the row it is released here, so that the handoff finds nothing to grant;
// a grant the handoff made is released. It tries until ctx ends.
func (a *Acquirer) settleHandoff(ctx context.Context, name string, hint handHint) bool {
	for i := 0; ; i++ {
		// The read takes the row lock, so it waits for a statement that
		// holds or waits for the row before it and sees its outcome.
		r, err := a.rowLocked(ctx, name)
		switch {
		case errors.Is(err, errNoRows):
			return true // no row: nothing can be granted on it
		case err != nil:
		case r.owner == hint.owner && r.left > 0:
			// The handoff granted the head that left: give it back.
			_ = a.giveBackToken(ctx, name, fence.Token(r.token), hint.ttl)
		case fence.Token(r.token) == hint.released && r.left > 0:
			// The released grant still holds the row: the handoff may yet
			// land. Release it, as Release was asked to.
			_ = a.giveBackToken(ctx, name, hint.released, hint.ttl)
		default:
			return true
		}
		if !watchPause(ctx, i, hint.ttl) {
			return false
		}
	}
}

// transfer releases l by granting the lock to p, the head of its line (see
// above), and hands the new lease to it. It returns what Release returns
// for l.
func (l *lease) transfer(ctx context.Context, p *wakeup.Place, r *handReq) error {
	a, name := l.a, l.Name()
	hint := handHint{owner: a.opts.Owner + nonceSep + nonce(), sent: time.Now(), released: l.Token(), ttl: l.TTL()}
	args := a.transferArgs(name, l.Token(), hint.owner, r.ttl)
	uncertain := false
	var (
		tok int64
		err error
	)
	// hand ends the offer; a head that left meanwhile is settled here, as
	// its own leaving would have (abandon).
	hand := func(h wakeup.Handoff) {
		if !a.line.Hand(p, h) {
			a.abandon(ctx, name, r.ttl, h)
		}
	}
	// The released lease's pinned connection, holding the bell if it
	// does (see bell.go), goes to the new lease with the handoff.
	c := l.conn.Swap(nil)
	defer func() {
		if c != nil {
			a.bells.unpin(c, false) // not handed on: its session ends, and the bell with it
		}
	}()
	settled := false
	defer func() {
		if !settled {
			// A panic (a driver's, a tracer's) on the way: the head must
			// not wait on an offer that never ends. It tries on its own,
			// as the owner of a grant that may have landed.
			hand(wakeup.Handoff{Hint: hint})
		}
	}()
	for i := 0; ; i++ {
		tok, err = a.transferRow(ctx, c, args)
		if err != nil && c != nil {
			a.bells.unpin(c, false)
			c = nil
			if errors.Is(err, driver.ErrBadConn) {
				// Not sent (the pinned connection's session had
				// ended): on a connection of the pool, as without bells.
				tok, err = a.transferRow(ctx, nil, args)
			}
		}
		if uncertain && (errors.Is(err, errNoRows) || a.db.ambiguous(err)) {
			if t, rerr := a.held(ctx, name, hint.owner); rerr == nil {
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
	settled = true
	switch {
	case err == nil:
		// The released lease ends before the head can hold the new one.
		l.End(context.Canceled)
		nl := &lease{Base: leasekit.New(name, fence.Token(tok), r.ttl, a.opts.Drift, hint.sent), a: a, chain: l.chain + 1}
		nl.keepConn(c)
		c = nil
		if nl.Context().Err() != nil {
			// Past the head's local deadline already: it holds nothing.
			_ = a.giveBackLate(ctx, nl)
			hand(wakeup.Handoff{})
			return nil
		}
		hand(wakeup.Handoff{Lease: nl})
		return nil
	case a.db.ambiguous(err):
		// The grant may have landed: the head's next attempt runs as its
		// owner and finds it (or, if the head has gone, it is looked for
		// and given back here).
		hand(wakeup.Handoff{Hint: hint})
		return a.wrap("release", a.db.unknown(err))
	case errors.Is(err, errNoRows) && uncertain:
		hand(wakeup.Handoff{Hint: hint})
		return l.released(ctx)
	case errors.Is(err, errNoRows):
		// Not held by l (expired, or granted again): nothing changed.
		hand(wakeup.Handoff{})
		return l.lost()
	case a.db.d.checkViolation(err):
		// The counter is at MaxToken: the grant was refused, and the
		// release is made without it; the head then learns of the
		// exhausted counter from its own attempt.
		rerr := l.releaseOnly(ctx)
		hand(wakeup.Handoff{})
		return rerr
	case uncertain:
		// A definite error now (a refused connection) says nothing of an
		// earlier attempt whose reply was lost.
		hand(wakeup.Handoff{Hint: hint})
		return a.wrap("release", fmt.Errorf("%w: an earlier attempt whose reply was lost may have handed the lock on: %w", fence.ErrUnknown, err))
	default:
		// Refused as a whole (a missing table, a connection that could not
		// be had): nothing changed, l still holds.
		hand(wakeup.Handoff{})
		return a.wrap("release", err)
	}
}
