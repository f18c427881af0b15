package sqlfence

import (
	"context"
	"crypto/rand"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/wakeup"
)

// AcquirerOptions configures an Acquirer. A nil *AcquirerOptions means the defaults.
type AcquirerOptions struct {
	// Table is the lease table, one row per lock name; it may be
	// schema-qualified. On MySQL its name column must compare bytes and hold
	// every name, as WriterOptions.KeyColumn says; otherwise a grant,
	// Inspect or Bump returns an error matching fence.ErrInvalid.
	// Default: "fence_leases".
	Table string
	// Owner is recorded with each grant, for operators. Default: host name,
	// process id and a random suffix. Like a name, it must be valid UTF-8
	// without NUL bytes and at most MaxKeyBytes long, on every dialect;
	// NewAcquirer refuses anything else with an error matching
	// fence.ErrInvalid naming owner.
	Owner string
	// Backoff paces Acquire's attempts while the lease is held. Default on
	// PostgreSQL with notifications: Min 20ms, Max 200ms (a release wakes a
	// waiter at once; polling only covers a missed notification); otherwise the
	// zero fence.Backoff (Min 1ms, Max 100ms).
	Backoff fence.Backoff
	// Drift is taken off each lease's local deadline for clock drift between
	// this process and the database. Default: 1% of the ttl plus 2ms. A
	// TryAcquire or Acquire whose ttl is not longer than a Drift set here
	// returns an error matching fence.ErrInvalid naming the ttl.
	Drift time.Duration
	// DisableNotify turns off release notifications, so waiters of other
	// Acquirers only poll with Backoff. Default: false. On PostgreSQL a
	// release runs pg_notify, and waiting Acquire calls wake on it through
	// LISTEN. On MySQL (without AdvanceGuards) a grant also takes a
	// user-level lock named for the lease row, GET_LOCK(key, 0), on a
	// connection the lease keeps from the pool, and its release lets it go
	// in the same statement; while Acquire calls of this Acquirer wait for a
	// name, one goroutine waits for that lock in GET_LOCK on a connection of
	// its own and, when a release lets it go, grants the lease to the head
	// of the line on that connection and hands it over (the head sends no
	// statement of its own). The lock only wakes: a grant never waits for
	// it and is made whether or not it got it; while the holder has none,
	// the goroutine that has it reads the row every 2ms doubling to 100ms
	// until it is free. The Acquirers of a pool pin at most 16 of its connections
	// together, a quarter of SetMaxOpenConns when that is set.
	DisableNotify bool
	// AdvanceGuards, when set, advances the guard row of the lock name (see
	// Guards) to the new token in the same atomic step as every grant, so a
	// stale holder's Guard is rejected from the moment a newer grant exists, not
	// only after the new holder's first guarded transaction. The guard table
	// must be in the acquirer's database: NewAcquirer refuses Guards made on a
	// database of another dialect with an error matching fence.ErrInvalid.
	// A grant while the guard table is missing fails, granting nothing, with
	// a *TableError that names the guard table and carries its DDL.
	// Default: nil.
	AdvanceGuards *Guards
	// AsyncGrants, on PostgreSQL, lets a grant return before its commit is
	// on disk, which takes a disk flush (about 0.2ms here) off every
	// acquire. It does so only when the grant's token is at or below the
	// server's clock in microseconds (a PostgreSQL grant's token is the
	// larger of the counter + 1 and that clock, see Acquirer); a grant
	// above the clock (after a Bump) waits for the disk as usual, and so
	// does one run inside a caller's transaction (a pgx.Tx, a *pgx.Conn in
	// BEGIN), whose commit keeps its durability. What it gives up: a grant
	// made in the last moments before a server crash (up to three
	// wal_writer_delay, 600ms by default) may be lost with it, so after the
	// restart the name can be granted to another holder while the first
	// still holds it. Fencing still holds: any later grant on the table, by
	// this acquirer or another of this version, has a token above the lost
	// one as long as the server's clock does not step back across the
	// restart (after a failover, the new server's clock must not be behind
	// the old one's), so the resource rejects the first holder's writes
	// once the second has written. Turn it on only once every process that
	// grants on the table runs a version that floors PostgreSQL grants at
	// the clock (this one or later): an older one counts up from the
	// counter on disk and can hand a lost token out again. Renewals and
	// Bumps still wait for the disk. NewAcquirer refuses it on other
	// dialects, and with AdvanceGuards, whose guard advance must survive a
	// crash with its grant (fence.ErrInvalid). Default: false.
	AsyncGrants bool
}

// Acquirer grants leases from a lease table. The token is the row's counter,
// advanced by the statement that grants the lease; expiry is compared on the
// database server's clock. It is safe for concurrent use, and across processes
// that share the database.
//
// # Durability on PostgreSQL
//
// A grant (unless AsyncGrants), a renewal and a Bump commit to the local disk, also where
// synchronous_commit is off for the server or the session: each sets it to
// local for its transaction (every other setting is kept), since a grant lost
// in a crash would hand its token out again. Run as their own transaction
// they return once on disk; run inside a caller's transaction (a pgx.Tx, a
// *pgx.Conn inside BEGIN), they make the caller's commit wait for the disk.
// A release run as its own transaction (a *pgxpool.Pool, a *sql.DB, a
// *pgx.Conn outside a transaction block) does not wait for the disk: lost in
// a crash, it leaves the lease held until its ttl and changes no token, and a
// later grant's flush covers it. Inside a caller's transaction a release sets
// nothing, and the caller's commit keeps its own durability.
//
// # Tokens after a lease row is lost
//
// A name's row is created with the database server's clock in microseconds
// since the Unix epoch as its counter, and each later grant adds one (on
// PostgreSQL it takes the larger of the counter + 1 and the clock, so a
// counter that went back, with a table restored from a backup, a grant lost
// in a crash or a failover, hands out no token again either). So when
// the row is deleted (an operator's DELETE, a table restored from a backup,
// a cleanup job) the next grant still gets a token above every token the old
// row handed out, and a paused holder of an old token stays fenced. This
// assumes that the server's clock does not step back past the old row's
// creation, and that the old row made fewer grants than microseconds passed
// since its creation (each grant is a statement round trip, so this holds
// unless Bump raised the counter above the clock: a bumped counter is lost
// with its row). On SQLite, whose own clock counts milliseconds, the clock is
// that of the host the process runs on (SQLite runs in the process, on that
// host), read in microseconds while the statement creating the row runs
// (under SQLite's write lock), so the handle's connections must be the
// "sqlite" driver's of modernc.org/sqlite, as [SQLite] requires. Tokens stay below 2^53 (fence.MaxToken) until the year 2255.
type Acquirer struct {
	db     *DB
	opts   AcquirerOptions
	table  string
	quoted string
	ddl    string

	grant, renew, release string
	releaseAsync          string // PostgreSQL: the release, its commit not waiting for the disk (see pgNoFlush)
	grantAsync            string // PostgreSQL with AsyncGrants: the grant, its commit not waiting for the disk when its token is at or below the clock
	transfer              string // PostgreSQL and MySQL: a release that grants the lock to a waiter of this acquirer (see transfer.go)
	grantBell             string // MySQL: the grant, taking the bell (see bell.go)
	releaseBell           string // MySQL: the release, letting the bell go
	bells                 *bells // MySQL: the bells of this acquirer's names; nil without
	inspect, bump         string
	inspectLocked         string     // inspect, waiting for a statement that holds the row (not on SQLite)
	advance               string     // SQLite and MySQL: the guard statement run with the grant
	guards                *Guards    // AdvanceGuards, whose table a grant also writes
	keys                  *keyColumn // MySQL: the name column must compare bytes

	line wakeup.Line // this acquirer's waiting Acquire calls, per name
}

var _ fence.Acquirer = (*Acquirer)(nil)

// NewAcquirer returns an Acquirer on db. It returns an error matching
// fence.ErrInvalid for a table name that is not a plain SQL identifier. It does not
// touch the database; see CreateTable.
func NewAcquirer(db *DB, opts *AcquirerOptions) (*Acquirer, error) {
	if err := db.check("new acquirer"); err != nil {
		return nil, err
	}
	var o AcquirerOptions
	if opts != nil {
		o = *opts
	}
	if o.Table == "" {
		o.Table = "fence_leases"
	}
	if o.Owner == "" {
		o.Owner = defaultOwner()
	}
	if err := checkText("new acquirer", "owner", o.Owner); err != nil {
		// PostgreSQL cannot store NUL or invalid UTF-8, MySQL's column holds
		// 64 KiB: every grant would fail, or lose its nonce.
		return nil, err
	}
	if o.Drift < 0 {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "drift", Reason: "negative"}
	}
	if err := leasekit.CheckBackoff("new acquirer", o.Backoff); err != nil {
		return nil, err
	}
	t, err := db.d.quoteIdent("new acquirer", "table", o.Table, true)
	if err != nil {
		return nil, err
	}
	if o.Backoff == (fence.Backoff{}) && db.listen != nil && !o.DisableNotify {
		o.Backoff = fence.Backoff{Min: 20 * time.Millisecond, Max: 200 * time.Millisecond}
	}
	d := db.d
	a := &Acquirer{db: db, opts: o, table: o.Table, quoted: t}
	a.ddl = fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s (\n  name %s PRIMARY KEY,\n  token %s NOT NULL CHECK (token BETWEEN 1 AND %d),\n  owner %s NOT NULL,\n  expires_at %s NOT NULL\n)",
		t, d.keyType, d.intType, uint64(fence.MaxToken), d.textType, d.intType)
	now := d.nowMs
	next := "cur.token + 1"
	if d == postgresDialect {
		// On PostgreSQL a grant's token is also never below the server's
		// clock in microseconds: a counter that went back (a grant lost in
		// a crash under AsyncGrants, by any acquirer on the table; a table
		// restored from a backup; a failover to a replica that had not
		// received the last grants) does not hand out a token again, if
		// the clock has not stepped back (see Acquirer).
		next = "greatest(cur.token + 1, " + d.nowUs + ")"
	}
	// Grant: create the row with the server's clock in microseconds as its
	// token (see Acquirer), or take over an expired row and advance its
	// counter, in one statement. The CHECK constraint stops the counter at
	// MaxToken. expires_at is milliseconds since the epoch on the server's clock.
	a.grant = fmt.Sprintf("INSERT INTO %s AS cur (name, token, owner, expires_at) VALUES ($1, %s, $2, %s + $3) "+
		"ON CONFLICT (name) DO UPDATE SET token = %s, owner = excluded.owner, expires_at = excluded.expires_at "+
		"WHERE cur.expires_at <= %s RETURNING token", t, d.nowUs, now, next, now)
	a.renew = fmt.Sprintf("UPDATE %s SET expires_at = %s + $3 WHERE name = $1 AND token = $2 AND expires_at > %s", t, now, now)
	a.release = fmt.Sprintf("UPDATE %s SET expires_at = 0 WHERE name = $1 AND token = $2 AND expires_at > %s", t, now)
	if d == postgresDialect {
		// The release returns a row when it released (as renew and bump do
		// below), so that its commit's durability can be set inside it.
		sel := "SELECT 1 FROM r"
		if !o.DisableNotify {
			// The release and its notification are one statement: waiters hear
			// of it when it commits. Only a real release notifies.
			sel = fmt.Sprintf("SELECT pg_notify('%s', md5(name)) FROM r", releaseChannel)
		}
		// Inside a caller's transaction the release sets nothing: the
		// caller's commit keeps its durability.
		a.release = fmt.Sprintf("WITH r AS (%s RETURNING name) %s", a.release, sel)
		a.releaseAsync = a.release + " WHERE " + pgNoFlush
		a.renew = pgDurableChange(a.renew)
	}
	a.inspect = fmt.Sprintf("SELECT token, owner, expires_at - %s, expires_at FROM %s WHERE name = $1", now, t)
	// Bump: a name without a row gets the larger of to and the clock floor a
	// new row would start at (see Acquirer), so that Bump never lowers the
	// counter of a row that was deleted; an existing row is raised to to.
	a.bump = fmt.Sprintf("INSERT INTO %s AS cur (name, token, owner, expires_at) VALUES ($1, %s($2, %s), '', 0) "+
		"ON CONFLICT (name) DO UPDATE SET token = $2 WHERE cur.token < $2 AND cur.expires_at <= %s", t, d.greatest, d.nowUs, now)
	if d == postgresDialect {
		a.bump = pgDurableChange(a.bump)
	}
	if d == mysqlDialect {
		a.keys = newKeyColumn("table", o.Table, "name", "name")
		a.mysqlStatements(t)
	}
	a.inspectLocked = a.inspect
	if d != sqliteDialect {
		a.inspectLocked += " FOR UPDATE"
	}
	if g := o.AdvanceGuards; g != nil {
		a.guards = g
		if g.db.d != d {
			return nil, &fence.InvalidError{Op: "new acquirer", Arg: "AdvanceGuards", Reason: fmt.Sprintf("the Guards are on %s, the acquirer on %s: both tables must be in one database", g.db.d.name, d.name)}
		}
		if d == postgresDialect {
			// One statement: the guard advances only when the grant happened,
			// and only upwards.
			a.grant = fmt.Sprintf("WITH g AS (%s), adv AS (%s SELECT $1, token FROM g %s) SELECT token FROM g WHERE %s",
				a.grant, g.insertPrefix, g.onConflictUp, pgDurable)
		} else {
			a.advance = g.guard
		}
	} else if d == postgresDialect {
		a.grant = fmt.Sprintf("WITH g AS (%s) SELECT token FROM g WHERE %s", a.grant, pgDurable)
	}
	if o.AsyncGrants {
		switch {
		case d != postgresDialect:
			return nil, &fence.InvalidError{Op: "new acquirer", Arg: "AsyncGrants", Reason: "PostgreSQL only: " + d.name + " sets a commit's flush only for the whole server"}
		case o.AdvanceGuards != nil:
			// The guard's advance would be lost with the grant, and a stale
			// holder's Guard accepted after a crash while the new holder
			// still holds.
			return nil, &fence.InvalidError{Op: "new acquirer", Arg: "AsyncGrants", Reason: "not with AdvanceGuards, whose guard advance must survive a crash with its grant"}
		}
		// The counter is floored at the clock (above), and the commit skips
		// the flush only when the token is at or below the clock where the
		// statement decides (read again, later than where the token was
		// set): such a token is below the clock of any grant after a
		// restart, so a grant lost in a crash is never handed out again.
		// Only where the grant is its own transaction (see grantRow).
		a.grantAsync = strings.Replace(a.grant, pgDurable, pgNoFlushUpToClock, 1)
	}
	a.transferStatement(t, next)
	if d == mysqlDialect && !o.DisableNotify && o.AdvanceGuards == nil && db.sqlDB != nil {
		a.bells = newBells(db.sqlDB, t, a.ringGrant)
	}
	return a, nil
}

func defaultOwner() string {
	host, _ := os.Hostname()
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// DDL returns the CREATE TABLE statement for the lease table in its dialect.
func (a *Acquirer) DDL() string { return a.ddl }

// CreateTable creates the lease table if it does not exist.
func (a *Acquirer) CreateTable(ctx context.Context) error { return a.db.createTable(ctx, a.ddl) }

// Owner returns the owner id recorded with this acquirer's grants.
func (a *Acquirer) Owner() string { return a.opts.Owner }

// TryAcquire grants the lease on name for ttl, or returns fence.ErrHeld at once.
// ttl is rounded up to whole milliseconds and must be longer than the drift
// margin taken off the local deadline (the acquirer's Drift, by default 1% of
// the ttl + 2ms: so a little over 2ms at least), else fence.ErrInvalid. A name
// whose counter reached fence.MaxToken returns fence.ErrTokensExhausted.
//
// Each call records a nonce of its own with the grant, so a grant whose reply
// was lost is recognised when the call looks again (or runs the grant again
// and finds the name held), and is returned as the lease. When it cannot
// know after a few attempts, it returns an error matching fence.ErrUnknown:
// a grant may then be held on the server until its ttl runs out.
//
// A grant that comes back after its local deadline (its statement waited for
// a row or file lock longer than the ttl) holds nothing: it is released, and
// TryAcquire returns an error matching fence.ErrLost; Acquire tries again.
//
// On SQLite a statement waits for the file's lock for up to the 10s busy
// timeout, within ctx. A file that another connection keeps locked past that
// makes TryAcquire return SQLite's "database is locked" error (SQLITE_BUSY),
// which is neither ErrHeld nor ErrUnknown: nothing was granted. Acquire waits
// on instead, within its context.
func (a *Acquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	return a.tryAcquire(ctx, name, ttl, maxAmbiguousRetries, handHint{})
}

// tryAcquire is TryAcquire, running an ambiguous grant at most attempts times
// in all (0: until ctx ends). hint, when not zero, is a handoff whose outcome
// was lost (see transfer): the grant runs as its owner and recognises the
// handoff's grant if it landed, whose local deadline counts from when the
// handoff was sent.
func (a *Acquirer) tryAcquire(ctx context.Context, name string, ttl time.Duration, attempts int, hint handHint) (fence.Lease, error) {
	if err := a.checkLease("acquire", ctx, name, ttl); err != nil {
		if hint.owner != "" && ctx != nil && ctx.Err() != nil {
			// The head was handed a hint (a handoff or a ringer's grant
			// whose reply was lost, which may have granted hint.owner)
			// and its context ended before this attempt could look:
			// settled in the background, so that nobody waits out the
			// grant's ttl.
			if hint.released != 0 {
				go a.abandon(context.Background(), name, ttl, wakeup.Handoff{Hint: hint})
			} else {
				go a.watchGrant(name, hint.owner, ttl)
			}
		}
		return nil, err
	}
	owner, sent := hint.owner, hint.sent // sent: the first attempt's, the earliest a grant can have been made
	uncertain := owner != ""             // an earlier attempt may hold the lease
	if owner == "" {
		owner, sent = a.opts.Owner+nonceSep+nonce(), time.Now()
	}
	var (
		tok int64
		c   *sql.Conn // the grant's pinned connection (see bell.go), nil unless granted
		err error
	)
	for i := 0; ; i++ {
		tok, c, err = a.grantRow(ctx, name, owner, ttl)
		if uncertain && (errors.Is(err, errNoRows) || a.db.ambiguous(err)) {
			if t, rerr := a.held(ctx, name, owner); rerr == nil {
				tok, err = t, nil
			} else if !errors.Is(rerr, errNoRows) {
				err = rerr
			}
		}
		if !a.db.ambiguous(err) {
			break
		}
		uncertain = true
		if (attempts > 0 && i+1 >= attempts) || !retryPause(ctx, i) {
			if ctx.Err() != nil {
				if nerr := a.notGranted(ctx, name, owner, ttl, err, "whose reply was lost"); nerr != nil {
					return nil, nerr
				}
			}
			return nil, a.wrap("acquire", a.db.unknown(err))
		}
	}
	if cerr := ctx.Err(); cerr != nil && uncertain && err != nil && a.db.d != sqliteDialect &&
		(notSent(err) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) {
		// The context ended after an attempt whose reply was lost, and
		// stopped the next one: the row says whether that earlier attempt
		// holds the lease, as when the retries ran out above.
		if nerr := a.notGranted(ctx, name, owner, ttl, err, "whose reply was lost"); nerr != nil {
			return nil, nerr
		}
	}
	if cerr := ctx.Err(); cerr != nil && err != nil && !errors.Is(err, errNoRows) && !notSent(err) && a.db.d == sqliteDialect {
		// SQLite runs the statement in this process, so it has ended when
		// the call returns; but an error after the context ended does not
		// say whether it committed first. The row says.
		if nerr := a.notGranted(ctx, name, owner, ttl, err, "made as the context ended"); nerr != nil {
			return nil, nerr
		}
		return nil, a.wrap("acquire", fmt.Errorf("%w: the context ended during the grant, which may hold the lease: %w", fence.ErrUnknown, err))
	}
	switch {
	case errors.Is(err, errNoRows):
		return nil, fence.ErrHeld
	case a.db.d.checkViolation(err):
		return nil, fmt.Errorf("sqlfence: acquire %q: %w", name, fence.ErrTokensExhausted)
	case err != nil && uncertain:
		// A definite error now (a refused connection, the context ended
		// before a dial) says nothing of the earlier attempt whose reply
		// was lost.
		return nil, a.wrap("acquire", fmt.Errorf("%w: an earlier attempt whose reply was lost may hold the lease: %w", fence.ErrUnknown, err))
	case err != nil:
		return nil, a.wrap("acquire", err)
	}
	l := &lease{Base: leasekit.New(name, fence.Token(tok), ttl, a.opts.Drift, sent), a: a}
	l.keepConn(c)
	if l.Context().Err() != nil {
		return nil, a.giveBackLate(ctx, l)
	}
	return l, nil
}

// notGranted settles, after ctx ended, an attempt of owner's whose grant may
// be in flight (err: the attempt's last error; which: what grant it may have
// made, for the message). On a server the statement can still run after the
// row is read, so watchGrant gives back, in the background, a grant that lands
// later; giveBack reads the row now. It returns the error of a wait that ran
// out (ErrHeld joined with the context's error) when the row shows the attempt
// holds nothing, any grant it made being released, and nil when the row could
// not tell.
func (a *Acquirer) notGranted(ctx context.Context, name, owner string, ttl time.Duration, err error, which string) error {
	if a.db.d != sqliteDialect {
		go a.watchGrant(name, owner, ttl)
	}
	if !a.giveBack(ctx, name, owner, ttl) {
		return nil
	}
	return fmt.Errorf("sqlfence: acquire %q: not granted (a grant %s, if any, is released; %v): %w", name, which, err, errors.Join(fence.ErrHeld, ctx.Err()))
}

// errLate is a grant made or confirmed only after its local deadline (the
// statement waited for a row or file lock, or a lost reply was settled late):
// it holds nothing. It matches fence.ErrLost, what TryAcquire returns; Acquire
// tries again.
var errLate = fmt.Errorf("%w (granted past its local deadline)", fence.ErrLost)

// giveBackLate releases the row of l, a grant whose local deadline had passed
// when it came back, so that nobody waits out its ttl, and returns errLate.
func (a *Acquirer) giveBackLate(ctx context.Context, l *lease) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	if err := l.giveBackRelease(rctx); err != nil && !errors.Is(err, fence.ErrLost) {
		return fmt.Errorf("sqlfence: acquire %q: token %d given back (its release: %v; the row frees itself after the ttl): %w", l.Name(), l.Token(), err, errLate)
	}
	return fmt.Errorf("sqlfence: acquire %q: token %d given back: %w", l.Name(), l.Token(), errLate)
}

// giveBack settles, after ctx ended with a grant statement of owner's in
// flight, that owner holds nothing: the row shows another owner or none, or
// shows owner and is released. It reports whether it could tell, within two
// seconds of its own. A grant statement that reaches the server only after
// this read (still on the network) is not covered: it holds the row for its
// ttl.
func (a *Acquirer) giveBack(ctx context.Context, name, owner string, ttl time.Duration) bool {
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	// Until a read shows no live grant of owner's: one attempt can have more
	// than one grant statement in flight under its owner (each try after a
	// lost reply sends it again), and watchGrant, beside this, releases what
	// it finds too; so a release, whether it released the grant it read or
	// found it no longer live (fence.ErrLost), is followed by another read
	// (review of dd1aefe: a second grant of the attempt landed between the
	// read and the release, which found the first already released).
	for i := 0; i < maxAmbiguousRetries*2; i++ {
		// The read takes the row lock, so it waits for a grant statement
		// that already holds or waits for the row (one queued behind a
		// release that committed as the context ended) and sees its outcome.
		r, err := a.rowLocked(bctx, name)
		if err == nil && (r.owner != owner || r.left <= 0) {
			err = errNoRows
		}
		if errors.Is(err, errNoRows) {
			return true
		}
		if err != nil {
			return false
		}
		if err := a.giveBackToken(bctx, name, fence.Token(r.token), ttl); err != nil && !errors.Is(err, fence.ErrLost) {
			return false
		}
	}
	return false
}

// giveBackToken releases name's grant of token tok (ttl: the grant's) with
// giveBackRelease: a release only, never a handoff.
func (a *Acquirer) giveBackToken(ctx context.Context, name string, tok fence.Token, ttl time.Duration) error {
	l := &lease{Base: leasekit.New(name, tok, ttl, a.opts.Drift, time.Now()), a: a}
	return l.giveBackRelease(ctx)
}

// grantWatch and grantWatchMax bound watchGrant: it watches for at least
// grantWatch, and on until a read of the row completes (one that waited
// for the row's lock sees the outcome of a statement queued before it), for
// at most grantWatchMax (above MySQL's default innodb_lock_wait_timeout,
// 50s, after which a statement waiting for the row gives up).
const (
	grantWatch    = 2 * time.Second
	grantWatchMax = time.Minute
)

// watchGrant gives back, in the background, a grant of owner's that lands
// after its Acquire's context ended with the statement in flight. giveBack's
// read can run before the server runs the statement: MySQL's driver only
// closes the connection when the context ends, and the server still runs a
// statement it has received (or one waiting for the row's lock, once it
// gets it); pgx asks the server to cancel it, which does nothing when the
// request comes before the statement starts. Such a grant would hold the
// row for its ttl with nobody to release it (TestLineCancelAtGrant).
func (a *Acquirer) watchGrant(name, owner string, ttl time.Duration) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), grantWatchMax)
	defer cancel()
	for i := 0; ; i++ {
		rctx, rcancel := context.WithTimeout(ctx, 2*time.Second)
		r, err := a.rowLocked(rctx, name)
		rcancel()
		if err == nil && r.owner == owner && r.left > 0 {
			_ = a.giveBackToken(ctx, name, fence.Token(r.token), ttl)
		} else if (err == nil || errors.Is(err, errNoRows)) && time.Since(start) >= grantWatch {
			return
		}
		if !watchPause(ctx, i, ttl) {
			return
		}
	}
}

// watchPause waits before a watcher's read number i+1 (watchGrant,
// settleHandoff) of a grant of ttl: 10ms, doubling up to 500ms or a tenth of
// the ttl if that is less (never under 10ms), so that a watcher of an
// unreachable server reads at most twice a second, and a grant that lands
// late is given back within a tenth of its ttl of landing (a longer pause
// would hold a short lease's name for nobody for most of its ttl). It
// reports false when ctx ended first.
func watchPause(ctx context.Context, i int, ttl time.Duration) bool {
	most := max(min(500*time.Millisecond, ttl/10), 10*time.Millisecond)
	t := time.NewTimer(min(10*time.Millisecond<<min(i, 6), most))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// giveBackRelease releases l, a grant its caller gives back (it came back
// late, or its Acquire gave up): a release only, never a handoff, which
// would hand the lock to the head of the line, the very waiter giving it
// back from inside its attempt, or to a waiter behind it before
// the yield that lets it go first.
func (l *lease) giveBackRelease(ctx context.Context) error {
	if err := checkLive("release", ctx); err != nil {
		return err
	}
	defer l.End(context.Canceled)
	return l.releaseOnly(ctx)
}

// nonceSep separates the acquirer's owner from a grant's nonce in the lease
// row's owner column; Inspect shows the owner without it.
const nonceSep = "#"

func nonce() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// stripNonce returns the owner a grant recorded, without its nonce.
func stripNonce(owner string) string {
	i := len(owner) - len(nonceSep) - 16
	if i < 0 || owner[i:i+len(nonceSep)] != nonceSep {
		return owner
	}
	if _, err := hex.DecodeString(owner[i+len(nonceSep):]); err != nil {
		return owner
	}
	return owner[:i]
}

// held returns the token of the live grant that owner (with its nonce) holds
// on name; errNoRows when it holds none.
func (a *Acquirer) held(ctx context.Context, name, owner string) (int64, error) {
	r, err := a.row(ctx, name)
	if err != nil {
		return 0, err
	}
	if r.owner != owner || r.left <= 0 {
		return 0, errNoRows
	}
	return r.token, nil
}

// leaseRow is a lease row as the inspect statement reads it: left is the
// time left in milliseconds on the server's clock, expires the raw expiry (0
// after a release).
type leaseRow struct {
	token, left, expires int64
	owner                string
}

// row reads name's lease row; errNoRows when there is none.
func (a *Acquirer) row(ctx context.Context, name string) (leaseRow, error) {
	return a.readRow(ctx, a.inspect, name)
}

// rowLocked is row, read with the row's lock (not on SQLite): it waits for
// a statement that holds or waits for the row, and sees its outcome.
func (a *Acquirer) rowLocked(ctx context.Context, name string) (leaseRow, error) {
	return a.readRow(ctx, a.inspectLocked, name)
}

func (a *Acquirer) readRow(ctx context.Context, q, name string) (leaseRow, error) {
	var r leaseRow
	err := a.db.queryRow(ctx, q, []any{a.db.text(name)}, &r.token, &r.owner, &r.left, &r.expires)
	return r, err
}

// grantRow runs the grant statement (with the guard advance on SQLite, in one
// transaction) and returns the new token; errNoRows when the lease is held.
func (a *Acquirer) grantRow(ctx context.Context, name, owner string, ttl time.Duration) (int64, *sql.Conn, error) {
	args := []any{a.db.text(name), a.db.text(owner), ttlMs(ttl)}
	var tok int64
	if a.db.d == mysqlDialect {
		return a.grantMySQL(ctx, name, args)
	}
	if a.advance == "" {
		q := a.grant
		if a.grantAsync != "" && a.db.autocommit() {
			// Inside a caller's transaction the grant keeps it durable.
			q = a.grantAsync
		}
		err := a.db.queryRow(ctx, q, args, &tok)
		return tok, nil, err
	}
	err := a.db.inTx(ctx, func(c conn) error {
		if err := c.queryRow(ctx, a.grant, args, &tok); err != nil {
			return err
		}
		if _, err := c.exec(ctx, a.advance, name, tok); err != nil {
			return &guardStmtError{err}
		}
		return nil
	})
	return tok, nil, err
}

// guardStmtError is an error of the AdvanceGuards statement that a grant
// runs after its own (SQLite and MySQL): wrap tells a missing guard table
// from a missing lease table by it.
type guardStmtError struct{ err error }

func (e *guardStmtError) Error() string { return e.err.Error() }
func (e *guardStmtError) Unwrap() error { return e.err }

// Acquire waits until the lease on name is granted, pacing its attempts with the
// acquirer's Backoff. On PostgreSQL a release wakes the waiters of its name at
// once (LISTEN/NOTIFY), with the backoff as the fallback. A grant whose reply
// was lost is recognised or run again until ctx ends (see TryAcquire). A ctx
// without a deadline is bounded by the Backoff's MaxWait from the start, the
// first attempt included, so a MaxWait shorter than a round trip to the
// database never grants. See fence.Acquirer.
//
// The Acquire calls of one Acquirer that wait for the same name form a line in
// the order they began: only its head asks the database, a release through
// this Acquirer lets the head try at once, and a holder that releases and asks
// again joins at the back. So within one Acquirer waiters are granted in
// arrival order, unless the head's attempt stays stuck for more than a second
// (the others then ask too) or a grant goes elsewhere: to another Acquirer or
// process (no order is kept between them, on any dialect), or to a TryAcquire,
// which never waits in the line.
//
// On PostgreSQL and MySQL a release through this Acquirer, run as its own
// transaction and without AdvanceGuards, hands the lock to the head of the line in its
// own statement (a new, larger token; the head's ttl, counted from before the
// statement was sent): the head returns that lease without a statement of
// its own, and the released lease's context ends before. At most 8 handoffs
// run in a row; the next release releases, and with PostgreSQL's
// notifications leaves the head to hear of it from the server with the
// waiters of other processes (on MySQL, whose other processes poll, it lets
// the head try at once, as any release does). A
// head whose ctx ends while a handoff to it runs returns at once, and what
// the handoff grants is given back.
func (a *Acquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.checkLease("acquire", ctx, name, ttl); err != nil {
		if ctx != nil && ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			// Called with a context already done: a wait that ran out
			// before its first try, as fence.Acquirer says.
			return nil, fmt.Errorf("sqlfence: acquire %q: %w", name, wakeup.GaveUp(ctx))
		}
		return nil, err
	}
	var listen func(chan struct{}) func()
	if a.db.listen != nil && !a.opts.DisableNotify {
		listen = func(wake chan struct{}) func() { return a.db.listen.SubscribeChan(nameHash(name), wake) }
	} else if a.bells != nil {
		listen = func(wake chan struct{}) func() { return a.bells.subscribe(name, wake) }
	}
	var req any
	if a.transfer != "" {
		req = &handReq{ttl: ttl}
	}
	return a.line.AcquireHanded(ctx, a.opts.Backoff, name, req, listen, func(ctx context.Context, hint any) (fence.Lease, error) {
		h, _ := hint.(handHint)
		l, err := a.tryAcquire(ctx, name, ttl, 0, h)
		switch {
		case err == nil || ctx.Err() != nil:
		case a.db.d == sqliteDialect && isSQLiteBusy(err):
			// The file stayed locked past the busy timeout (another
			// connection writing a long time): the grant did nothing, and
			// the wait goes on within ctx.
			err = fmt.Errorf("%w (the database file stayed locked: %v)", fence.ErrHeld, err)
		case errors.Is(err, errLate):
			// Granted past its local deadline and given back: try again,
			// after the others of the line and a full backoff delay.
			err = fmt.Errorf("%w (%w: %v)", fence.ErrHeld, wakeup.ErrYield, err)
		}
		if err != nil && !errors.Is(err, fence.ErrHeld) && !errors.Is(err, fence.ErrUnknown) {
			if ctx.Err() != nil {
				// The wait ran out during an attempt that made no grant.
				err = wakeup.GaveUp(ctx)
			} else if ended(ctx) != nil {
				err = errors.Join(fence.ErrHeld, context.DeadlineExceeded)
			}
		}
		return l, err
	}, func(h wakeup.Handoff) { a.abandon(ctx, name, ttl, h) })
}

// ended returns ctx's cause when ctx is done or its deadline has passed (a
// dial whose socket deadline is ctx's can fail a moment before ctx's own
// timer marks it done); nil otherwise.
func ended(ctx context.Context) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return context.DeadlineExceeded
	}
	return nil
}

// checkLease checks the arguments of a grant; a context already done is
// looked at last, so that bad input is ErrInvalid whatever the context.
func (a *Acquirer) checkLease(op string, ctx context.Context, name string, ttl time.Duration) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if err := a.db.check(op); err != nil {
		return err
	}
	if err := checkText(op, "name", name); err != nil {
		return err
	}
	// The local deadline would be past before the grant is made.
	drift, whose := a.opts.Drift, "the acquirer's Drift"
	if drift <= 0 {
		drift, whose = leasekit.DefaultDrift(ttl), "the default drift margin (1% of the ttl + 2ms)"
	}
	if ttl > 0 && ttl <= drift {
		return &fence.InvalidError{Op: op, Arg: "ttl", Reason: fmt.Sprintf("%v is not longer than %s, %v: the lease would be lost at once", ttl, whose, drift)}
	}
	if err := leasekit.CheckTTL(op, ttl, 0, MaxTTL); err != nil {
		return err
	}
	return checkLive(op, ctx)
}

// ttlMs rounds ttl up to whole milliseconds, so a lease is never shorter on the
// server than asked.
func ttlMs(ttl time.Duration) int64 { return leasekit.CeilDiv(ttl, time.Millisecond) }

func (a *Acquirer) wrap(op string, err error) error {
	if a.db.d.missingTable(err) {
		a.keys.forget() // it may be created again with another name column
		// With AdvanceGuards a grant writes two tables: name the one the
		// database says is missing. On SQLite and MySQL the guard's is a
		// statement of its own; PostgreSQL's one statement names the
		// relation it could not find exactly as the statement quoted it.
		var ge *guardStmtError
		if a.guards != nil && (errors.As(err, &ge) ||
			a.db.d == postgresDialect && strings.Contains(err.Error(), `relation "`+a.guards.table+`" does not exist`)) {
			return &TableError{Table: a.guards.table, DDL: a.guards.ddl, Err: err}
		}
		return &TableError{Table: a.table, DDL: a.ddl, Err: err}
	}
	if a.db.d == mysqlDialect {
		err = invalidTooLong(a.keys, err)
	}
	return fmt.Errorf("sqlfence: %s: %w", op, err)
}

// lease is one grant from an Acquirer.
type lease struct {
	*leasekit.Base
	a     *Acquirer
	chain int // how many handoffs in a row, within this acquirer, led to this grant (see transfer)
	// conn is the connection the grant pinned (MySQL, see bell.go), which
	// may hold the bell; whoever swaps it out owns it.
	conn atomic.Pointer[sql.Conn]
}

// keepConn gives l its grant's pinned connection c (nil: none). When l's
// context ends and no release or handoff took c, c is closed: its server
// session ends, and with it the bell it may hold.
func (l *lease) keepConn(c *sql.Conn) {
	if c == nil {
		return
	}
	l.conn.Store(c)
	context.AfterFunc(l.Context(), func() {
		if c := l.conn.Swap(nil); c != nil {
			l.a.bells.unpin(c, false)
		}
	})
}

// Renew extends the lease by its ttl on the server's clock, if this grant still
// holds it. A lease whose context is done (released, or past its local
// deadline) returns fence.ErrLost without extending the row; a renewal
// confirmed only after the local deadline passed returns fence.ErrLost and
// releases the row. See fence.Lease.
func (l *lease) Renew(ctx context.Context) error {
	if err := checkLive("renew", ctx); err != nil {
		return err
	}
	uncertain := false // an earlier attempt may have extended the row
	for i := 0; ; i++ {
		if l.Context().Err() != nil {
			// Released, or past its local deadline: the holder was told it
			// lost the lease, so the server must not hold it for another ttl.
			if uncertain {
				// An earlier attempt whose reply was lost may have extended
				// the row: give it up.
				l.giveUp(ctx)
			}
			return l.lost()
		}
		sent := time.Now()
		n, err := l.a.db.change(ctx, l.a.renew, l.a.renewArgs(l.Name(), l.Token(), l.TTL())...)
		if l.a.db.ambiguous(err) {
			uncertain = true
			// Running a renewal again is safe: it extends from the server's
			// clock, and only while this grant holds the row.
			if i+1 < maxAmbiguousRetries && retryPause(ctx, i) {
				continue
			}
			return l.a.wrap("renew", l.a.db.unknown(err))
		}
		if err != nil && uncertain {
			// A definite error now (no connection, a refused dial) says
			// nothing of the earlier attempt whose reply was lost.
			return l.a.wrap("renew", fmt.Errorf("%w: an earlier attempt whose reply was lost may have renewed it: %w", fence.ErrUnknown, err))
		}
		if err != nil {
			return l.a.wrap("renew", l.a.db.unknown(err))
		}
		if n == 0 {
			l.End(fence.ErrLost)
			return l.lost()
		}
		if !l.Extend(sent) {
			// The server extended it, but the local deadline passed while the
			// renewal was on its way and the holder was told it lost the lease: it
			// stays lost, and the row is given up so others need not wait a ttl.
			l.giveUp(ctx)
			return l.lost()
		}
		return nil
	}
}

// giveUp releases the row of a lease that already ended locally, best effort
// (a lost reply is run again, as by Release): if it fails the row expires on
// its own.
func (l *lease) giveUp(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.TTL())
	defer cancel()
	_ = l.releaseRow(ctx)
}

// Release gives the lease up if this grant still holds it; otherwise it returns
// fence.ErrLost and changes nothing. The lease's context is done afterwards.
// A release whose reply was lost is run again, and one that finds its own
// release applied returns nil; when it cannot know it returns an error
// matching fence.ErrUnknown (the lease then ends on the server by its ttl at
// the latest). A release whose context ended before it got a connection of
// the pool sent nothing: it returns the context's error, and the lease ends
// on the server by its ttl.
func (l *lease) Release(ctx context.Context) error {
	if err := checkLive("release", ctx); err != nil {
		return err // nothing sent: the lease is still held
	}
	defer l.End(context.Canceled)
	return l.releaseRow(ctx)
}

// releaseRow runs the release statement, again after an ambiguous error, and
// recognises its own applied release (see Release).
func (l *lease) releaseRow(ctx context.Context) error {
	if l.chain < maxChain && l.a.transfer != "" && l.a.db.autocommit() {
		if p, req := l.a.line.Offer(l.Name()); p != nil {
			return l.transfer(ctx, p, req.(*handReq))
		}
	}
	return l.releaseOnly(ctx)
}

// releaseOnly is releaseRow without a handoff.
func (l *lease) releaseOnly(ctx context.Context) error {
	uncertain := false
	c := l.conn.Swap(nil)
	rang := false // the release let a bell go
	defer func() {
		if c != nil {
			l.a.bells.unpin(c, false) // it may still hold the bell
		}
	}()
	for i := 0; ; i++ {
		q := l.a.release
		if l.a.releaseAsync != "" && l.a.db.autocommit() {
			q = l.a.releaseAsync
		}
		var (
			n   int64
			err error
		)
		if c != nil {
			// On the bell's connection: the release lets the bell go.
			n, err = l.a.db.execIDOn(ctx, l.a.db.on(c), l.a.releaseBell, l.a.db.text(l.Name()), int64(l.Token()))
			rang = err == nil && n > 1
			if err == nil && n > 0 {
				l.a.bells.unpin(c, true)
			} else {
				l.a.bells.unpin(c, false)
			}
			c = nil
			if errors.Is(err, driver.ErrBadConn) {
				// Not sent (the pinned connection's session had ended,
				// and the bell with it): on a connection of the pool.
				n, err = l.a.db.change(ctx, q, l.a.db.text(l.Name()), int64(l.Token()))
			}
		} else {
			n, err = l.a.db.change(ctx, q, l.a.db.text(l.Name()), int64(l.Token()))
		}
		if l.a.db.ambiguous(err) {
			uncertain = true
			if i+1 < maxAmbiguousRetries && retryPause(ctx, i) {
				continue
			}
			// It may have landed: the head of the line tries (a wasted
			// wake-up costs one grant statement).
			l.a.line.Poke(l.Name())
			return l.a.wrap("release", l.a.db.unknown(err))
		}
		if err != nil && uncertain {
			// A definite error now (a refused connection) says nothing of
			// the earlier attempt whose reply was lost.
			l.a.line.Poke(l.Name())
			return l.a.wrap("release", fmt.Errorf("%w: an earlier attempt whose reply was lost may have released it: %w", fence.ErrUnknown, err))
		}
		if err != nil {
			return l.a.wrap("release", l.a.db.unknown(err))
		}
		if n == 0 && uncertain {
			err = l.released(ctx)
		} else if n == 0 {
			err = l.lost()
		}
		if !l.endsChain(rang) {
			l.a.line.Poke(l.Name())
		}
		return err
	}
}

// released judges a release that found nothing to release after an earlier
// attempt whose reply was lost: nil when the row shows this grant's own
// release (its token, expiry 0); ErrLost when the row still has this grant's
// token with an expiry (the release never applied: the lease had expired);
// otherwise (granted again since, the row gone, unreadable) an error matching
// fence.ErrUnknown, since the earlier attempt may have released it first.
func (l *lease) released(ctx context.Context) error {
	r, err := l.a.row(ctx, l.Name())
	switch {
	case err == nil && fence.Token(r.token) == l.Token() && r.expires == 0:
		return nil
	case err == nil && fence.Token(r.token) == l.Token():
		return l.lost()
	}
	return fmt.Errorf("sqlfence: release %q token %d: %w: an attempt whose reply was lost may have released it before the row changed", l.Name(), l.Token(), fence.ErrUnknown)
}

// renewArgs are the renew statement's arguments: name, token, ttl, or on
// MySQL ttl, name, token (the order of its placeholders).
func (a *Acquirer) renewArgs(name string, tok fence.Token, ttl time.Duration) []any {
	if a.db.d == mysqlDialect {
		return []any{ttlMs(ttl), a.db.text(name), int64(tok)}
	}
	return []any{name, int64(tok), ttlMs(ttl)}
}

func (l *lease) lost() error {
	return fmt.Errorf("sqlfence: lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}

var (
	_ fence.Inspector = (*Acquirer)(nil)
	_ fence.Bumper    = (*Acquirer)(nil)
)

// Inspect reports name's holder, time left and counter (the row's token).
func (a *Acquirer) Inspect(ctx context.Context, name string) (fence.LockInfo, error) {
	if err := a.db.checkCall("inspect", ctx); err != nil {
		return fence.LockInfo{}, err
	}
	if err := checkText("inspect", "name", name); err != nil {
		return fence.LockInfo{}, err
	}
	if err := a.keys.check(ctx, a.db.c, "inspect", name); err != nil {
		return fence.LockInfo{}, err
	}
	r, err := a.row(ctx, name)
	if errors.Is(err, errNoRows) {
		return fence.LockInfo{}, fmt.Errorf("sqlfence: inspect %q: %w", name, fence.ErrNotFound)
	}
	if err != nil {
		return fence.LockInfo{}, a.wrap("inspect", err)
	}
	info := fence.LockInfo{Name: name, Counter: fence.Token(r.token)}
	if r.left > 0 {
		info.Held, info.Token, info.Owner, info.TimeLeft = true, fence.Token(r.token), stripNonce(r.owner), time.Duration(r.left)*time.Millisecond
	}
	return info, nil
}

// Bump raises name's counter to to. The row's counter is also the holder's
// token, so a held lease is refused (fence.ErrHeld) rather than invalidated;
// a counter already at or above to is refused with fence.ErrInvalid. A name
// without a lease row (never granted, or its row deleted) gets a new row
// whose counter is the larger of to and the server's clock in microseconds,
// where a grant would start it (see Acquirer): a row deleted after it handed
// out tokens is never recreated below them.
func (a *Acquirer) Bump(ctx context.Context, name string, to fence.Token) error {
	if err := a.db.checkCall("bump", ctx); err != nil {
		return err
	}
	if err := checkText("bump", "name", name); err != nil {
		return err
	}
	if err := leasekit.CheckToken("bump", to); err != nil {
		return err
	}
	if err := a.keys.check(ctx, a.db.c, "bump", name); err != nil {
		return err
	}
	args := []any{a.db.text(name), int64(to)}
	if a.db.d == mysqlDialect {
		args = append(args, int64(to), int64(to))
	}
	n, err := a.db.change(ctx, a.bump, args...)
	if err != nil {
		return a.wrap("bump", a.db.unknown(err))
	}
	if n > 0 {
		return nil
	}
	info, err := a.Inspect(ctx, name)
	if err != nil {
		return err
	}
	if info.Counter >= to {
		return &fence.InvalidError{Op: "bump", Arg: "to", Reason: fmt.Sprintf("%d would not raise the counter, already at %d", to, info.Counter)}
	}
	return fmt.Errorf("sqlfence: bump %q: held by %s (token %d, %v left): %w", name, info.Owner, info.Token, info.TimeLeft, fence.ErrHeld)
}
