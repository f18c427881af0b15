package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// proxied is a database reached through a fault proxy, and the same database
// reached directly, to check what the server holds.
type proxied struct {
	name   string
	proxy  *faultnet.Proxy
	db     *sqlfence.DB // through the proxy
	direct *sqlfence.DB
	// runTx runs f in a transaction through the proxy with RunTx or RunPgxTx;
	// exec runs an operator's statement (placeholders %s) inside it.
	runTx func(ctx context.Context, f func(guard func(name string, tok fence.Token) error, exec func(q string, args ...any) error) error) error
	// count counts the rows of table whose id is id, directly.
	count  func(t *testing.T, table, id string) int
	create func(t *testing.T, table string)
	guards *sqlfence.Guards
}

// proxiedPool is a pgx pool on the test PostgreSQL server through proxy, of
// at most maxConns connections (0: pgx's default).
func proxiedPool(t testing.TB, proxy *faultnet.Proxy, maxConns int32) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// mysqlAddr is the test MySQL server's address.
func mysqlAddr(t testing.TB) string {
	cfg, err := mysql.ParseDSN(testenv.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Addr
}

// proxiedMySQL is a database/sql handle on the test MySQL server through proxy.
func proxiedMySQL(t testing.TB, proxy *faultnet.Proxy) *sql.DB {
	cfg, err := mysql.ParseDSN(testenv.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	cfg.Addr = proxy.Addr()
	db, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// pgTarget is the test PostgreSQL server's address.
func pgTarget(t testing.TB) string {
	cfg, err := pgx.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Host + ":" + strconv.Itoa(int(cfg.Port))
}

// lostReplyTargets are PostgreSQL through pgx and through database/sql, and
// MySQL or MariaDB, each behind a fault proxy.
func lostReplyTargets(t *testing.T) []proxied {
	direct := pgPool(t, pgOpts{})
	idemStore(t, sqlfence.Pgx(direct))
	pgCount := func(t *testing.T, table, id string) int {
		var n int
		if err := direct.QueryRow(context.Background(), fmt.Sprintf("SELECT count(*) FROM %s WHERE id = $1", table), id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	pgCreate := func(t *testing.T, table string) {
		if _, err := direct.Exec(context.Background(), fmt.Sprintf("CREATE TABLE %s (id TEXT PRIMARY KEY)", table)); err != nil {
			t.Fatal(err)
		}
	}
	pgGuards := mustGuards(t, sqlfence.Pgx(direct))

	pxPgx := faultnet.Start(t, pgTarget(t))
	pool := proxiedPool(t, pxPgx, 0)
	pxStd := faultnet.Start(t, pgTarget(t))
	std := stdlib.OpenDBFromPool(proxiedPool(t, pxStd, 0))
	t.Cleanup(func() { std.Close() })

	myRaw, myDirect := openMySQL(t, "")
	pxMy := faultnet.Start(t, mysqlAddr(t))
	my := proxiedMySQL(t, pxMy)
	myGuards := mustGuards(t, myDirect)

	stdTx := func(db *sql.DB, g *sqlfence.Guards, ph string) func(context.Context, func(func(string, fence.Token) error, func(string, ...any) error) error) error {
		return func(ctx context.Context, f func(func(string, fence.Token) error, func(string, ...any) error) error) error {
			return sqlfence.RunTx(ctx, db, nil, func(tx *sql.Tx) error {
				return f(func(name string, tok fence.Token) error { return g.Guard(ctx, tx, name, tok) },
					func(q string, args ...any) error {
						_, err := tx.ExecContext(ctx, fmt.Sprintf(q, ph), args...)
						return err
					})
			})
		}
	}
	return []proxied{
		{
			name: "postgres-pgx", proxy: pxPgx, db: sqlfence.Pgx(pool), direct: sqlfence.Pgx(direct),
			runTx: func(ctx context.Context, f func(func(string, fence.Token) error, func(string, ...any) error) error) error {
				return sqlfence.RunPgxTx(ctx, pool, nil, func(tx pgx.Tx) error {
					return f(func(name string, tok fence.Token) error { return pgGuards.GuardPgx(ctx, tx, name, tok) },
						func(q string, args ...any) error { _, err := tx.Exec(ctx, fmt.Sprintf(q, "$1"), args...); return err })
				})
			},
			count: pgCount, create: pgCreate, guards: pgGuards,
		},
		{
			name: "postgres-database-sql", proxy: pxStd, db: sqlfence.Postgres(std), direct: sqlfence.Pgx(direct),
			runTx: stdTx(std, pgGuards, "$1"), count: pgCount, create: pgCreate, guards: pgGuards,
		},
		{
			name: "mysql", proxy: pxMy, db: sqlfence.MySQL(my), direct: myDirect,
			runTx: stdTx(my, myGuards, "?"),
			count: func(t *testing.T, table, id string) int {
				var n int
				if err := myRaw.QueryRow(fmt.Sprintf("SELECT count(*) FROM %s WHERE id = ?", table), id).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			},
			create: func(t *testing.T, table string) {
				if _, err := myRaw.Exec(fmt.Sprintf("CREATE TABLE %s (id VARCHAR(64) PRIMARY KEY)", table)); err != nil {
					t.Fatal(err)
				}
			},
			guards: myGuards,
		},
	}
}

// carrying matches the request that carries s (a key's bytes are in the
// request that executes the statement, not in a prepare).
func carrying(s string) func([]byte) bool {
	return func(b []byte) bool { return faultnet.Carries(b, s) }
}

// committing matches the request that commits a transaction; not a
// statement that sets synchronous_commit (sqlfence's PostgreSQL statements
// that must reach the disk do).
func committing(b []byte) bool {
	l := bytes.ToLower(b)
	return bytes.Contains(bytes.ReplaceAll(l, []byte("synchronous_commit"), nil), []byte("commit"))
}

// lose arms a lost reply for the next request that match accepts, runs f, and
// checks that the fault was taken.
func lose(t *testing.T, p *faultnet.Proxy, match func([]byte) bool, f func() error) error {
	t.Helper()
	p.LoseReply(match)
	err := f()
	if n := p.Pending(); n != 0 {
		t.Fatalf("the lost reply was never taken (%d pending): the test did not test it", n)
	}
	return err
}

func wantUnknown(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("%s whose reply was lost: %v, want an error matching fence.ErrUnknown", what, err)
	}
}

// TestLostReplies (HAZARDS 3): a statement reaches the server, is applied,
// and its reply is lost. Each step must say so (fence.ErrUnknown) or
// recognise its own applied change; never a bare transport error, never a
// definite failure for a change that landed.
func TestLostReplies(t *testing.T) {
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			w, _ := sqlfence.NewWriter(p.db, nil)
			check, _ := sqlfence.NewWriter(p.direct, nil)
			t.Run("write", func(t *testing.T) {
				for _, existing := range []bool{false, true} {
					key := fencetest.Name("lost-write")
					if existing {
						if err := w.Write(ctx, key, []byte("old"), 1); err != nil {
							t.Fatal(err)
						}
					}
					wantUnknown(t, "Write", lose(t, p.proxy, carrying(key), func() error { return w.Write(ctx, key, []byte("new"), 5) }))
					v, tok, err := check.Read(ctx, key)
					// On MySQL the first statement for a new key is an UPDATE
					// that finds no row: its lost reply hid nothing.
					unapplied := !existing && p.name == "mysql" && errors.Is(err, fence.ErrNotFound)
					if !unapplied && (err != nil || string(v) != "new" || tok != 5) {
						t.Errorf("the key after the lost write: %q, %d, %v; want new, 5 (the write landed)", v, tok, err)
					}
				}
			})
			t.Run("delete", func(t *testing.T) {
				key := fencetest.Name("lost-delete")
				if err := w.Write(ctx, key, []byte("v"), 1); err != nil {
					t.Fatal(err)
				}
				wantUnknown(t, "Delete", lose(t, p.proxy, carrying(key), func() error { return w.Delete(ctx, key, 2) }))
				if _, _, err := check.Read(ctx, key); !errors.Is(err, fence.ErrNotFound) {
					t.Errorf("the key after the lost delete: %v, want ErrNotFound (the delete landed)", err)
				}
				if err := check.Write(ctx, key, []byte("stale"), 1); !errors.Is(err, fence.ErrStale) {
					t.Errorf("a write below the lost delete's token: %v, want ErrStale", err)
				}
			})
			t.Run("guard commit", func(t *testing.T) {
				table := "lost_" + fencetest.Name("t")[2:]
				p.create(t, table)
				name, id := fencetest.Name("lost-guard"), fencetest.Name("row")
				err := lose(t, p.proxy, committing, func() error {
					return p.runTx(ctx, func(guard func(string, fence.Token) error, exec func(string, ...any) error) error {
						if err := guard(name, 7); err != nil {
							return err
						}
						return exec("INSERT INTO "+table+" (id) VALUES (%s)", id)
					})
				})
				wantUnknown(t, "a guarded transaction's commit", err)
				if n := p.count(t, table, id); n != 1 {
					t.Errorf("%d rows of the committed transaction, want 1", n)
				}
			})
			t.Run("acquire", func(t *testing.T) {
				a, _ := sqlfence.NewAcquirer(p.db, nil)
				other, _ := sqlfence.NewAcquirer(p.direct, nil)
				name := fencetest.Name("lost-lease")
				var l fence.Lease
				err := lose(t, p.proxy, carrying(name), func() (err error) {
					l, err = a.TryAcquire(ctx, name, time.Minute)
					return err
				})
				if err != nil {
					t.Fatalf("TryAcquire whose reply was lost: %v, want the applied grant recognised", err)
				}
				info, err := other.Inspect(ctx, name)
				if err != nil || !info.Held || info.Token != l.Token() {
					t.Fatalf("the lease row after a recognised grant: %+v, %v; want held by token %d", info, err, l.Token())
				}
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
			})
			t.Run("renew release", func(t *testing.T) {
				a, _ := sqlfence.NewAcquirer(p.db, nil)
				other, _ := sqlfence.NewAcquirer(p.direct, nil)
				name := fencetest.Name("lost-renew")
				l, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				if err := lose(t, p.proxy, carrying(name), func() error { return l.Renew(ctx) }); err != nil {
					t.Errorf("Renew whose reply was lost: %v, want nil (it landed, or its retry did)", err)
				}
				if err := l.Context().Err(); err != nil {
					t.Errorf("the lease context after a renewal: %v", err)
				}
				if err := lose(t, p.proxy, carrying(name), func() error { return l.Release(ctx) }); err != nil {
					t.Errorf("Release whose reply was lost: %v, want nil (it landed)", err)
				}
				l2, err := other.TryAcquire(ctx, name, time.Second)
				if err != nil {
					t.Fatalf("another acquirer after the lost release: %v, want the lock free", err)
				}
				_ = l2.Release(ctx)
			})
			t.Run("idempotency", func(t *testing.T) {
				s, _ := sqlfence.NewIdempotencyStore(p.db, nil)
				direct, _ := sqlfence.NewIdempotencyStore(p.direct, nil)
				key := fencetest.Name("lost-idem")
				wantUnknown(t, "Begin", lose(t, p.proxy, carrying(key), func() error {
					_, _, err := s.Begin(ctx, key, "fp", "me", time.Minute)
					return err
				}))
				rec, err := direct.Get(ctx, key)
				if err != nil || rec.State != idempotency.Claimed || rec.Owner != "me" {
					t.Fatalf("the record after a lost claim: %+v, %v; want claimed by me", rec, err)
				}
				wantUnknown(t, "Update", lose(t, p.proxy, carrying(key), func() error {
					_, err := s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
					return err
				}))
				if rec, err := direct.Get(ctx, key); err != nil || rec.State != idempotency.Armed {
					t.Errorf("the record after a lost arm: %+v, %v; want armed", rec, err)
				}
			})
		})
	}
}

// TestRenewConfirmedAfterLocalDeadline (HAZARDS 6): a renewal reaches the
// server while the lease is live there, and its reply comes back after the
// lease's local deadline (a slow network). Renew returns ErrLost, and the row
// the server extended is given up: another acquirer is granted at once.
func TestRenewConfirmedAfterLocalDeadline(t *testing.T) {
	const ttl, drift, delay = 8 * time.Second, 7 * time.Second, 700 * time.Millisecond
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel() // each target has its own proxy
			ctx := context.Background()
			// The local deadline is ttl - drift = 1s after the grant's
			// request; a renewal sent before it reaches the server after
			// delay (well inside its 8s) and is confirmed after 2 x delay,
			// past that deadline.
			a, _ := sqlfence.NewAcquirer(p.db, &sqlfence.AcquirerOptions{Drift: drift})
			other, _ := sqlfence.NewAcquirer(p.direct, nil)
			for try := 1; ; try++ {
				name := fencetest.Name("slow-renew")
				l, err := a.TryAcquire(ctx, name, ttl)
				if err != nil {
					t.Fatal(err)
				}
				if l.Context().Err() != nil {
					// A loaded machine took the whole second before the
					// Renew could be sent (a CI run saw it: the Renew then
					// sends nothing, and the row is held for its first
					// ttl, as for any lease left to expire): the case
					// proves nothing; try again.
					if try == 3 {
						t.Fatalf("the lease's context was done before the Renew, 3 times: the case proved nothing")
					}
					t.Logf("try %d: the lease's context was done before the Renew could be sent: trying again", try)
					continue
				}
				p.proxy.Latency(delay, delay)
				err = l.Renew(ctx)
				p.proxy.Latency(0, 0)
				if !errors.Is(err, fence.ErrLost) {
					t.Fatalf("Renew confirmed after the local deadline: %v, want ErrLost", err)
				}
				l2, err := other.TryAcquire(ctx, name, time.Second)
				if err != nil {
					info, _ := other.Inspect(ctx, name)
					t.Fatalf("another acquirer after the late confirmation: %v (%+v); the extended row was not given up", err, info)
				}
				_ = l2.Release(ctx)
				return
			}
		})
	}
}

// TestMySQLLostReplyOfParameterPath (HAZARDS 3): on MySQL a value over the
// inline limit goes as a base64 parameter of a prepared statement (prepare,
// then execute); with a small packet limit every argument does. The execute
// reaches the server, is applied, and its reply is lost: Write says
// fence.ErrUnknown, and the value landed.
func TestMySQLLostReplyOfParameterPath(t *testing.T) {
	for _, params := range []string{"", "maxAllowedPacket=4096"} {
		t.Run("params="+params, func(t *testing.T) {
			ctx := context.Background()
			_, direct := openMySQL(t, params)
			px := faultnet.Start(t, mysqlAddr(t))
			cfg, err := mysql.ParseDSN(testenv.MySQLDSN())
			if err != nil {
				t.Fatal(err)
			}
			cfg.Addr = px.Addr()
			dsn := cfg.FormatDSN()
			if params != "" {
				dsn += "&" + params
				if !strings.Contains(cfg.FormatDSN(), "?") {
					dsn = cfg.FormatDSN() + "?" + params
				}
			}
			my, err := sql.Open("mysql", dsn)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { my.Close() })
			w, _ := sqlfence.NewWriter(sqlfence.MySQL(my), nil)
			check, _ := sqlfence.NewWriter(direct, nil)
			for _, existing := range []bool{false, true} {
				key := fencetest.Name("lost-param")
				if existing {
					if err := w.Write(ctx, key, []byte("old"), 1); err != nil {
						t.Fatal(err)
					}
				}
				v := inlinePattern(6000)
				b64 := base64.StdEncoding.EncodeToString(v)
				err := lose(t, px, func(b []byte) bool { return bytes.Contains(b, []byte(b64[:64])) }, func() error { return w.Write(ctx, key, v, 5) })
				got, tok, rerr := check.Read(ctx, key)
				landed := rerr == nil && tok == 5 && bytes.Equal(got, v)
				if !errors.Is(err, fence.ErrUnknown) && !(err == nil && landed) {
					t.Errorf("Write (existing %v) whose execute reply was lost: %v (the value landed: %v), want ErrUnknown", existing, err, landed)
				}
			}
		})
	}
}
