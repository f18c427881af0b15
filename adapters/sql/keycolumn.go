package sqlfence

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"unicode/utf8"

	"github.com/fencekit/fencekit/fence"
)

// keyColumn checks that a MySQL table's key or name column compares keys
// byte for byte and is long enough for the key: a PAD SPACE collation (such
// as utf8mb4_bin) makes "acct" and "acct " one row, CHAR drops trailing
// spaces, BINARY pads with NUL bytes, other collations fold case, and
// outside strict mode the server cuts a key longer than the column, so two
// keys with the same first bytes share one row.
//
// The column's type is read on first use and remembered; it is read again
// after a statement finds the table missing or a key too long for its
// column, and when a write or guard finds no row under its own key right
// after the key's row refused it (two keys in one row: the table was
// re-created since it was read). A table re-created in place with another
// key column is therefore refused from the first statement that shows it.
//
// On PostgreSQL the same check refuses CHARACTER(n) (it pads and ignores
// trailing spaces), NAME (it cuts at 63 bytes), CITEXT, a nondeterministic
// collation, and any type but TEXT, VARCHAR and BYTEA (a UUID column, for
// one, takes "A…" and "a…" as one key).
type keyColumn struct {
	arg, table, column string // for the error: the option, and what it names
	keyArg             string // the argument the column stores: "key" or "name"
	q                  string // reads the column's type from the catalog
	args               []any  // q's arguments (PostgreSQL)
	pg                 bool
	fit                atomic.Pointer[columnFit]
}

// columnFit is what a key column that compares bytes holds.
type columnFit struct {
	typ      string // as the column was declared, for the error
	maxBytes int64  // the longest key in bytes (0: no limit known)
	maxChars int64  // the longest key in characters (0: no limit known)
}

// newPgKeyColumn returns the PostgreSQL check of column in table (quoted:
// the table as the statements name it, resolved on the search path).
func newPgKeyColumn(arg, table, quoted, column, keyArg string) *keyColumn {
	return &keyColumn{arg: arg, table: table, column: column, keyArg: keyArg, pg: true, args: []any{quoted, column}, q: "SELECT b.typname, COALESCE(co.collisdeterministic, true), format_type(a.atttypid, a.atttypmod), COALESCE(co.collname, '') " +
		"FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid " +
		"JOIN pg_type b ON b.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END " +
		"LEFT JOIN pg_collation co ON co.oid = a.attcollation " +
		"WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped"}
}

// newKeyColumn returns the check of column in table (as quoteIdent
// accepted them, so both are plain identifiers; table may be schema.table).
func newKeyColumn(arg, table, column, keyArg string) *keyColumn {
	schema, name := "DATABASE()", table
	if i := strings.IndexByte(table, '.'); i >= 0 {
		schema, name = "'"+table[:i]+"'", table[i+1:]
	}
	return &keyColumn{arg: arg, table: table, column: column, keyArg: keyArg, q: fmt.Sprintf(
		"SELECT DATA_TYPE, COLLATION_NAME, COLUMN_TYPE, CHARACTER_MAXIMUM_LENGTH, CHARACTER_OCTET_LENGTH FROM information_schema.COLUMNS "+
			"WHERE TABLE_SCHEMA = %s AND TABLE_NAME = '%s' AND COLUMN_NAME = '%s' ORDER BY BINARY TABLE_NAME = '%s' DESC LIMIT 1",
		schema, name, column, name)}
}

// forget drops the remembered column type, so that the next check reads it again.
func (k *keyColumn) forget() {
	if k != nil {
		k.fit.Store(nil)
	}
}

// check returns an error matching fence.ErrInvalid when the column does not
// compare bytes, or cannot hold key. A table not found (not created yet)
// passes, unremembered: the statement then reports the missing table.
func (k *keyColumn) check(ctx context.Context, c conn, op, key string) error {
	if k == nil {
		return nil
	}
	f := k.fit.Load()
	if f == nil {
		var err error
		if f, err = k.read(ctx, c, op); f == nil {
			return err
		}
	}
	var n, max int64
	var unit string
	switch {
	case f.maxBytes > 0 && int64(len(key)) > f.maxBytes:
		n, max, unit = int64(len(key)), f.maxBytes, "bytes"
	case f.maxChars > 0 && int64(utf8.RuneCountInString(key)) > f.maxChars:
		n, max, unit = int64(utf8.RuneCountInString(key)), f.maxChars, "characters"
	default:
		return nil
	}
	return &fence.InvalidError{Op: op, Arg: k.keyArg, Reason: fmt.Sprintf(
		"%d %s long, and column %s of table %s (%s) holds at most %d: the server would cut it, or refuse it",
		n, unit, k.column, k.table, f.typ, max)}
}

// read reads the column's type and remembers it when it compares bytes; nil
// when the table was not found or the column is refused.
func (k *keyColumn) read(ctx context.Context, c conn, op string) (*columnFit, error) {
	if k.pg {
		return k.readPg(ctx, c, op)
	}
	var typ, colType string
	var nullColl sql.NullString // NULL for a binary type
	var chars, octets sql.NullInt64
	err := c.queryRow(ctx, k.q, nil, &typ, &nullColl, &colType, &chars, &octets)
	if errors.Is(err, errNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("sqlfence: %s: reading the type of column %s of table %s: %w", op, k.column, k.table, err)
	}
	typ, coll := strings.ToLower(typ), strings.ToLower(nullColl.String)
	var why string
	f := &columnFit{typ: strings.TrimSpace(colType + " " + nullColl.String)}
	switch {
	case typ == "varbinary":
		f.maxBytes = octets.Int64
	case typ == "varchar" && (coll == "utf8mb4_nopad_bin" || coll == "utf8mb4_0900_bin"):
		f.maxBytes, f.maxChars = octets.Int64, chars.Int64
	case typ == "char":
		why = "CHAR drops trailing spaces"
	case typ == "binary":
		why = "BINARY pads keys with NUL bytes"
	case typ == "varchar" && strings.HasSuffix(coll, "_bin") && !strings.Contains(coll, "nopad"):
		why = "a PAD SPACE collation ignores trailing spaces"
	case typ == "varchar" && strings.HasSuffix(coll, "_bin"):
		why = "its character set cannot hold every key"
	case typ == "varchar":
		why = "its collation folds case or accents"
	default:
		why = "it does not compare keys byte for byte"
	}
	if why != "" {
		return nil, &fence.InvalidError{Op: op, Arg: k.arg, Reason: fmt.Sprintf(
			"column %s of table %s is %s: %s, so two keys would share one row; use VARBINARY(%d), or VARCHAR with a binary NO PAD collation (utf8mb4_nopad_bin on MariaDB, utf8mb4_0900_bin on MySQL 8)",
			k.column, k.table, strings.TrimSpace(strings.ToUpper(typ)+" "+coll), why, MaxKeyBytes)}
	}
	k.fit.Store(f)
	return f, nil
}

// readPg is read on PostgreSQL.
func (k *keyColumn) readPg(ctx context.Context, c conn, op string) (*columnFit, error) {
	var typ, declared, coll string
	var deterministic bool
	err := c.queryRow(ctx, k.q, k.args, &typ, &deterministic, &declared, &coll)
	if errors.Is(err, errNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("sqlfence: %s: reading the type of column %s of table %s: %w", op, k.column, k.table, err)
	}
	var why string
	switch {
	case typ == "bpchar":
		why = "CHARACTER pads keys with spaces and ignores trailing spaces"
	case typ == "name":
		why = "NAME cuts keys at 63 bytes"
	case typ == "citext":
		why = "CITEXT folds case"
	case typ != "text" && typ != "varchar" && typ != "bytea":
		why = "it does not hold every key as its bytes"
	case !deterministic:
		declared += " COLLATE " + coll
		why = "its collation is nondeterministic: it finds keys equal whose bytes differ"
	}
	if why != "" {
		return nil, &fence.InvalidError{Op: op, Arg: k.arg, Reason: fmt.Sprintf(
			"column %s of table %s is %s: %s, so two keys would share one row; use TEXT or VARCHAR with a deterministic collation",
			k.column, k.table, declared, why)}
	}
	f := &columnFit{typ: declared}
	k.fit.Store(f)
	return f, nil
}

// recheck is check after the column's type may have changed (see keyColumn).
func (k *keyColumn) recheck(ctx context.Context, c conn, op, key string) error {
	k.forget()
	return k.check(ctx, c, op, key)
}

// sameKey is true in an upsert's ON DUPLICATE KEY UPDATE when the row found
// holds the very bytes of the key inserted (col is the quoted key column):
// false when the column merged two keys.
func sameKey(col string) string {
	return fmt.Sprintf("CAST(%[1]s AS BINARY) = CAST(VALUES(%[1]s) AS BINARY)", col)
}

// mysqlTooLong reports MySQL's "Data too long for column" (1406): under a
// strict sql_mode a key, name or value longer than its column.
func mysqlTooLong(err error) bool { return mysqlCode(err) == 1406 }

// invalidTooLong turns MySQL's "Data too long" into an error that also
// matches fence.ErrInvalid (nothing was written), and forgets k's remembered
// column type, which it contradicts; other errors are returned as they are.
func invalidTooLong(k *keyColumn, err error) error {
	if !mysqlTooLong(err) {
		return err
	}
	k.forget()
	return fmt.Errorf("%w: %w", fence.ErrInvalid, err)
}
