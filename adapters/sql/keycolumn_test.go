package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/go-sql-driver/mysql"
)

var userTableSeq atomic.Int64

// userTable creates a table of the test's own on MySQL whose key column
// (named col) has type keyType, and drops it after the test. It returns the
// table's name.
func userTable(t *testing.T, raw *sql.DB, col, keyType, rest string) string {
	t.Helper()
	name := fmt.Sprintf("user_keys_%d_%d", time.Now().UnixNano()%1e9, userTableSeq.Add(1))
	ddl := fmt.Sprintf("CREATE TABLE %s (`%s` %s PRIMARY KEY%s)", name, col, keyType, rest)
	if _, err := raw.ExecContext(context.Background(), ddl); err != nil {
		t.Skipf("%s: %v", ddl, err)
	}
	t.Cleanup(func() { _, _ = raw.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+name) })
	return name
}

// paddingKeyTypes are key columns under which two different keys can share
// one row: trailing spaces ignored (PAD SPACE), stripped (CHAR), case
// folded, or padded with NUL bytes (BINARY).
var paddingKeyTypes = []string{
	"VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
	"VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci",
	"CHAR(100) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin",
	"VARCHAR(255) CHARACTER SET utf8mb3 COLLATE utf8mb3_nopad_bin",
	"BINARY(100)",
}

// exactKeyTypes compare keys byte for byte.
var exactKeyTypes = []string{
	"VARBINARY(1024)",
	"VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin",
}

// TestMySQLWriterRefusesPaddingKeyColumn: a Writer on a table whose key
// column does not compare bytes refuses every write with an error matching
// fence.ErrInvalid that names the column and says what to use, and writes
// nothing; on a column that compares bytes, "acct" and "acct " are two keys.
func TestMySQLWriterRefusesPaddingKeyColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	const rest = ", `value` LONGBLOB, fence BIGINT NOT NULL"
	for _, typ := range paddingKeyTypes {
		t.Run(typ, func(t *testing.T) {
			table := userTable(t, raw, "acct_key", typ, rest)
			w, err := sqlfence.NewWriter(fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "acct_key"})
			if err != nil {
				t.Fatal(err)
			}
			err = w.Write(ctx, "acct", []byte("a"), 100)
			if !errors.Is(err, fence.ErrInvalid) || !strings.Contains(err.Error(), "acct_key") || !strings.Contains(err.Error(), "VARBINARY") {
				t.Fatalf("Write on a %s key column: %v, want ErrInvalid naming acct_key and VARBINARY", typ, err)
			}
			if testing.Verbose() {
				t.Log(err)
			}
			if err := w.Write(ctx, "acct ", []byte("b"), 200); !errors.Is(err, fence.ErrInvalid) {
				t.Errorf("second Write: %v, want ErrInvalid", err)
			}
			if err := w.Delete(ctx, "acct", 300); !errors.Is(err, fence.ErrInvalid) {
				t.Errorf("Delete: %v, want ErrInvalid", err)
			}
			if _, _, err := w.Read(ctx, "acct"); !errors.Is(err, fence.ErrInvalid) {
				t.Errorf("Read: %v, want ErrInvalid", err)
			}
			var n int
			if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&n); err != nil || n != 0 {
				t.Errorf("rows after refused writes: %d, %v; want none", n, err)
			}
		})
	}
	for _, typ := range exactKeyTypes {
		t.Run(typ, func(t *testing.T) {
			table := userTable(t, raw, "acct_key", typ, rest)
			w, err := sqlfence.NewWriter(fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "acct_key"})
			if err != nil {
				t.Fatal(err)
			}
			if err := w.Write(ctx, "acct", []byte("a"), 100); err != nil {
				t.Fatal(err)
			}
			if err := w.Write(ctx, "acct ", []byte("b"), 5); err != nil {
				t.Errorf("Write to \"acct \" at 5: %v, want its own row", err)
			}
			if err := w.Write(ctx, "Acct", []byte("c"), 5); err != nil {
				t.Errorf("Write to \"Acct\" at 5: %v, want its own row", err)
			}
			if v, tok, err := w.Read(ctx, "acct"); err != nil || tok != 100 || string(v) != "a" {
				t.Errorf("Read acct: %q %d %v, want a at 100", v, tok, err)
			}
			var se *fence.StaleError
			if err := w.Write(ctx, "acct", []byte("x"), 99); !errors.As(err, &se) || se.Current != 100 {
				t.Errorf("stale Write: %v, want a StaleError at 100", err)
			}
		})
	}
}

// TestMySQLGuardsRefusePaddingNameColumn: Guard, and a grant that advances
// the guards, refuse a guard table whose name column does not compare bytes,
// with an error matching fence.ErrInvalid, and change nothing.
func TestMySQLGuardsRefusePaddingNameColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	table := userTable(t, raw, "name", "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin", ", fence BIGINT NOT NULL")
	g, err := sqlfence.NewGuards(fdb, &sqlfence.GuardOptions{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	err = sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, "acct", 100) })
	if !errors.Is(err, fence.ErrInvalid) || !strings.Contains(err.Error(), "name") || !strings.Contains(err.Error(), "VARBINARY") {
		t.Errorf("Guard on a utf8mb4_bin name column: %v, want ErrInvalid", err)
	}
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{AdvanceGuards: g, Table: "fence_leases"})
	if l, err := a.TryAcquire(ctx, "acct-"+table, time.Minute); !errors.Is(err, fence.ErrInvalid) {
		if err == nil {
			_ = l.Release(ctx)
		}
		t.Errorf("TryAcquire advancing a utf8mb4_bin guard table: %v, want ErrInvalid", err)
	}
	var n int
	if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&n); err != nil || n != 0 {
		t.Errorf("guard rows after refusals: %d, %v; want none", n, err)
	}
}

// TestMySQLKeyLongerThanUserKeyColumn: on a user's table whose VARBINARY key
// column is shorter than MaxKeyBytes, two keys that differ after the
// column's length are two keys, or a key too long for the column is refused
// with an error matching fence.ErrInvalid; outside strict mode the server
// would cut both to one row. (In strict mode the server's "Data too long"
// error is as good a refusal.)
func TestMySQLKeyLongerThanUserKeyColumn(t *testing.T) {
	ctx := context.Background()
	for _, params := range []string{"sql_mode=" + url.QueryEscape("''"), ""} {
		t.Run("params="+params, func(t *testing.T) {
			raw, fdb := openMySQL(t, params)
			for _, typ := range []string{"VARBINARY(16)", "VARCHAR(16) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin"} {
				t.Run(typ, func(t *testing.T) {
					table := userTable(t, raw, "k", typ, ", v LONGBLOB, f BIGINT NOT NULL")
					w, err := sqlfence.NewWriter(fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "k", ValueColumn: "v", FenceColumn: "f"})
					if err != nil {
						t.Fatal(err)
					}
					a, b := "0123456789abcdef-account-a", "0123456789abcdef-account-b"
					errA := w.Write(ctx, a, []byte("a"), 100)
					if errA != nil && !refusedTooLong(errA) {
						t.Errorf("Write of a key longer than the column: %v, want nil or ErrInvalid", errA)
					}
					errB := w.Write(ctx, b, []byte("b"), 50)
					if errB != nil && !refusedTooLong(errB) {
						t.Errorf("Write of another key with the same first 16 bytes at a lower token: %v, want nil or ErrInvalid (another key)", errB)
					}
					if errA == nil {
						if v, tok, err := w.Read(ctx, a); err != nil || tok != 100 || string(v) != "a" {
							t.Errorf("Read of the first key: %q %d %v, want a at 100", v, tok, err)
						}
					}
					var n int
					if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table+" WHERE f = 50").Scan(&n); err != nil || (errB != nil && n != 0) {
						t.Errorf("rows at the refused write's token: %d, %v", n, err)
					}
				})
			}
		})
	}
}

// refusedTooLong reports an error that refuses a key too long for its
// column: fence.ErrInvalid, or the server's own "Data too long" (1406).
func refusedTooLong(err error) bool {
	var me *mysql.MySQLError
	return errors.Is(err, fence.ErrInvalid) || errors.As(err, &me) && me.Number == 1406
}

// TestMySQLGuardNameLongerThanUserColumn: the same for a guard table of the
// user's own whose VARBINARY name column is shorter than MaxKeyBytes: a
// guard on one name must not be stale because of another name.
func TestMySQLGuardNameLongerThanUserColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "sql_mode="+url.QueryEscape("''"))
	table := userTable(t, raw, "name", "VARBINARY(16)", ", fence BIGINT NOT NULL")
	g, err := sqlfence.NewGuards(fdb, &sqlfence.GuardOptions{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	a, b := "0123456789abcdef-lock-a", "0123456789abcdef-lock-b"
	errA := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, a, 100) })
	if errA != nil && !errors.Is(errA, fence.ErrInvalid) {
		t.Errorf("Guard of a name longer than the column: %v, want nil or ErrInvalid", errA)
	}
	errB := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, b, 50) })
	if errB != nil && !errors.Is(errB, fence.ErrInvalid) {
		t.Errorf("Guard of another name with the same first 16 bytes at a lower token: %v, want nil or ErrInvalid (another lock)", errB)
	}
}

// idempotencyColumns are the columns of the idempotency table after its key.
const idempotencyColumns = `, fingerprint BLOB NOT NULL, state BLOB NOT NULL, fence BIGINT NOT NULL, owner BLOB NOT NULL,
  lease_until BIGINT NOT NULL, started_at BIGINT NOT NULL, expires_at BIGINT, result LONGBLOB, result_dropped BIGINT NOT NULL DEFAULT 0`

// TestMySQLIdempotencyStoreRefusesPaddingKeyColumn: an idempotency table
// created ahead by the user (a migration) whose key column does not compare
// bytes is refused with an error matching fence.ErrInvalid, or its keys stay
// apart: "pay" and "pay " are two requests, whose effects both run.
func TestMySQLIdempotencyStoreRefusesPaddingKeyColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	for _, typ := range paddingKeyTypes[:2] {
		t.Run(typ, func(t *testing.T) {
			table := userTable(t, raw, "key", typ, idempotencyColumns)
			s, err := sqlfence.NewIdempotencyStore(fdb, &sqlfence.IdempotencyOptions{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			for _, key := range []string{"pay", "pay ", "PAY"} {
				ran := false
				r, err := idempotency.Do(ctx, s, key, "fp", func(context.Context, string) ([]byte, error) { ran = true; return []byte(key), nil }, nil)
				if errors.Is(err, fence.ErrInvalid) {
					continue
				}
				if err != nil || !ran || string(r.Value) != key {
					t.Errorf("Do(%q): ran %v, result %q, %v; want its own effect run (or ErrInvalid)", key, ran, r.Value, err)
				}
			}
		})
	}
}

// TestMySQLAcquirerRefusesPaddingNameColumn: a lease table created ahead by
// the user whose name column does not compare bytes is refused with an error
// matching fence.ErrInvalid, or its names stay apart: "job" and "job " and
// "JOB" are three locks.
func TestMySQLAcquirerRefusesPaddingNameColumn(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	for _, typ := range paddingKeyTypes[:2] {
		t.Run(typ, func(t *testing.T) {
			table := userTable(t, raw, "name", typ, ", token BIGINT NOT NULL, owner BLOB NOT NULL, expires_at BIGINT NOT NULL")
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Table: table})
			for _, name := range []string{"job", "job ", "JOB"} {
				l, err := a.TryAcquire(ctx, name, time.Minute)
				if errors.Is(err, fence.ErrInvalid) {
					continue
				}
				if err != nil {
					t.Errorf("TryAcquire(%q) with the others held: %v, want its own lock (or ErrInvalid)", name, err)
					continue
				}
				t.Cleanup(func() { _ = l.Release(context.Background()) })
			}
		})
	}
}

// TestMySQLKeyColumnCheckedAfterTableRecreated: a Writer whose table was
// dropped and created again (a migration that re-creates it) with a key
// column that does not compare bytes refuses it from the first write that
// shows two keys in one row, at a lower or a higher token, as it refuses such
// a table on first use, rather than trusting the check of the old table; the
// other key's row is left as it was, and every later write is refused.
func TestMySQLKeyColumnCheckedAfterTableRecreated(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "")
	const rest = ", v LONGBLOB, f BIGINT NOT NULL"
	table := userTable(t, raw, "k", "VARBINARY(255)", rest)
	w, err := sqlfence.NewWriter(fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "k", ValueColumn: "v", FenceColumn: "f"})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, "acct", []byte("a"), 1); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"DROP TABLE " + table, "CREATE TABLE " + table + " (k VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PRIMARY KEY" + rest + ")"} {
		if _, err := raw.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	errA := w.Write(ctx, "acct", []byte("a"), 100)
	if errA != nil && !errors.Is(errA, fence.ErrInvalid) {
		t.Fatalf("Write of \"acct\" at 100 on the re-created table: %v, want nil or ErrInvalid", errA)
	}
	for _, tok := range []fence.Token{50, 200} {
		if err := w.Write(ctx, "acct ", []byte("b"), tok); !errors.Is(err, fence.ErrInvalid) ||
			!strings.Contains(err.Error(), "column k") || !strings.Contains(err.Error(), "VARBINARY") {
			t.Errorf("Write of \"acct \" at %d after \"acct\" at 100 (%v) on the re-created utf8mb4_bin table: %v, want ErrInvalid naming column k",
				tok, errA, err)
		}
	}
	if err := w.Write(ctx, "acct", []byte("c"), 300); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Write of \"acct\" after the table was refused: %v, want ErrInvalid", err)
	}
	var v []byte
	var f sql.NullInt64
	var n int
	if err := raw.QueryRowContext(ctx, "SELECT COUNT(*), MAX(v), MAX(f) FROM "+table).Scan(&n, &v, &f); err != nil {
		t.Fatal(err)
	}
	if want := (errA == nil); (n == 1) != want || want && (string(v) != "a" || f.Int64 != 100) {
		t.Errorf("rows after the refusals: %d, value %q at %v; want only \"acct\"'s own write (a at 100) if it was accepted", n, v, f)
	}
}

// TestMySQLNameLongerThanUserLeaseAndIdempotencyColumns: a lease table and
// an idempotency table of the user's own whose VARBINARY(16) key column is
// shorter than MaxKeyBytes refuse a longer name or key with an error
// matching fence.ErrInvalid, outside strict mode too, and write nothing: two
// names with the same first 16 bytes would otherwise share one lock, and two
// keys one request.
func TestMySQLNameLongerThanUserLeaseAndIdempotencyColumns(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "sql_mode="+url.QueryEscape("''"))
	leases := userTable(t, raw, "name", "VARBINARY(16)", ", token BIGINT NOT NULL, owner BLOB NOT NULL, expires_at BIGINT NOT NULL")
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Table: leases})
	for _, name := range []string{"0123456789abcdef-job-a", "0123456789abcdef-job-b"} {
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if err == nil {
			t.Cleanup(func() { _ = l.Release(context.Background()) })
		}
		if !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("TryAcquire(%q) on a VARBINARY(16) name column: %v, want ErrInvalid", name, err)
		}
	}
	idem := userTable(t, raw, "key", "VARBINARY(16)", idempotencyColumns)
	s, err := sqlfence.NewIdempotencyStore(fdb, &sqlfence.IdempotencyOptions{Table: idem})
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"0123456789abcdef-pay-a", "0123456789abcdef-pay-b"} {
		_, err := idempotency.Do(ctx, s, key, "fp", func(context.Context, string) ([]byte, error) { return []byte(key), nil }, nil)
		if !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("Do(%q) on a VARBINARY(16) key column: %v, want ErrInvalid", key, err)
		}
	}
	for _, table := range []string{leases, idem} {
		var n int
		if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&n); err != nil || n != 0 {
			t.Errorf("rows in %s after the refusals: %d, %v; want none", table, n, err)
		}
	}
	if l, err := a.TryAcquire(ctx, "0123456789abcdef", time.Minute); err != nil {
		t.Errorf("TryAcquire of a name that fits the column: %v", err)
	} else {
		_ = l.Release(ctx)
	}
}

// TestMySQLDataTooLongIsInvalid: under a strict sql_mode, a value the
// server refuses as too long for a column of the user's table ("Data too
// long", 1406; here the lease table's owner column) is reported as an error
// matching fence.ErrInvalid, with the server's error in the chain, and
// grants nothing.
func TestMySQLDataTooLongIsInvalid(t *testing.T) {
	ctx := context.Background()
	raw, fdb := openMySQL(t, "sql_mode="+url.QueryEscape("'STRICT_ALL_TABLES'"))
	leases := userTable(t, raw, "name", "VARBINARY(1024)", ", token BIGINT NOT NULL, owner VARBINARY(8) NOT NULL, expires_at BIGINT NOT NULL")
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Table: leases, Owner: "an-owner-longer-than-8-bytes"})
	l, err := a.TryAcquire(ctx, "job", time.Minute)
	if err == nil {
		_ = l.Release(ctx)
	}
	var me *mysql.MySQLError
	if !errors.Is(err, fence.ErrInvalid) || !errors.As(err, &me) || me.Number != 1406 {
		t.Errorf("TryAcquire with an owner longer than its column: %v, want ErrInvalid carrying MySQL error 1406", err)
	}
}
