package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/jackc/pgx/v5/stdlib"
)

// missingDB is one database for the missing-table tests: the sqlfence handle
// and a plain handle to drop tables with.
type missingDB struct {
	dialect string
	fdb     *sqlfence.DB
	raw     *sql.DB
	schema  string // the database's default schema, for qualified names
}

func missingDBs(t *testing.T) []missingDB {
	var dbs []missingDB
	p := pgPool(t, pgOpts{})
	pgRaw := stdlib.OpenDBFromPool(p)
	t.Cleanup(func() { pgRaw.Close() })
	std := pgStd(t)
	dbs = append(dbs,
		missingDB{"pgx", sqlfence.Pgx(p), pgRaw, "public"},
		missingDB{"postgres", sqlfence.Postgres(std), std, "public"})
	sdb, sf := openSQLite(t)
	dbs = append(dbs, missingDB{"sqlite", sf, sdb, "main"})
	mdb, mf := openMySQL(t, "")
	dbs = append(dbs, missingDB{"mysql", mf, mdb, "test"})
	return dbs
}

// missingTableName is a fresh table name with the given stem, unique per test.
func missingTableName(stem string) string {
	return strings.ReplaceAll(fencetest.Name("r3"), "-", "_") + stem
}

func (d missingDB) drop(t *testing.T, tables ...string) {
	for _, tb := range tables {
		q := `"` + strings.ReplaceAll(tb, ".", `"."`) + `"`
		if d.dialect == "mysql" {
			q = "`" + strings.ReplaceAll(tb, ".", "`.`") + "`"
		}
		if _, err := d.raw.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+q); err != nil {
			t.Errorf("drop %s: %v", tb, err)
		}
	}
}

// missingGrant runs one grant with an acquirer (lease table lease,
// AdvanceGuards on table guard) and checks that it fails with a
// *TableError naming want, carrying want's DDL. It also checks Acquire,
// which must end at once with the same error rather than wait.
func missingGrant(t *testing.T, d missingDB, lease, guard, want string) {
	t.Helper()
	ctx := context.Background()
	g, err := sqlfence.NewGuards(d.fdb, &sqlfence.GuardOptions{Table: guard})
	if err != nil {
		t.Fatal(err)
	}
	a := newAcquirerOn(t, d.fdb, &sqlfence.AcquirerOptions{Table: lease, AdvanceGuards: g})
	wantDDL := a.DDL()
	if want == guard {
		wantDDL = g.DDL()
	}
	name := fencetest.Name("n")
	l, err := a.TryAcquire(ctx, name, time.Minute)
	if l != nil {
		_ = l.Release(ctx)
		t.Fatalf("granted with %s missing", want)
	}
	var te *sqlfence.TableError
	if !errors.As(err, &te) || te.Table != want || te.DDL != wantDDL {
		got := "no *TableError"
		if te != nil {
			got = "Table " + te.Table
		}
		t.Errorf("TryAcquire (lease table %s, guard table %s) with %s missing: %v (%s), want a *TableError naming %s with its DDL", lease, guard, want, err, got, want)
	}
	actx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	start := time.Now()
	l, err = a.Acquire(actx, name, time.Minute)
	if l != nil {
		_ = l.Release(ctx)
		t.Fatalf("Acquire granted with %s missing", want)
	}
	te = nil
	if !errors.As(err, &te) || te.Table != want {
		t.Errorf("Acquire with %s missing: %v, want a *TableError naming %s", want, err, want)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("Acquire with %s missing waited %v instead of failing at once", want, took)
	}
}

// missingGranted checks that, with both tables there, a fresh acquirer (as
// another process would make) is granted a name at once: the failed grants
// held nothing.
func missingGranted(t *testing.T, d missingDB, lease, guard string) {
	t.Helper()
	ctx := context.Background()
	g, err := sqlfence.NewGuards(d.fdb, &sqlfence.GuardOptions{Table: guard})
	if err != nil {
		t.Fatal(err)
	}
	a := newAcquirerOn(t, d.fdb, &sqlfence.AcquirerOptions{Table: lease, AdvanceGuards: g})
	l, err := a.TryAcquire(ctx, fencetest.Name("n"), time.Minute)
	if err != nil {
		t.Fatalf("with both tables created: %v", err)
	}
	_ = l.Release(ctx)
}

func missingCreate(t *testing.T, d missingDB, lease, guard string, which ...string) {
	t.Helper()
	ctx := context.Background()
	g, err := sqlfence.NewGuards(d.fdb, &sqlfence.GuardOptions{Table: guard})
	if err != nil {
		t.Fatal(err)
	}
	a := newAcquirerOn(t, d.fdb, &sqlfence.AcquirerOptions{Table: lease, AdvanceGuards: g})
	for _, w := range which {
		var err error
		if w == lease {
			err = a.CreateTable(ctx)
		} else {
			err = g.CreateTable(ctx)
		}
		if err != nil {
			t.Fatalf("create %s: %v", w, err)
		}
	}
}

// TestGuardsMissingTableNamed: with AdvanceGuards, a grant on a missing
// table fails with a *TableError naming the table that is missing (lease or
// guard) with that table's DDL, on PostgreSQL (pgx and database/sql), SQLite
// and MariaDB, for names that contain one another (in both directions),
// schema-qualified names and mixed case; Acquire fails the same way at
// once; and once the tables exist another acquirer is granted at once.
func TestGuardsMissingTableNamed(t *testing.T) {
	for _, d := range missingDBs(t) {
		t.Run(d.dialect, func(t *testing.T) {
			type pair struct{ what, lease, guard string }
			base := missingTableName("")
			pairs := []pair{
				{"guard name contains the lease name", base + "locks", base + "locks_guard"},
				{"lease name contains the guard name", base + "locks_guard", base + "locks"},
				{"mixed case", base + "Locks", base + "Locks_Guard"},
				{"qualified", d.schema + "." + base + "ql", d.schema + "." + base + "ql_guard"},
				{"qualified guard only", base + "qg", d.schema + "." + base + "qg_guard"},
			}
			for _, p := range pairs {
				t.Run(p.what, func(t *testing.T) {
					t.Cleanup(func() { d.drop(t, p.lease, p.guard) })
					// The guard table missing, the lease table there.
					missingCreate(t, d, p.lease, p.guard, p.lease)
					missingGrant(t, d, p.lease, p.guard, p.guard)
					// The lease table missing, the guard table there.
					d.drop(t, p.lease)
					missingCreate(t, d, p.lease, p.guard, p.guard)
					missingGrant(t, d, p.lease, p.guard, p.lease)
					// Both missing: either may be named, with its own DDL;
					// creating it, the grant names the other.
					d.drop(t, p.lease, p.guard)
					ctx := context.Background()
					g, _ := sqlfence.NewGuards(d.fdb, &sqlfence.GuardOptions{Table: p.guard})
					a := newAcquirerOn(t, d.fdb, &sqlfence.AcquirerOptions{Table: p.lease, AdvanceGuards: g})
					_, err := a.TryAcquire(ctx, fencetest.Name("n"), time.Minute)
					var te *sqlfence.TableError
					if !errors.As(err, &te) {
						t.Fatalf("both tables missing: %v, want a *TableError", err)
					}
					switch {
					case te.Table == p.lease && te.DDL == a.DDL():
						missingCreate(t, d, p.lease, p.guard, p.lease)
						missingGrant(t, d, p.lease, p.guard, p.guard)
						missingCreate(t, d, p.lease, p.guard, p.guard)
					case te.Table == p.guard && te.DDL == g.DDL():
						missingCreate(t, d, p.lease, p.guard, p.guard)
						missingGrant(t, d, p.lease, p.guard, p.lease)
						missingCreate(t, d, p.lease, p.guard, p.lease)
					default:
						t.Fatalf("both tables missing: a *TableError naming %s with DDL\n%s\nwant the lease table %s or the guard table %s, each with its own DDL", te.Table, te.DDL, p.lease, p.guard)
					}
					missingGranted(t, d, p.lease, p.guard)
				})
			}
		})
	}
}

// TestGuardsMissingGuardTableLikeLeaseName: the guard table missing, the
// lease table there, where the database's error names a table that
// namesTable cannot tell from the lease table: the grant must still name the
// guard table (the one missing, whose DDL creates what the grant needs),
// not the lease table (which exists: its DDL changes nothing, and the next
// grant fails the same way).
//   - PostgreSQL and MariaDB (on Linux) quote identifiers case-sensitively:
//     lease table x_locks and guard table X_LOCKS are two tables.
//   - PostgreSQL: lease table s1.locks and guard table s2.locks, two schemas.
//   - MariaDB: the error names the database ("Table 'test.g' doesn't exist"):
//     a lease table named like its database ("test").
func TestGuardsMissingGuardTableLikeLeaseName(t *testing.T) {
	ctx := context.Background()
	for _, d := range missingDBs(t) {
		t.Run(d.dialect, func(t *testing.T) {
			type pair struct{ what, lease, guard string }
			base := missingTableName("")
			var pairs []pair
			switch d.dialect {
			case "pgx", "postgres":
				s1, s2 := base+"s1", base+"s2"
				for _, s := range []string{s1, s2} {
					if _, err := d.raw.ExecContext(ctx, `CREATE SCHEMA "`+s+`"`); err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { _, _ = d.raw.ExecContext(ctx, `DROP SCHEMA "`+s+`" CASCADE`) })
				}
				pairs = append(pairs,
					pair{"names differing in case", base + "locks", strings.ToUpper(base + "locks")},
					pair{"one name in two schemas", s1 + ".locks", s2 + ".locks"})
			case "mysql":
				var n int
				if err := d.raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = 'test'").Scan(&n); err != nil {
					t.Fatal(err)
				}
				var db string
				if err := d.raw.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&db); err != nil {
					t.Fatal(err)
				}
				var lower int
				if err := d.raw.QueryRowContext(ctx, "SELECT @@lower_case_table_names").Scan(&lower); err != nil {
					t.Fatal(err)
				}
				if lower == 0 { // else the two names are one table
					pairs = append(pairs, pair{"names differing in case", base + "locks", strings.ToUpper(base + "locks")})
				}
				if n == 0 && db == "test" {
					pairs = append(pairs, pair{"lease table named like the database", "test", base + "guard"})
				}
			default:
				t.Skip("SQLite table names are not case-sensitive, and its error names no schema")
			}
			for _, p := range pairs {
				t.Run(p.what, func(t *testing.T) {
					t.Cleanup(func() { d.drop(t, p.lease, p.guard) })
					missingCreate(t, d, p.lease, p.guard, p.lease)
					missingGrant(t, d, p.lease, p.guard, p.guard)
					missingCreate(t, d, p.lease, p.guard, p.guard)
					missingGranted(t, d, p.lease, p.guard)
				})
			}
		})
	}
}
