package sqlfence

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/wakeup"
	"github.com/go-sql-driver/mysql"
)

// MySQL wraps a database/sql handle on MySQL 8 or MariaDB 10.5+, opened with
// the "mysql" driver of github.com/go-sql-driver/mysql. The DSN's
// clientFoundRows setting does not matter: the statements do not rely on the
// rows-affected count (see the package documentation). MySQL has no
// notifications: a release wakes the waiters of other Acquirers (other
// processes) through a user-level lock, GET_LOCK, that the grant takes and
// the release lets go (the bell, see AcquirerOptions.DisableNotify); the
// lease row stays the only truth, and waiters also poll with the
// acquirer's Backoff.
//
// A nil db gives a *DB whose every use returns an error matching fence.ErrInvalid.
func MySQL(db *sql.DB) *DB {
	if db == nil {
		return &DB{d: mysqlDialect, nilHandle: true}
	}
	// A *sql.DB runs each statement on its own, in autocommit mode (the
	// server's default, which this package needs).
	return &DB{c: stdConn{q: db, inline: true}, d: mysqlDialect, sqlDB: db, ownTx: func() bool { return true }}
}

// mysqlNowUs is the server's clock in microseconds since the Unix epoch, read
// in UTC: UTC_TIMESTAMP and a DATETIME literal do not depend on the session's
// time_zone, and TIMESTAMPDIFF between two DATETIMEs is plain arithmetic.
// (UNIX_TIMESTAMP(NOW()) goes through the session's zone and back: in a zone
// with daylight saving the hour that repeats in autumn reads an hour off.)
const mysqlNowUs = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"

// On MySQL and MariaDB, keys and names are VARBINARY: compared byte for byte
// (as on PostgreSQL and SQLite, and unlike the case-insensitive default
// collations), and MaxKeyBytes (1024) fits InnoDB's 3072-byte index limit.
var mysqlDialect = &dialect{
	name:     "mysql",
	nowMs:    "(" + mysqlNowUs + " DIV 1000)",
	nowUs:    mysqlNowUs,
	greatest: "GREATEST",
	textType: "BLOB", blobType: "LONGBLOB", intType: "BIGINT",
	keyType: "VARBINARY(1024)", quoteChar: "`",
	missingTable:        func(err error) bool { return mysqlCode(err) == 1146 },
	checkViolation:      func(err error) bool { c := mysqlCode(err); return c == 4025 || c == 3819 },
	serializationFailed: func(err error) bool { c := mysqlCode(err); return c == 1213 || c == 1205 },
}

// mysqlText is how every name, key and text argument enters a MySQL
// statement: as bytes, whatever the connection's character set (utf8mb3
// cannot hold 4-byte characters, latin1 would reinterpret them) and sql_mode
// (outside strict mode a character the charset lacks becomes '?'). The
// argument itself is passed as []byte (see textArg), which the driver also
// sends as a binary literal when it interpolates parameters.
const mysqlText = "CAST(? AS BINARY)"

// mysqlMaybeEmpty takes a value, owner or fingerprint that may be empty.
// MariaDB's EMPTY_STRING_IS_NULL session mode turns an empty literal or
// parameter into NULL; these arguments are never NULL, so NULL means empty.
// The package's own empty literals are hex (x followed by two quotes), which
// the mode leaves alone.
const mysqlMaybeEmpty = "IFNULL(CAST(? AS BINARY), x'')"

// textArg returns s as the argument of a text parameter: on MySQL as []byte
// (see mysqlText), elsewhere as it is.
func textArg(mysql bool, s string) any {
	if mysql {
		return []byte(s)
	}
	return s
}

// mysqlInlineMax bounds the bytes of a []byte argument that mysqlInline
// writes into a statement (as hex, twice its size): larger values are sent
// as parameters, which the driver sends in parts when they are large.
const mysqlInlineMax = 4096

// runInline runs f with q's arguments written into it when inline is set
// (see mysqlInline), else with q and args as they are. A statement that the
// inlining made larger than the connection's packet limit (the DSN's
// maxAllowedPacket, or the server's max_allowed_packet) is refused by the
// driver before it sends anything (mysql.ErrPktTooLarge): f then runs again
// with every non-empty text or bytes argument as a parameter, which the
// driver splits as the limit needs.
func runInline(inline bool, q string, args []any, f func(q string, args []any) error) error {
	if !inline {
		return f(q, args)
	}
	iq, iargs := mysqlInline(q, args, mysqlInlineMax)
	err := f(iq, iargs)
	if errors.Is(err, mysql.ErrPktTooLarge) {
		if pq, pargs := mysqlInline(q, args, 0); pq != iq {
			return f(pq, pargs)
		}
	}
	return err
}

// mysqlInline returns q with its ? placeholders replaced by its arguments
// written as literals, and the arguments that remain parameters: with none,
// the driver sends it in one round trip (COM_QUERY), where a statement with
// arguments takes two (it is prepared, then executed) unless the DSN sets
// interpolateParams. The literals mean the same whatever the session's
// character set, sql_mode or NO_BACKSLASH_ESCAPES: integers in decimal,
// []byte of at most max bytes (and an empty one) as a hex literal (X'…', a
// binary string; a nil one as NULL, as the driver sends it), and strings
// made of ASCII letters, digits and ':' '_' '-' '.' in single quotes.
//
// A longer []byte, or another string, stays a parameter, sent as base64
// text and decoded by the server (FROM_BASE64(?)): the server converts a
// text parameter from the client's character set to the connection's, which
// would change the bytes of a key or value (and send it to another row than
// the same key inlined). Base64 is ASCII, which no conversion changes, and
// FROM_BASE64 returns a binary string. Any other argument (nil, a float)
// stays a parameter as it is. q must be one of this package's statements: it
// has no ? other than its placeholders (its identifiers are letters, digits
// and underscores, see quoteIdent); with a count of placeholders that
// differs from the arguments', q and args come back as they were.
func mysqlInline(q string, args []any, max int) (string, []any) {
	if len(args) == 0 {
		return q, args
	}
	var b strings.Builder
	b.Grow(len(q) + 24*len(args))
	var params []any
	param := func(v []byte) {
		b.WriteString("FROM_BASE64(?)")
		params = append(params, base64.StdEncoding.EncodeToString(v))
	}
	n := 0
	for i := 0; i < len(q); i++ {
		if q[i] != '?' {
			b.WriteByte(q[i])
			continue
		}
		if n == len(args) {
			return q, args
		}
		switch v := args[n].(type) {
		case int64:
			b.WriteString(strconv.FormatInt(v, 10))
		case int:
			b.WriteString(strconv.Itoa(v))
		case []byte:
			switch {
			case v == nil: // the driver sends a nil []byte as NULL
				b.WriteString("NULL")
			case len(v) <= max || len(v) == 0:
				b.WriteString("X'")
				b.WriteString(hex.EncodeToString(v))
				b.WriteByte('\'')
			default:
				param(v)
			}
		case string:
			switch {
			case v == "":
				b.WriteString("X''")
			case plainASCII(v):
				b.WriteByte('\'')
				b.WriteString(v)
				b.WriteByte('\'')
			default:
				param([]byte(v))
			}
		default:
			b.WriteByte('?')
			params = append(params, v)
		}
		n++
	}
	if n != len(args) {
		return q, args
	}
	return b.String(), params
}

// plainASCII reports whether s is made of ASCII letters, digits and
// ':' '_' '-' '.' only (nothing a MySQL string literal escapes).
func plainASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == ':' || c == '_' || c == '-' || c == '.') {
			return false
		}
	}
	return true
}

// text is textArg for db's dialect.
func (db *DB) text(s string) any { return textArg(db.d == mysqlDialect, s) }

func mysqlCode(err error) uint16 {
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		return me.Number
	}
	return 0
}

// IsMySQLRetryable reports whether err is a MySQL or MariaDB deadlock (1213)
// or lock wait timeout (1205): the transaction was rolled back (a lock wait
// timeout rolls back only the statement; RunTx rolls back the rest) and may be
// run again from the start.
func IsMySQLRetryable(err error) bool { return mysqlDialect.serializationFailed(err) }

// execID runs q and returns the LAST_INSERT_ID the server reported for it:
// the MySQL statements of this package set it, with LAST_INSERT_ID(expr), to a
// positive value exactly when they made their change (a grant's token, a
// write's token), and to 0 when they did not. Unlike the rows-affected count,
// it does not depend on clientFoundRows, nor on whether the new values equal
// the old ones.
func execID(ctx context.Context, c conn, q string, args ...any) (int64, error) {
	s, ok := c.(stdConn)
	if !ok {
		return 0, errors.New("sqlfence: MySQL statements need a database/sql handle")
	}
	r, err := s.result(ctx, q, args)
	if err != nil {
		return 0, err
	}
	return r.LastInsertId()
}

// execID runs one of the package's MySQL statements (see execID), retrying
// deadlocks.
func (db *DB) execID(ctx context.Context, q string, args ...any) (int64, error) {
	return db.execIDOn(ctx, db.c, q, args...)
}

// execIDOn is execID on c (a pinned connection, see bell.go).
func (db *DB) execIDOn(ctx context.Context, c conn, q string, args ...any) (int64, error) {
	for i := 0; ; i++ {
		id, err := execID(ctx, c, q, args...)
		if err == nil || i == maxStatementRetries || !db.d.serializationFailed(err) || !retryPause(ctx, i) {
			return id, err
		}
	}
}

// change runs one of the package's statements that change a row and reports
// whether it did (> 0): rows affected, or on MySQL the statement's
// LAST_INSERT_ID marker (see execID).
func (db *DB) change(ctx context.Context, q string, args ...any) (int64, error) {
	if db.d == mysqlDialect {
		return db.execID(ctx, q, args...)
	}
	return db.exec(ctx, q, args...)
}

// mysqlStatements replaces the acquirer's statements with MySQL's. Each sets
// LAST_INSERT_ID to the token when it granted, renewed, released or bumped, and
// to 0 when it did not (see execID). In the grant, the token and owner are
// assigned before expires_at, so their conditions see the old expiry.
func (a *Acquirer) mysqlStatements(t string) {
	now := mysqlDialect.nowMs
	expired := "expires_at <= " + now
	// %[7]s is the new owner: with the bell (grantBell, see bell.go) it also
	// takes the bell, whose key is the statement's last argument; IF
	// evaluates it only when the grant takes over an expired row (a new
	// row's grant takes no bell: nobody waited for it).
	grant := "INSERT INTO %[1]s (name, token, owner, expires_at) VALUES (%[4]s, LAST_INSERT_ID(%[6]s), %[5]s, %[2]s + ?) " +
		"ON DUPLICATE KEY UPDATE token = IF(%[3]s, LAST_INSERT_ID(token + 1), LAST_INSERT_ID(0) + token), " +
		"owner = IF(%[3]s, %[7]s, owner), expires_at = IF(%[3]s, VALUES(expires_at), expires_at)"
	a.grant = fmt.Sprintf(grant, t, now, expired, mysqlText, mysqlMaybeEmpty, mysqlNowUs, "VALUES(owner)")
	a.grantBell = fmt.Sprintf(grant, t, now, expired, mysqlText, mysqlMaybeEmpty, mysqlNowUs, "IF(GET_LOCK(?, 0) IS NULL, VALUES(owner), VALUES(owner))")
	// Renew's arguments come in the order ttl, name, token (see renewArgs).
	a.renew = fmt.Sprintf("UPDATE %[1]s SET token = LAST_INSERT_ID(token), expires_at = %[2]s + ? "+
		"WHERE name = %[3]s AND token = ? AND expires_at > %[2]s", t, now, mysqlText)
	// releaseBell also lets go of the bell (see bell.go): its
	// LAST_INSERT_ID is 1 + the number of user locks it let go (1 when the
	// lease held no bell), still 0 when it released nothing.
	release := "UPDATE %s SET token = LAST_INSERT_ID(token), expires_at = %s WHERE name = %s AND token = ? AND expires_at > %s"
	a.release = fmt.Sprintf(release, t, "0", mysqlText, now)
	a.releaseBell = fmt.Sprintf(release, t, "0 * LAST_INSERT_ID(1 + RELEASE_ALL_LOCKS())", mysqlText, now)
	a.inspect = fmt.Sprintf("SELECT token, owner, expires_at - %s, expires_at FROM %s WHERE name = %s", now, t, mysqlText)
	// Bump's arguments: name, to, to, to (a new row starts at the larger of
	// to and the clock, see Acquirer.Bump).
	a.bump = fmt.Sprintf("INSERT INTO %[1]s (name, token, owner, expires_at) VALUES (%[3]s, LAST_INSERT_ID(GREATEST(?, %[4]s)), x'', 0) "+
		"ON DUPLICATE KEY UPDATE token = IF(token < ? AND %[2]s, LAST_INSERT_ID(?), LAST_INSERT_ID(0) + token)", t, expired, mysqlText, mysqlNowUs)
}

// grantMySQL runs the grant (with the guard advance, in one transaction, when
// AdvanceGuards is set) and returns the new token; errNoRows when the lease
// is held. With bells (see bell.go) it runs on a pinned connection, taking
// the bell, and returns that connection when it granted.
func (a *Acquirer) grantMySQL(ctx context.Context, name string, args []any) (int64, *sql.Conn, error) {
	// The grant's LAST_INSERT_ID is its token, 0 when the lease is held.
	granted := func(tok int64, err error) (int64, error) {
		if err == nil && tok == 0 {
			err = errNoRows
		}
		return tok, err
	}
	if err := a.keys.check(ctx, a.db.c, "acquire", name); err != nil {
		return 0, nil, err
	}
	if a.advance == "" {
		var refused uint16 // the grant with the bell failed with this MySQL error
		if a.bells != nil {
			if c, free := a.bells.take(ctx, name); c != nil {
				tok, err := granted(a.db.execIDOn(ctx, a.db.on(c), a.grantBell, append(args, a.bells.key(name))...))
				if err == nil || errors.Is(err, errNoRows) {
					a.bells.accepted()
				}
				switch {
				case err == nil:
				case errors.Is(err, errNoRows) && free:
					a.bells.putBack(name, c)
				case errors.Is(err, errNoRows):
					a.bells.unpin(c, true)
				default:
					a.bells.unpin(c, false)
				}
				if free {
					a.bells.settled(name)
				}
				var me *mysql.MySQLError
				switch {
				case err == nil:
					return tok, c, nil
				case errors.Is(err, errNoRows):
					return 0, nil, err
				case errors.Is(err, driver.ErrBadConn):
					// Not sent (the pinned connection's session had
					// ended): on a connection of the pool, as without bells.
				case !errors.As(err, &me) || a.db.d.missingTable(err) || a.db.d.checkViolation(err) || a.db.d.serializationFailed(err):
					return 0, nil, err
				default:
					// Perhaps the server refuses GET_LOCK: the grant
					// without it tells (see bells.refused).
					refused = me.Number
				}
			}
		}
		tok, err := granted(a.db.execID(ctx, a.grant, args...))
		if refused != 0 && (err == nil || errors.Is(err, errNoRows)) {
			a.bells.refused(refused)
		}
		return tok, nil, err
	}
	if err := a.guards.keys.check(ctx, a.db.c, "acquire", name); err != nil {
		return 0, nil, err
	}
	var tok int64
	err := a.db.inTx(ctx, func(c conn) error {
		var err error
		if tok, err = granted(execID(ctx, c, a.grant, args...)); err != nil {
			return err
		}
		if _, err := execID(ctx, c, a.advance, args[0], tok); err != nil {
			return &guardStmtError{err}
		}
		return nil
	})
	return tok, nil, err
}

// mysqlStatements replaces the store's statements with MySQL's. The claim
// decides once, in a session variable, whether the key may be claimed (no
// record, released, or past its retention), since each assignment of an
// upsert sees the columns assigned before it; it sets LAST_INSERT_ID to the
// new fence when it claimed, 0 when not (see execID). The compare-and-set sets
// LAST_INSERT_ID to the new fence when it matched; its arguments come in the
// order of updateArgs. The state names are binary literals: a plain literal
// is in the connection's character set, whose bytes in ucs2, utf16 or utf32
// would be another state in the BLOB column.
func (s *IdempotencyStore) mysqlStatements(t, cols string) {
	now, nowUs := mysqlDialect.nowMs, mysqlDialect.nowUs
	claim := "@fencekit_claim"
	s.begin = fmt.Sprintf(`INSERT INTO %[1]s (`+"`key`"+`, fingerprint, state, fence, owner, lease_until, started_at, expires_at, result, result_dropped)
VALUES (%[5]s, %[6]s, _binary'claimed', LAST_INSERT_ID(%[3]s), %[6]s, %[2]s + ?, %[2]s, NULL, NULL, 0)
ON DUPLICATE KEY UPDATE
  fence = IF(%[4]s := (state = _binary'released' OR (expires_at IS NOT NULL AND expires_at <= %[2]s)),
    LAST_INSERT_ID(GREATEST(fence + 1, VALUES(fence))), LAST_INSERT_ID(0) + fence),
  fingerprint = IF(%[4]s, VALUES(fingerprint), fingerprint),
  owner = IF(%[4]s, VALUES(owner), owner),
  lease_until = IF(%[4]s, VALUES(lease_until), lease_until),
  started_at = IF(%[4]s, VALUES(started_at), started_at),
  result = IF(%[4]s, NULL, result),
  result_dropped = IF(%[4]s, 0, result_dropped),
  expires_at = IF(%[4]s, NULL, expires_at),
  state = IF(%[4]s, _binary'claimed', state)`, t, now, nowUs, claim, mysqlText, mysqlMaybeEmpty)
	s.get = fmt.Sprintf("SELECT %s FROM %s WHERE `key` = %s", cols, t, mysqlText)
	s.getLatest = s.get + " FOR UPDATE"
	s.purge = fmt.Sprintf("DELETE FROM %s WHERE state = _binary'released' OR (expires_at IS NOT NULL AND expires_at <= %s)", t, now)
	s.update = fmt.Sprintf(`UPDATE %[1]s SET fence = LAST_INSERT_ID(?), state = %[3]s, owner = %[4]s, lease_until = %[2]s + ?,
  started_at = IF(? = 1, %[2]s, started_at),
  expires_at = IF(? > 0, %[2]s + ?, NULL),
  result = ?, result_dropped = ?
WHERE `+"`key`"+` = %[3]s AND state = %[3]s AND fence = ?`, t, now, mysqlText, mysqlMaybeEmpty)
}

// ringGrantTimeout bounds a ringer's grant for the head of its line.
const ringGrantTimeout = 5 * time.Second

// ringGrant is the ringer's grant (see bells.handOn): it offers name's lock
// to the head of a's line and grants it on c, which holds name's bell, as
// the head's own grant would (its ttl, an owner with a nonce of its own, the
// local deadline counted from before the statement was sent), then hands the
// head the lease, which keeps c and the bell. It runs as soon as the ringer
// has the bell: the grant waits for the row's lock, which the statement
// that let the bell go holds until it commits, and so sees its outcome. A
// grant whose reply was lost is handed as a hint, with which the head's next
// attempt runs as its owner and recognises it (as after a lost handoff; when
// the head has left, watchGrant gives back what it granted); a head that
// left is handed nothing and a lease granted for it is released.
func (a *Acquirer) ringGrant(name string, c *sql.Conn) ringOutcome {
	// Only a head between attempts: one inside its own could be granted
	// too, and the ringer's grant would then land after the head had left.
	p, req := a.line.OfferIdle(name)
	if p == nil {
		return ringNoHead
	}
	ttl := req.(*handReq).ttl
	hint := handHint{owner: a.opts.Owner + nonceSep + nonce(), sent: time.Now(), ttl: ttl}
	ctx, cancel := context.WithTimeout(context.Background(), ringGrantTimeout)
	defer cancel()
	tok, err := a.db.execIDOn(ctx, a.db.on(c), a.grantBell, a.db.text(name), a.db.text(hint.owner), ttlMs(ttl), a.bells.key(name))
	if err == nil && tok == 0 {
		err = errNoRows
	}
	switch {
	case err == nil:
		a.bells.accepted()
		l := &lease{Base: leasekit.New(name, fence.Token(tok), ttl, a.opts.Drift, hint.sent), a: a}
		l.keepConn(c)
		if l.Context().Err() != nil {
			// Past the head's local deadline already: it holds nothing.
			// The head waits on at its own pace (its own attempts pace
			// late grants, see wakeup.ErrYield), and the ringer pauses
			// before it grants again (ringLate).
			// Withdrawn before the give-back, whose release pokes the
			// head: a poke while the offer stood would be lost.
			a.line.Withdraw(p)
			_ = a.giveBackLate(ctx, l)
			return ringLate
		}
		if h := (wakeup.Handoff{Lease: l}); !a.line.Hand(p, h) {
			// The head left meanwhile: released, as it would have.
			a.abandon(ctx, name, ttl, h)
			return ringGaveBack
		}
		return ringHanded
	case errors.Is(err, errNoRows):
		a.bells.accepted()
		a.line.Withdraw(p)
		return ringHeld
	case a.db.ambiguous(err):
		a.bells.unpin(c, false)
		if !a.line.Hand(p, wakeup.Handoff{Hint: hint}) {
			go a.watchGrant(name, hint.owner, ttl)
		}
		return ringFailed
	case a.db.d.missingTable(err) || a.db.d.serializationFailed(err):
		// Nothing granted, and nothing the head's own attempt should end
		// its wait with while the ringer can try again (a dropped table,
		// as a failed read of the row in watch; a lock wait timeout or a
		// deadlock): the head waits on at its own pace, and the ringer
		// tries again after a pause.
		a.bells.unpin(c, false)
		a.line.Withdraw(p)
		return ringFailed
	default:
		// A definite error (the counter exhausted, the session ended): the
		// head meets it, or is granted, in its own attempt, at once.
		a.bells.unpin(c, false)
		a.line.Hand(p, wakeup.Handoff{})
		return ringFailed
	}
}
