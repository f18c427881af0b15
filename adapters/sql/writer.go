package sqlfence

import (
	"context"
	"errors"
	"fmt"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// WriterOptions configures a Writer. A nil *WriterOptions means the defaults.
// Names are plain SQL identifiers; anything else is refused by NewWriter before
// any SQL runs, with an error matching fence.ErrInvalid that names the option.
type WriterOptions struct {
	// Table holds one row per key; it may be schema-qualified. Default: "fence_values".
	Table string
	// KeyColumn is the table's primary key (or a unique column). Default: "key".
	// On MySQL it must compare bytes: VARBINARY, or VARCHAR with a NO PAD
	// binary collation (utf8mb4_nopad_bin, utf8mb4_0900_bin). Under a
	// case-insensitive or PAD SPACE collation (utf8mb4_bin), CHAR or BINARY,
	// two keys share one row, so the Writer's first Write, Delete or Read
	// returns an error matching fence.ErrInvalid instead; so does a key
	// longer than the column holds (a non-strict sql_mode would cut it).
	// The column is read on first use, and again when the table was found
	// missing or a write met a row that is not its key's own. On PostgreSQL
	// it must be TEXT or VARCHAR (or BYTEA) with a deterministic collation:
	// CHARACTER(n), NAME, CITEXT, another type or a nondeterministic
	// collation is refused the same way. On SQLite, unchecked: no COLLATE
	// NOCASE or RTRIM.
	KeyColumn string
	// ValueColumn holds the value; it must be nullable, since a fenced delete
	// sets it to NULL. Default: "value".
	ValueColumn string
	// FenceColumn holds the largest token accepted for the key. Default: "fence".
	FenceColumn string
}

// Writer is a fence.FencedWriter, fence.Reader and fence.Deleter on one table.
// Each Write and Delete is one upsert statement that applies only when the stored
// fence is not larger than the offered token. It is safe for concurrent use.
//
// On PostgreSQL a Write or Delete that applies commits to the local disk even
// where synchronous_commit is off (it sets local for its transaction, and
// inside a caller's transaction for that one): an accepted fence lost in a
// crash would let an older token in again. The same holds for a Guards
// advance and for the IdempotencyStore's claims and updates.
type Writer struct {
	db    *DB
	table string // as given, for messages
	ddl   string

	update, upsert, tombstone, read, current string
	keys                                     *keyColumn // MySQL: the key column must compare bytes
}

var (
	_ fence.FencedWriter = (*Writer)(nil)
	_ fence.Reader       = (*Writer)(nil)
	_ fence.Deleter      = (*Writer)(nil)
)

// NewWriter returns a Writer on db. It returns an error matching fence.ErrInvalid
// for a table or column name that is not a plain SQL identifier. It does not touch
// the database; see CreateTable.
func NewWriter(db *DB, opts *WriterOptions) (*Writer, error) {
	if err := db.check("new writer"); err != nil {
		return nil, err
	}
	var o WriterOptions
	if opts != nil {
		o = *opts
	}
	def := func(s *string, d string) {
		if *s == "" {
			*s = d
		}
	}
	def(&o.Table, "fence_values")
	def(&o.KeyColumn, "key")
	def(&o.ValueColumn, "value")
	def(&o.FenceColumn, "fence")
	t, err := db.d.quoteIdent("new writer", "table", o.Table, true)
	if err != nil {
		return nil, err
	}
	cols := make([]string, 3)
	for i, c := range []struct{ what, name string }{{"key column", o.KeyColumn}, {"value column", o.ValueColumn}, {"fence column", o.FenceColumn}} {
		if cols[i], err = db.d.quoteIdent("new writer", c.what, c.name, false); err != nil {
			return nil, err
		}
	}
	k, v, f := cols[0], cols[1], cols[2]
	if k == v || k == f || v == f {
		return nil, &fence.InvalidError{Op: "new writer", Arg: "columns", Reason: "key, value and fence columns must differ"}
	}
	d := db.d
	w := &Writer{db: db, table: o.Table}
	w.ddl = fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s (\n  %s %s PRIMARY KEY,\n  %s %s,\n  %s %s NOT NULL CHECK (%s BETWEEN 1 AND %d)\n)",
		t, k, d.keyType, v, d.blobType, f, d.intType, f, uint64(fence.MaxToken))
	if d == postgresDialect {
		w.keys = newPgKeyColumn("key column", o.Table, t, o.KeyColumn, "key")
	}
	if d == mysqlDialect {
		w.keys = newKeyColumn("key column", o.Table, o.KeyColumn, "key")
		// One upsert per write. The value is assigned before the fence, so its
		// condition sees the old fence. A row whose key is not the key's own
		// bytes (a key column that pads or folds case) is left alone, and the
		// write is refused as stale, which fenced then finds out. LAST_INSERT_ID is the token when the
		// write was made (also when it changed nothing, an equal token writing
		// equal bytes), 0 when the key holds a larger token (see execID).
		w.upsert = fmt.Sprintf("INSERT INTO %[1]s (%[2]s, %[3]s, %[4]s) VALUES (%[5]s, %[6]s, LAST_INSERT_ID(?)) ON DUPLICATE KEY UPDATE "+
			"%[3]s = IF(%[4]s <= VALUES(%[4]s) AND %[7]s, VALUES(%[3]s), %[3]s), "+
			"%[4]s = IF(%[4]s <= VALUES(%[4]s) AND %[7]s, LAST_INSERT_ID(VALUES(%[4]s)), LAST_INSERT_ID(0) + %[4]s)", t, k, v, f, mysqlText, mysqlMaybeEmpty, sameKey(k))
		w.tombstone = fmt.Sprintf("INSERT INTO %[1]s (%[2]s, %[3]s, %[4]s) VALUES (%[5]s, NULL, LAST_INSERT_ID(?)) ON DUPLICATE KEY UPDATE "+
			"%[3]s = IF(%[4]s <= VALUES(%[4]s) AND %[6]s, NULL, %[3]s), "+
			"%[4]s = IF(%[4]s <= VALUES(%[4]s) AND %[6]s, LAST_INSERT_ID(VALUES(%[4]s)), LAST_INSERT_ID(0) + %[4]s)", t, k, v, f, mysqlText, sameKey(k))
		// An existing key, the common case, takes a fenced UPDATE alone (its
		// arguments: value, token, key, token); the upsert covers a new key.
		w.update = fmt.Sprintf("UPDATE %[1]s SET %[3]s = %[6]s, %[4]s = LAST_INSERT_ID(?) WHERE %[2]s = %[5]s AND %[4]s <= ?", t, k, v, f, mysqlText, mysqlMaybeEmpty)
		w.read = fmt.Sprintf("SELECT %s, %s, CASE WHEN %s IS NULL THEN 1 ELSE 0 END FROM %s WHERE %s = %s", v, f, v, t, k, mysqlText)
		w.current = fmt.Sprintf("SELECT %s FROM %s WHERE %s = %s", f, t, k, mysqlText)
		return w, nil
	}
	// Each statement decides and writes at once: it changes the row only when
	// the stored fence is not larger than the offered one (equal tokens pass).
	// Where the dialect says so, a fenced UPDATE serves the common case, an
	// existing key; the upsert covers a new key (and tells a stale write from a
	// missing row without a race).
	w.update = fmt.Sprintf("UPDATE %s SET %s = $2, %s = $3 WHERE %s = $1 AND %s <= $3", t, v, f, k, f)
	w.upsert = fmt.Sprintf("INSERT INTO %s AS cur (%s, %s, %s) VALUES ($1, $2, $3) "+
		"ON CONFLICT (%s) DO UPDATE SET %s = excluded.%s, %s = excluded.%s WHERE cur.%s <= excluded.%s",
		t, k, v, f, k, v, v, f, f, f, f)
	w.tombstone = fmt.Sprintf("INSERT INTO %s AS cur (%s, %s, %s) VALUES ($1, NULL, $2) "+
		"ON CONFLICT (%s) DO UPDATE SET %s = NULL, %s = excluded.%s WHERE cur.%s <= excluded.%s",
		t, k, v, f, k, v, f, f, f, f)
	// The NULL test is explicit: a driver may scan an empty value as nil.
	w.read = fmt.Sprintf("SELECT %s, %s, CASE WHEN %s IS NULL THEN 1 ELSE 0 END FROM %s WHERE %s = $1", v, f, v, t, k)
	w.current = fmt.Sprintf("SELECT %s FROM %s WHERE %s = $1", f, t, k)
	if d == postgresDialect {
		// An accepted write's fence must survive a crash, also where
		// synchronous_commit is off: lost, it would let an older token in
		// again (see pgDurable).
		w.update, w.upsert, w.tombstone = pgDurableChange(w.update), pgDurableChange(w.upsert), pgDurableChange(w.tombstone)
	}
	return w, nil
}

// DDL returns the CREATE TABLE statement for the writer's table in its dialect.
func (w *Writer) DDL() string { return w.ddl }

// CreateTable creates the writer's table if it does not exist.
func (w *Writer) CreateTable(ctx context.Context) error { return w.db.createTable(ctx, w.ddl) }

// Write stores value under key with token, unless key has accepted a larger token,
// in one statement. A nil value is stored as an empty value. A write whose
// reply was lost (it may have been applied) returns an error matching
// fence.ErrUnknown. See fence.FencedWriter.
func (w *Writer) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	if err := w.checkWrite("write", ctx, key, token); err != nil {
		return err
	}
	if value == nil {
		value = []byte{} // NULL marks a deleted key
	}
	if w.db.d == mysqlDialect {
		n, err := w.db.execID(ctx, w.update, value, int64(token), w.db.text(key), int64(token))
		if err != nil {
			return w.wrap("write", w.db.unknown(err))
		}
		if n > 0 {
			return nil
		}
	} else if w.db.d.updateFirst {
		n, err := w.db.exec(ctx, w.update, key, value, int64(token))
		if err != nil {
			return w.wrap("write", w.db.unknown(err))
		}
		if n > 0 {
			return nil
		}
	}
	return w.fenced(ctx, "write", key, token, w.upsert, w.db.text(key), value, int64(token))
}

// Delete removes the value under key, keeping the fence at token (a tombstone), unless
// key has accepted a larger token. A delete whose reply was lost returns an
// error matching fence.ErrUnknown. See fence.Deleter.
func (w *Writer) Delete(ctx context.Context, key string, token fence.Token) error {
	if err := w.checkWrite("delete", ctx, key, token); err != nil {
		return err
	}
	return w.fenced(ctx, "delete", key, token, w.tombstone, w.db.text(key), int64(token))
}

func (w *Writer) checkWrite(op string, ctx context.Context, key string, token fence.Token) error {
	if err := w.db.checkCall(op, ctx); err != nil {
		return err
	}
	if err := checkText(op, "key", key); err != nil {
		return err
	}
	if err := leasekit.CheckToken(op, token); err != nil {
		return err
	}
	return w.keys.check(ctx, w.db.c, op, key)
}

// fenced runs a fenced upsert. When it changes no row, the key holds a larger
// token; that token is read back for the StaleError (it can only have grown since).
func (w *Writer) fenced(ctx context.Context, op, key string, token fence.Token, q string, args ...any) error {
	n, err := w.db.change(ctx, q, args...)
	if err != nil {
		return w.wrap(op, w.db.unknown(err))
	}
	if n > 0 {
		return nil
	}
	var cur int64
	if err := w.db.queryRow(ctx, w.current, []any{w.db.text(key)}, &cur); err != nil {
		if errors.Is(err, errNoRows) {
			// Refused by a row that is not the key's own: the key column
			// merges keys (see keyColumn).
			if cerr := w.keys.recheck(ctx, w.db.c, op, key); cerr != nil {
				return cerr
			}
		}
		return w.wrap(op, fmt.Errorf("reading the fence of a rejected %s: %w", op, err))
	}
	if fence.Token(cur) <= token {
		// Fences only grow, so this means someone lowered the row by hand.
		return fmt.Errorf("sqlfence: %s %q: no row changed, yet the stored fence %d is not above token %d: the table was modified outside sqlfence", op, key, cur, token)
	}
	return &fence.StaleError{Key: key, Offered: token, Current: fence.Token(cur)}
}

// Read returns the value stored under key and the token that wrote it.
// A key never written or deleted returns fence.ErrNotFound.
func (w *Writer) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	if err := w.db.checkCall("read", ctx); err != nil {
		return nil, 0, err
	}
	if err := checkText("read", "key", key); err != nil {
		return nil, 0, err
	}
	if err := w.keys.check(ctx, w.db.c, "read", key); err != nil {
		return nil, 0, err
	}
	var (
		v       []byte
		tok     int64
		deleted int64
	)
	err := w.db.queryRow(ctx, w.read, []any{w.db.text(key)}, &v, &tok, &deleted)
	if errors.Is(err, errNoRows) {
		return nil, 0, fence.ErrNotFound
	}
	if err != nil {
		return nil, 0, w.wrap("read", err)
	}
	if deleted == 1 {
		return nil, 0, fence.ErrNotFound
	}
	if v == nil {
		v = []byte{}
	}
	return v, fence.Token(tok), nil
}

func (w *Writer) wrap(op string, err error) error {
	if w.db.d.missingTable(err) {
		w.keys.forget() // it may be created again with another key column
		return &TableError{Table: w.table, DDL: w.ddl, Err: err}
	}
	return fmt.Errorf("sqlfence: %s: %w", op, invalidTooLong(w.keys, err))
}
