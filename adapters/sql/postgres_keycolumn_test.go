package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
)

// pgUserTable creates a table of the user's on the test PostgreSQL server
// with key column col of keyType (the rest of the columns after it), dropped
// at the end of the test; it skips when the server cannot make that type
// (an extension or ICU missing).
func pgUserTable(t *testing.T, raw *sql.DB, col, keyType, rest string) string {
	t.Helper()
	ctx := context.Background()
	for _, q := range []string{
		`CREATE COLLATION IF NOT EXISTS fencekit_nondeterministic (provider = icu, locale = 'und-u-ks-level2', deterministic = false)`,
		`DO $$ BEGIN CREATE DOMAIN fencekit_code AS CHARACTER(40); EXCEPTION WHEN duplicate_object THEN NULL; END $$`,
	} {
		if _, err := raw.ExecContext(ctx, q); err != nil {
			t.Logf("%s: %v", q, err)
		}
	}
	if strings.Contains(keyType, "citext") {
		if _, err := raw.ExecContext(ctx, `CREATE EXTENSION IF NOT EXISTS citext`); err != nil {
			t.Skipf("citext: %v", err)
		}
	}
	return newUserTable(t, raw, func(name string) string {
		return fmt.Sprintf(`CREATE TABLE %s (%q %s PRIMARY KEY%s)`, name, col, keyType, rest)
	})
}

// pgMergingKeyTypes are PostgreSQL key columns under which two different
// keys share one row: CHARACTER pads and ignores trailing spaces (also under
// a domain), NAME cuts at 63 bytes, CITEXT and a nondeterministic collation
// fold case, UUID reads "A…" and "a…" as one value.
var pgMergingKeyTypes = []string{
	"CHARACTER(40)",
	"fencekit_code",
	"NAME",
	"TEXT COLLATE fencekit_nondeterministic",
	"UUID",
	"citext",
}

// pgExactKeyTypes compare keys byte for byte.
var pgExactKeyTypes = []string{
	"TEXT",
	"VARCHAR(255)",
	`TEXT COLLATE "C"`,
	`TEXT COLLATE "und-x-icu"`,
}

// TestPostgresWriterRefusesMergingKeyColumn: a Writer on a PostgreSQL table
// whose key column makes two keys one row refuses every write, delete and
// read with an error matching fence.ErrInvalid that names the column and
// what to use, and writes nothing; on a column that compares bytes, "acct"
// and "acct " are two keys, and so are "Acct" and "acct".
func TestPostgresWriterRefusesMergingKeyColumn(t *testing.T) {
	raw := pgStd(t)
	const rest = ", value BYTEA, fence BIGINT NOT NULL"
	for style, fdb := range pgHandles(t) {
		for _, typ := range pgMergingKeyTypes {
			t.Run(style+"/"+typ, func(t *testing.T) {
				table := pgUserTable(t, raw, "acct_key", typ, rest)
				w := newWriterOn(t, fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "acct_key"})
				key := "acct"
				if typ == "UUID" {
					key = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
				}
				checkKeyColumnRefusesWrite(t, w, key, typ, "TEXT")
				checkKeyColumnRefusesRest(t, raw, w, table, key)
			})
		}
		for _, typ := range pgExactKeyTypes {
			t.Run(style+"/"+typ, func(t *testing.T) {
				table := pgUserTable(t, raw, "acct_key", typ, rest)
				w := newWriterOn(t, fdb, &sqlfence.WriterOptions{Table: table, KeyColumn: "acct_key"})
				checkKeyColumnKeepsKeysApart(t, w)
			})
		}
	}
}

// TestPostgresGuardsRefuseMergingNameColumn: Guard on a PostgreSQL guard
// table whose name column pads (CHARACTER) refuses with an error matching
// fence.ErrInvalid and advances nothing, so that the guards of "acct" and
// "acct " never share one fence.
func TestPostgresGuardsRefuseMergingNameColumn(t *testing.T) {
	ctx := context.Background()
	raw := pgStd(t)
	table := pgUserTable(t, raw, "name", "CHARACTER(40)", ", fence BIGINT NOT NULL")
	g, err := sqlfence.NewGuards(sqlfence.Postgres(raw), &sqlfence.GuardOptions{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	err = sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, "acct", 100) })
	if !errors.Is(err, fence.ErrInvalid) || !strings.Contains(err.Error(), "name") || !strings.Contains(err.Error(), "TEXT") {
		t.Errorf("Guard on a CHARACTER name column: %v, want ErrInvalid", err)
	}
	var n int
	if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+table).Scan(&n); err != nil || n != 0 {
		t.Errorf("guard rows after refusals: %d, %v; want none", n, err)
	}
}
