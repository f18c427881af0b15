package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"net"
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

// TestIdempotencyLongRetention (HAZARDS 8): a completed record kept for 30
// days (more than 2^31 milliseconds) is stored, on every dialect, through
// Update and CompleteTx.
func TestIdempotencyLongRetention(t *testing.T) {
	const retention = 30 * 24 * time.Hour
	ctx := context.Background()
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			_, _, s := d.parts(t)
			key := fencetest.Name("long-retention")
			rec, claimed, err := s.Begin(ctx, key, "fp", "me", time.Minute)
			if err != nil || !claimed {
				t.Fatalf("Begin: %+v, %v, %v", rec, claimed, err)
			}
			rec, err = s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
			if err != nil {
				t.Fatalf("arm: %v", err)
			}
			rec, err = s.Update(ctx, key, idempotency.Armed, rec.Fence, idempotency.Change{State: idempotency.Completed, Fence: rec.Fence, Owner: "me", Result: []byte("ok"), Retention: retention})
			if err != nil {
				t.Fatalf("complete with a %v retention: %v", retention, err)
			}
			if rec.State != idempotency.Completed || string(rec.Result) != "ok" {
				t.Errorf("the completed record: %+v", rec)
			}
		})
	}
}

// TestRenewReplyLostPastLocalDeadline (HAZARDS 6, 3): a renewal is sent
// before the lease's local deadline, reaches the server after it (the server
// still holds the lease: its ttl is longer than the local deadline by the
// drift), is applied, and its reply is lost. Renew must not leave the row
// extended for another ttl while telling the holder it lost the lease:
// another acquirer is granted at once afterwards.
func TestRenewReplyLostPastLocalDeadline(t *testing.T) {
	const ttl, drift = 10 * time.Second, 9700 * time.Millisecond
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			a, _ := sqlfence.NewAcquirer(p.db, &sqlfence.AcquirerOptions{Drift: drift})
			other, _ := sqlfence.NewAcquirer(p.direct, nil)
			name := fencetest.Name("lost-late-renew")
			l, err := a.TryAcquire(ctx, name, ttl)
			if err != nil {
				t.Fatal(err)
			}
			// The renewal's request waits in the proxy until the local
			// deadline (300ms after the grant) has passed, then reaches the
			// server (which holds the lease for 10s) and its reply is lost.
			err = lose(t, p.proxy, func(b []byte) bool {
				if !faultnet.Carries(b, name) {
					return false
				}
				<-l.Context().Done()
				return true
			}, func() error { return l.Renew(ctx) })
			if err == nil {
				t.Fatalf("Renew past the local deadline returned nil")
			}
			if !errors.Is(err, fence.ErrLost) && !errors.Is(err, fence.ErrUnknown) {
				t.Errorf("Renew past the local deadline: %v, want ErrLost or ErrUnknown", err)
			}
			l2, err := other.TryAcquire(ctx, name, time.Second)
			if err != nil {
				info, _ := other.Inspect(ctx, name)
				t.Fatalf("another acquirer after the renewal whose reply was lost: %v (%+v); the extended row was not given up", err, info)
			}
			_ = l2.Release(ctx)
		})
	}
}

// TestBumpOfMissingRowKeepsClockFloor (HAZARDS 1): the lease row of a name
// is deleted (an operator's DELETE) while a paused holder has its token; an
// operator's Bump to a small value recreates the row. The next grant must
// still be above the paused holder's token: Bump must not start a counter
// below the server's clock, where a new row would start.
func TestBumpOfMissingRowKeepsClockFloor(t *testing.T) {
	ctx := context.Background()
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			w, a, _ := d.parts(t)
			name := fencetest.Name("bump-deleted")
			la, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if err := d.exec(ctx, "DELETE FROM fence_leases WHERE name = %s", name); err != nil {
				t.Fatal(err)
			}
			if err := a.Bump(ctx, name, 1000); err != nil && !errors.Is(err, fence.ErrInvalid) {
				t.Fatalf("Bump of the deleted row: %v", err)
			}
			lb, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = lb.Release(context.Background()) })
			if lb.Token() <= la.Token() {
				t.Fatalf("B's token %d is not above the paused holder's %d", lb.Token(), la.Token())
			}
			key := name + "/data"
			if err := w.Write(ctx, key, []byte("B"), lb.Token()); err != nil {
				t.Fatal(err)
			}
			if err := w.Write(ctx, key, []byte("A"), la.Token()); !errors.Is(err, fence.ErrStale) {
				t.Errorf("the paused holder's write after B's: %v, want ErrStale", err)
			}
		})
	}
}

// TestBadOwner (HAZARDS 8): an Owner the lease table cannot store (a NUL
// byte, invalid UTF-8) is refused by NewAcquirer with fence.ErrInvalid naming
// it, on every dialect, rather than failing every grant.
func TestBadOwner(t *testing.T) {
	ctx := context.Background()
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			for _, owner := range []string{"a\x00b", "a\xffb", strings.Repeat("o", 70000)} {
				a, err := sqlfence.NewAcquirer(d.db, &sqlfence.AcquirerOptions{Owner: owner})
				if err != nil {
					var ie *fence.InvalidError
					if !errors.As(err, &ie) || ie.Arg != "owner" {
						t.Errorf("NewAcquirer with owner %.20q: %v, want an InvalidError naming owner", owner, err)
					}
					continue
				}
				// Accepted: then it must work, and be recognised.
				name := fencetest.Name("bad-owner")
				l, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Errorf("owner %.20q (%d bytes) accepted by NewAcquirer, then TryAcquire: %.300v", owner, len(owner), err)
					continue
				}
				info, err := a.Inspect(ctx, name)
				if err != nil || info.Owner != owner {
					t.Errorf("owner %.20q (%d bytes) accepted, Inspect shows %.20q (%d bytes), %v", owner, len(owner), info.Owner, len(info.Owner), err)
				}
				_ = l.Release(ctx)
			}
		})
	}
}

// TestReleaseReplyLostThenRegranted (HAZARDS 3): a release is applied and
// its reply lost; before the release runs again another acquirer is granted
// the name. The retry finds the row under a newer token: Release cannot know
// whether its own release landed first, and must not report a definite
// fence.ErrLost (the lease expired before the release) for a release that
// landed.
func TestReleaseReplyLostThenRegranted(t *testing.T) {
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			a, _ := sqlfence.NewAcquirer(p.db, nil)
			other, _ := sqlfence.NewAcquirer(p.direct, nil)
			name := fencetest.Name("lost-release-regrant")
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			var l2 fence.Lease
			var otherErr error
			seen := 0
			// The first request carrying the name is the release: it is
			// applied and its reply lost (LoseReply). The second is its
			// retry: before it is forwarded, the other acquirer takes the
			// name.
			p.proxy.DropRequest(func(b []byte) bool {
				if faultnet.Carries(b, name) {
					if seen++; seen == 2 {
						l2, otherErr = other.TryAcquire(ctx, name, time.Minute)
					}
				}
				return false
			})
			p.proxy.LoseReply(carrying(name))
			err = l.Release(ctx)
			if otherErr != nil || l2 == nil {
				t.Fatalf("the other acquirer after the applied release: %v", otherErr)
			}
			t.Cleanup(func() { _ = l2.Release(context.Background()) })
			if errors.Is(err, fence.ErrLost) {
				t.Errorf("Release whose applied release's reply was lost, name granted again since: %v; want nil or ErrUnknown, not a definite ErrLost", err)
			}
		})
	}
}

// TestLostGrantReplyWithAdvanceGuards (HAZARDS 3): with AdvanceGuards, a
// grant whose reply (or whose commit's reply) was lost is recognised or run
// again, as without it: TryAcquire returns the lease, never a bare
// transport error, and the guard row holds the lease's token.
func TestLostGrantReplyWithAdvanceGuards(t *testing.T) {
	for _, p := range lostReplyTargets(t) {
		for _, step := range []string{"grant", "commit"} {
			if step == "commit" && p.name != "mysql" {
				continue // one statement on PostgreSQL
			}
			t.Run(p.name+"/"+step, func(t *testing.T) {
				ctx := context.Background()
				if err := p.guards.CreateTable(ctx); err != nil {
					t.Fatal(err)
				}
				a, err := sqlfence.NewAcquirer(p.db, &sqlfence.AcquirerOptions{AdvanceGuards: p.guards})
				if err != nil {
					t.Fatal(err)
				}
				other, _ := sqlfence.NewAcquirer(p.direct, nil)
				name := fencetest.Name("lost-grant-adv")
				match := carrying(name)
				if step == "commit" {
					match = committing
				}
				var l fence.Lease
				err = lose(t, p.proxy, match, func() (err error) {
					l, err = a.TryAcquire(ctx, name, time.Minute)
					return err
				})
				if err != nil {
					t.Fatalf("TryAcquire whose %s reply was lost: %v, want the grant recognised or run again", step, err)
				}
				t.Cleanup(func() { _ = l.Release(context.Background()) })
				info, err := other.Inspect(ctx, name)
				if err != nil || !info.Held || info.Token != l.Token() {
					t.Fatalf("the lease row: %+v, %v; want held by token %d", info, err, l.Token())
				}
			})
		}
	}
}

// closedAddr returns a loopback address nothing listens on: a connection to
// it is refused, so no request can reach a server.
func closedAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestUnreachableServerIsDefinite (HAZARDS 3): when the connection to the
// server is refused, no statement was sent: the steps report the error as
// it is, never fence.ErrUnknown ("may have been applied").
func TestUnreachableServerIsDefinite(t *testing.T) {
	addr := closedAddr(t)
	pcfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(addr)
	n, _ := strconv.Atoi(port)
	pcfg.ConnConfig.Host, pcfg.ConnConfig.Port, pcfg.ConnConfig.Fallbacks = host, uint16(n), nil
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	std := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { std.Close() })
	mcfg, err := mysql.ParseDSN(testenv.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	mcfg.Addr = addr
	my, err := sql.Open("mysql", mcfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { my.Close() })
	for name, db := range map[string]*sqlfence.DB{"postgres-pgx": sqlfence.Pgx(pool), "postgres-database-sql": sqlfence.Postgres(std), "mysql": sqlfence.MySQL(my)} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			w, _ := sqlfence.NewWriter(db, nil)
			a, _ := sqlfence.NewAcquirer(db, nil)
			s, _ := sqlfence.NewIdempotencyStore(db, nil)
			_, tryErr := a.TryAcquire(ctx, "unreachable", time.Minute)
			_, _, beginErr := s.Begin(ctx, "unreachable", "fp", "me", time.Minute)
			_, updErr := s.Update(ctx, "unreachable", idempotency.Claimed, 1, idempotency.Change{State: idempotency.Armed, Fence: 1, Owner: "me", Lease: time.Minute})
			for step, err := range map[string]error{
				"Write":      w.Write(ctx, "unreachable", []byte("v"), 1),
				"Delete":     w.Delete(ctx, "unreachable", 1),
				"TryAcquire": tryErr,
				"Bump":       a.Bump(ctx, "unreachable", 5),
				"Begin":      beginErr,
				"Update":     updErr,
			} {
				if err == nil {
					t.Errorf("%s with the server unreachable: nil", step)
				} else if errors.Is(err, fence.ErrUnknown) {
					t.Errorf("%s with the connection refused: %v; nothing was sent, want the error as it is, not ErrUnknown", step, err)
				}
			}
		})
	}
}

// TestLongFingerprint (HAZARDS 4, 8): a fingerprint over 64 KiB (a request
// body used as the fingerprint) either works on every dialect (a retry of
// the same request replays the first result) or is refused by the store with
// fence.ErrInvalid before anything runs; never cut on the way so that the
// same request no longer matches itself.
func TestLongFingerprint(t *testing.T) {
	ctx := context.Background()
	fp := strings.Repeat("f", 70000)
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			_, _, s := d.parts(t)
			key := fencetest.Name("long-fp")
			runs := 0
			effect := func(context.Context, string) ([]byte, error) { runs++; return []byte("done"), nil }
			_, err := idempotency.Do(ctx, s, key, fp, effect, nil)
			if err != nil {
				if !errors.Is(err, fence.ErrInvalid) || runs != 0 {
					t.Fatalf("Do with a %d-byte fingerprint: %.300v (%d runs); want it to work or ErrInvalid before the effect", len(fp), err, runs)
				}
				return
			}
			res, err := idempotency.Do(ctx, s, key, fp, effect, nil)
			if err != nil || !res.Replayed || string(res.Value) != "done" || runs != 1 {
				t.Errorf("the same request again: %+v, %v (%d runs); want the first result replayed", res, err, runs)
			}
		})
	}
}

// TestCommitOfFailedTxIsDefinite (HAZARDS 3): a transaction in which a
// statement failed (the caller ignored the error) is rolled back by the
// server at COMMIT, which says so: RunTx and RunPgxTx report an error that
// is not fence.ErrUnknown ("may have committed"), and nothing committed.
func TestCommitOfFailedTxIsDefinite(t *testing.T) {
	ctx := context.Background()
	p := pgPool(t, pgOpts{})
	std := pgStd(t)
	err := sqlfence.RunPgxTx(ctx, p, nil, func(tx pgx.Tx) error {
		_, _ = tx.Exec(ctx, "SELECT 1/0")
		return nil
	})
	if err == nil || errors.Is(err, fence.ErrUnknown) {
		t.Errorf("RunPgxTx whose commit the server answered with ROLLBACK: %v, want a definite error", err)
	}
	err = sqlfence.RunTx(ctx, std, nil, func(tx *sql.Tx) error {
		_, _ = tx.ExecContext(ctx, "SELECT 1/0")
		return nil
	})
	if err == nil || errors.Is(err, fence.ErrUnknown) {
		t.Errorf("RunTx whose commit the server answered with ROLLBACK: %v, want a definite error", err)
	}
}

// TestDoneContextIsDefinite (HAZARDS 3): a step called with a context that
// has already ended sends nothing: it reports the context's error, never
// fence.ErrUnknown ("may have been applied").
func TestDoneContextIsDefinite(t *testing.T) {
	done, cancel := context.WithCancel(context.Background())
	cancel()
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			w, a, s := d.parts(t)
			_, tryErr := a.TryAcquire(done, "done-ctx", time.Minute)
			_, _, beginErr := s.Begin(done, "done-ctx", "fp", "me", time.Minute)
			_, updErr := s.Update(done, "done-ctx", idempotency.Claimed, 1, idempotency.Change{State: idempotency.Armed, Fence: 1, Owner: "me", Lease: time.Minute})
			l, err := a.TryAcquire(context.Background(), fencetest.Name("done-ctx"), time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			renewErr, releaseErr := l.Renew(done), l.Release(done)
			if err := l.Release(context.Background()); err != nil {
				t.Errorf("Release after a Release with a cancelled context: %v; want the lease still held and released now", err)
			}
			for step, err := range map[string]error{
				"Renew":      renewErr,
				"Release":    releaseErr,
				"Write":      w.Write(done, "done-ctx", []byte("v"), 1),
				"Delete":     w.Delete(done, "done-ctx", 1),
				"TryAcquire": tryErr,
				"Bump":       a.Bump(done, "done-ctx", 5),
				"Begin":      beginErr,
				"Update":     updErr,
			} {
				if !errors.Is(err, context.Canceled) || errors.Is(err, fence.ErrUnknown) {
					t.Errorf("%s with a context already cancelled: %v; want context.Canceled, not ErrUnknown", step, err)
				}
			}
		})
	}
}
