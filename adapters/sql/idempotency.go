package sqlfence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/jackc/pgx/v5"
)

// IdempotencyOptions configures an IdempotencyStore. A nil pointer means the defaults.
type IdempotencyOptions struct {
	// Table holds one row per key; it may be schema-qualified.
	// On MySQL its key column must compare bytes and hold every key, as
	// WriterOptions.KeyColumn says; otherwise the store's first Begin, Get
	// or Update returns an error matching fence.ErrInvalid.
	// Default: "fence_idempotency".
	Table string
}

// IdempotencyStore is an idempotency.Store in a SQL table. Each method is one
// statement, decided on the database server's clock (milliseconds). A new
// record's fence starts at that clock in microseconds (on SQLite, whose clock
// counts milliseconds, this host's clock read while the statement runs), so
// a key claimed again after Purge gets a larger fence as long as the clock
// does not step back (see idempotency.Store). On PostgreSQL it is also an idempotency.Notifier: a change that ends an owner's
// hold (completed, failed, released, unknown) runs pg_notify in the same
// statement, and Do with Wait wakes on it through LISTEN. On MySQL a
// fingerprint or owner over 65535 bytes (its BLOB column) is refused with an
// error matching fence.ErrInvalid: hash a long request into its fingerprint.
type IdempotencyStore struct {
	db    *DB
	table string
	ddl   string

	begin, get, update, purge string
	// getLatest is get as a locking read on MySQL: in a caller's transaction
	// under REPEATABLE READ a plain read returns the transaction's snapshot,
	// which can predate the change that made a compare-and-set fail.
	getLatest string
	keys      *keyColumn // MySQL: the key column must compare bytes
}

var _ idempotency.Store = (*IdempotencyStore)(nil)

// NewIdempotencyStore returns a store on db. It returns an error matching
// fence.ErrInvalid for a table name that is not a plain SQL identifier.
func NewIdempotencyStore(db *DB, opts *IdempotencyOptions) (*IdempotencyStore, error) {
	if err := db.check("new idempotency store"); err != nil {
		return nil, err
	}
	table := "fence_idempotency"
	if opts != nil && opts.Table != "" {
		table = opts.Table
	}
	t, err := db.d.quoteIdent("new idempotency store", "table", table, true)
	if err != nil {
		return nil, err
	}
	d := db.d
	now := d.nowMs
	s := &IdempotencyStore{db: db, table: table}
	s.ddl = fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
  %skey%s %s PRIMARY KEY,
  fingerprint %s NOT NULL,
  state %s NOT NULL,
  fence %s NOT NULL,
  owner %s NOT NULL,
  lease_until %s NOT NULL,
  started_at %s NOT NULL,
  expires_at %s,
  result %s,
  result_dropped %s NOT NULL DEFAULT 0
)`, t, d.quoteChar, d.quoteChar, d.keyType, d.textType, d.textType, d.intType, d.textType, d.intType, d.intType, d.intType, d.blobType, d.intType)
	cols := fmt.Sprintf("fingerprint, state, fence, owner, lease_until - %s, %s - started_at, result, result_dropped", now, now)
	// A claim creates the row, or takes over a released one or one past its
	// retention, raising the fence. Otherwise it changes nothing. A fence is
	// never below the server's clock in microseconds when it was granted, so a
	// key whose row was purged starts again above every fence it had.
	s.begin = fmt.Sprintf(`INSERT INTO %[1]s AS cur (key, fingerprint, state, fence, owner, lease_until, started_at, expires_at, result, result_dropped)
VALUES ($1, $2, 'claimed', %[3]s, $3, %[2]s + $4, %[2]s, NULL, NULL, 0)
ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, state = 'claimed', fence = %[4]s(cur.fence + 1, %[3]s),
  owner = excluded.owner, lease_until = excluded.lease_until, started_at = excluded.started_at,
  expires_at = NULL, result = NULL, result_dropped = 0
WHERE cur.state = 'released' OR (cur.expires_at IS NOT NULL AND cur.expires_at <= %[2]s)
RETURNING fence`, t, now, d.nowUs, d.greatest)
	s.get = fmt.Sprintf("SELECT %s FROM %s WHERE key = $1", cols, t)
	s.getLatest = s.get
	// The compare-and-set: state and fence must be what the caller saw.
	s.update = fmt.Sprintf(`UPDATE %[1]s SET state = $4, fence = $5, owner = $6, lease_until = %[2]s + $7,
  started_at = CASE WHEN $8 = 1 THEN %[2]s ELSE started_at END,
  expires_at = CASE WHEN CAST($9 AS BIGINT) > 0 THEN %[2]s + CAST($9 AS BIGINT) ELSE NULL END,
  result = $10, result_dropped = $11
WHERE key = $1 AND state = $2 AND fence = $3
RETURNING key, %[3]s`, t, now, cols)
	if d == postgresDialect {
		// Every change of a record commits to disk, also where
		// synchronous_commit is off (see pgDurable): a claim or an armed
		// record lost in a crash would let the effect run again.
		s.update = fmt.Sprintf(`WITH u AS (%s)
SELECT u.* FROM u LEFT JOIN LATERAL (
  SELECT pg_notify('%s', md5('idem:' || u.key)) WHERE u.state NOT IN ('claimed', 'armed')) n ON true WHERE %s`, s.update, releaseChannel, pgDurable)
		s.begin = fmt.Sprintf("WITH c AS (%s) SELECT fence FROM c WHERE %s", s.begin, pgDurable)
	}
	s.purge = fmt.Sprintf("DELETE FROM %s WHERE state = 'released' OR (expires_at IS NOT NULL AND expires_at <= %s)", t, now)
	if d == mysqlDialect {
		s.keys = newKeyColumn("table", table, "key", "key")
		s.mysqlStatements(t, cols)
	}
	return s, nil
}

// DDL returns the CREATE TABLE statement of the store's table.
func (s *IdempotencyStore) DDL() string { return s.ddl }

// CreateTable creates the store's table if it does not exist.
func (s *IdempotencyStore) CreateTable(ctx context.Context) error {
	return s.db.createTable(ctx, s.ddl)
}

func (s *IdempotencyStore) wrap(op string, err error) error {
	if s.db.d.missingTable(err) {
		s.keys.forget() // it may be created again with another key column
		return &TableError{Table: s.table, DDL: s.ddl, Err: err}
	}
	if s.db.d == mysqlDialect {
		err = invalidTooLong(s.keys, err)
	}
	return fmt.Errorf("sqlfence: idempotency %s: %w", op, err)
}

func ms(d time.Duration) int64 { return d.Milliseconds() }

// mysqlBlobBytes is what a MySQL BLOB column (the store's fingerprint and
// owner) holds; a longer value is refused (strict mode) or cut.
const mysqlBlobBytes = 1<<16 - 1

// checkStored refuses text PostgreSQL cannot store (NUL, invalid UTF-8); it
// may be empty and is not indexed, so it has no length limit but MySQL's
// BLOB column (64 KiB), which would refuse a longer one or cut it (and a
// cut fingerprint no longer matches its own request).
func (st *IdempotencyStore) checkStored(op, arg, s string) error {
	if s == "" {
		return nil
	}
	max := 0
	if st.db.d == mysqlDialect {
		max = mysqlBlobBytes
	}
	return leasekit.CheckText(op, arg, s, max)
}

func (s *IdempotencyStore) checkUpdate(op string, ctx context.Context, key string, ch idempotency.Change) error {
	if err := s.db.checkCall(op, ctx); err != nil {
		return err
	}
	if err := checkText(op, "key", key); err != nil {
		return err
	}
	if err := s.checkStored(op, "owner", ch.Owner); err != nil {
		return err
	}
	if ch.Lease < 0 || ch.Retention < 0 {
		return &fence.InvalidError{Op: op, Arg: "change", Reason: "negative lease or retention"}
	}
	return nil
}

// Begin claims key, or returns its record. A claim whose reply was lost (it
// may have been made) returns an error matching fence.ErrUnknown: read the
// record to know. See idempotency.Store.
func (s *IdempotencyStore) Begin(ctx context.Context, key, fingerprint, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	if err := s.db.checkCall("idempotency begin", ctx); err != nil {
		return idempotency.Record{}, false, err
	}
	if err := checkText("idempotency begin", "key", key); err != nil {
		return idempotency.Record{}, false, err
	}
	if err := s.checkStored("idempotency begin", "fingerprint", fingerprint); err != nil {
		return idempotency.Record{}, false, err
	}
	if err := s.checkStored("idempotency begin", "owner", owner); err != nil {
		return idempotency.Record{}, false, err
	}
	if lease <= 0 {
		return idempotency.Record{}, false, &fence.InvalidError{Op: "idempotency begin", Arg: "lease", Reason: fmt.Sprintf("%v is not positive", lease)}
	}
	if err := s.keys.check(ctx, s.db.c, "idempotency begin", key); err != nil {
		return idempotency.Record{}, false, err
	}
	var f int64
	var err error
	if s.db.d == mysqlDialect {
		if f, err = s.db.execID(ctx, s.begin, s.db.text(key), s.db.text(fingerprint), s.db.text(owner), ms(lease)); err == nil && f == 0 {
			err = errNoRows // not claimed: the key has a live record
		}
	} else {
		err = s.db.queryRow(ctx, s.begin, []any{key, fingerprint, owner, ms(lease)}, &f)
	}
	if err == nil {
		return idempotency.Record{Key: key, Fingerprint: fingerprint, State: idempotency.Claimed, Fence: fence.Token(f), Owner: owner, LeaseLeft: lease}, true, nil
	}
	if !errors.Is(err, errNoRows) {
		return idempotency.Record{}, false, s.wrap("begin", s.db.unknown(err))
	}
	rec, err := s.Get(ctx, key)
	return rec, false, err
}

func scanRecord(key string, scan func(dest ...any) error) (idempotency.Record, error) {
	var (
		r                   idempotency.Record
		state               string
		f, leaseMs, startMs int64
		dropped             int64
	)
	if err := scan(&r.Fingerprint, &state, &f, &r.Owner, &leaseMs, &startMs, &r.Result, &dropped); err != nil {
		return r, err
	}
	r.Key, r.State, r.Fence = key, idempotency.State(state), fence.Token(f)
	r.LeaseLeft, r.InProgressFor = time.Duration(leaseMs)*time.Millisecond, time.Duration(startMs)*time.Millisecond
	r.ResultDropped = dropped != 0
	return r, nil
}

// Get returns key's record, or fence.ErrNotFound.
func (s *IdempotencyStore) Get(ctx context.Context, key string) (idempotency.Record, error) {
	if err := s.db.checkCall("idempotency get", ctx); err != nil {
		return idempotency.Record{}, err
	}
	if err := checkText("idempotency get", "key", key); err != nil {
		return idempotency.Record{}, err
	}
	if err := s.keys.check(ctx, s.db.c, "idempotency get", key); err != nil {
		return idempotency.Record{}, err
	}
	return s.getOn(ctx, s.db.c, key)
}

func (s *IdempotencyStore) getOn(ctx context.Context, c conn, key string) (idempotency.Record, error) {
	return s.readOn(ctx, c, s.get, key)
}

// readOn runs q, get or getLatest, for key on c.
func (s *IdempotencyStore) readOn(ctx context.Context, c conn, q, key string) (idempotency.Record, error) {
	rec, err := scanRecord(key, func(dest ...any) error { return c.queryRow(ctx, q, []any{s.db.text(key)}, dest...) })
	if errors.Is(err, errNoRows) {
		return rec, fence.ErrNotFound
	}
	if err != nil {
		return rec, s.wrap("get", err)
	}
	return rec, nil
}

// Update is the compare-and-set on state and fence. A change whose reply was
// lost (it may have been applied) returns an error matching fence.ErrUnknown:
// read the record to know. See idempotency.Store.
func (s *IdempotencyStore) Update(ctx context.Context, key string, from idempotency.State, fromFence fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if err := s.checkUpdate("idempotency update", ctx, key, ch); err != nil {
		return idempotency.Record{}, err
	}
	if err := s.keys.check(ctx, s.db.c, "idempotency update", key); err != nil {
		return idempotency.Record{}, err
	}
	return s.updateOn(ctx, s.db.c, key, from, fromFence, ch, s.db.unknown)
}

// CompleteTx records key's result inside tx, the caller's own database/sql
// transaction on the store's database, so that the caller's local writes and
// the key's completion commit together or not at all. The record must be armed
// with fence f (the attempt's Result.Fence); retention defaults to 24h. A nil
// ctx or tx, or an empty key, returns an error matching fence.ErrInvalid before
// any statement runs. A record armed with a larger fence returns a
// *fence.StaleError, one in another state idempotency.ErrStateChanged, no
// record fence.ErrNotFound (as Update); then tx should be rolled back.
func (s *IdempotencyStore) CompleteTx(ctx context.Context, tx *sql.Tx, key string, f fence.Token, result []byte, retention time.Duration) error {
	if err := s.checkUpdate("complete", ctx, key, idempotency.Change{}); err != nil {
		return err
	}
	c, err := stdTxConn("complete", s.db.d, tx)
	if err != nil {
		return err
	}
	return s.completeOn(ctx, c, key, f, result, retention)
}

// CompletePgxTx is CompleteTx for a native pgx transaction on PostgreSQL, with
// the same guarantees and errors. On a store whose database is not PostgreSQL
// it returns an error matching fence.ErrInvalid, before any statement runs.
func (s *IdempotencyStore) CompletePgxTx(ctx context.Context, tx pgx.Tx, key string, f fence.Token, result []byte, retention time.Duration) error {
	if err := s.checkUpdate("complete", ctx, key, idempotency.Change{}); err != nil {
		return err
	}
	c, err := pgxTxConn("complete", s.db.d, tx)
	if err != nil {
		return err
	}
	return s.completeOn(ctx, c, key, f, result, retention)
}

// completeOn runs CompleteTx's compare-and-set on c, the caller's transaction.
func (s *IdempotencyStore) completeOn(ctx context.Context, c conn, key string, f fence.Token, result []byte, retention time.Duration) error {
	if err := s.keys.check(ctx, c, "complete", key); err != nil {
		return err
	}
	if retention <= 0 {
		retention = 24 * time.Hour
	}
	// In the caller's transaction a lost reply is the caller's commit to
	// judge: this statement commits nothing by itself.
	_, err := s.updateOn(ctx, c, key, idempotency.Armed, f, idempotency.Change{State: idempotency.Completed, Fence: f, Result: result, Retention: retention},
		func(err error) error { return err })
	return err
}

// updateOn runs the compare-and-set on c; unknown marks the errors of a
// change that may have been applied.
func (s *IdempotencyStore) updateOn(ctx context.Context, c conn, key string, from idempotency.State, fromFence fence.Token, ch idempotency.Change,
	unknown func(error) error) (idempotency.Record, error) {
	restart := 0
	if ch.Restart {
		restart = 1
	}
	dropped := 0
	if ch.ResultDropped {
		dropped = 1
	}
	args := []any{key, string(from), int64(fromFence), string(ch.State), int64(ch.Fence), ch.Owner, ms(ch.Lease), restart, ms(ch.Retention), ch.Result, dropped}
	if s.db.d == mysqlDialect {
		// The order of the MySQL statement's placeholders (see mysqlStatements).
		args = []any{int64(ch.Fence), []byte(ch.State), []byte(ch.Owner), ms(ch.Lease), restart, ms(ch.Retention), ms(ch.Retention), ch.Result, dropped,
			[]byte(key), []byte(from), int64(fromFence)}
	}
	var gotKey string
	var rec idempotency.Record
	var err error
	if s.db.d == mysqlDialect {
		// The compare-and-set, then a read of the record it wrote.
		var id int64
		if id, err = execID(ctx, c, s.update, args...); err == nil && id == 0 {
			err = errNoRows
		}
		if err == nil {
			// The change was made; a failed read of it leaves the caller
			// not knowing the record.
			rec, err := s.getOn(ctx, c, key)
			if notSent(err) || notConnected(err) {
				// The read got no connection, which says nothing of the
				// change: it was made.
				err = fmt.Errorf("%w: the change was made, and the read of the record it wrote was not sent: %w", fence.ErrUnknown, err)
			}
			return rec, unknown(err)
		}
	} else {
		rec, err = scanRecord(key, func(dest ...any) error {
			return c.queryRow(ctx, s.update, args, append([]any{&gotKey}, dest...)...)
		})
	}
	if err == nil {
		return rec, nil
	}
	if !errors.Is(err, errNoRows) {
		return rec, s.wrap("update", unknown(err))
	}
	// Why the compare-and-set failed is in the latest committed record, not
	// in the snapshot of a caller's transaction (CompleteTx).
	cur, err := s.readOn(ctx, c, s.getLatest, key)
	if err != nil {
		return cur, err
	}
	if cur.Fence != fromFence {
		return cur, &fence.StaleError{Key: key, Offered: fromFence, Current: cur.Fence}
	}
	return cur, &idempotency.StateError{Key: key, Want: from, Got: cur.State}
}

// Purge removes released records and completed or failed ones past their retention.
func (s *IdempotencyStore) Purge(ctx context.Context) (int, error) {
	if err := s.db.checkCall("idempotency purge", ctx); err != nil {
		return 0, err
	}
	n, err := s.db.exec(ctx, s.purge)
	if err != nil {
		return 0, s.wrap("purge", err)
	}
	return int(n), nil
}

// Subscribe wakes a waiting Do when key's record leaves the owner's hands (on
// PostgreSQL; elsewhere the channel never receives and Do polls).
func (s *IdempotencyStore) Subscribe(key string) (<-chan struct{}, func()) {
	if s.db.listen == nil {
		return nil, func() {}
	}
	return s.db.listen.subscribe("idem:" + key)
}
