package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
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
