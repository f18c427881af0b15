package sqlfence_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
)

// listenerPids returns the pids of the sessions named app that listen for
// releases, read on a connection of the test's own.
func listenerPids(t *testing.T, c *pgx.Conn, app string) []int32 {
	t.Helper()
	rows, err := c.Query(context.Background(), "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN fencekit_release'", app)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		t.Fatal(err)
	}
	return pids
}

// TestWaiterWokenAfterListenerKilled (HAZARDS 6): the session that listens
// for releases on a waiter's behalf is ended by the server
// (pg_terminate_backend) while the waiter waits. A release by another
// process, made while the listener reconnects or after it listens again,
// still wakes the waiter: it is granted long before its next poll (a
// backoff of 20s here), never after a whole poll interval or ttl.
func TestWaiterWokenAfterListenerKilled(t *testing.T) {
	direct, err := pgx.Connect(context.Background(), testenv.PostgresURL())
	if err != nil {
		testenv.Missing(t, "PostgreSQL at "+testenv.PostgresURL(), err)
	}
	t.Cleanup(func() { direct.Close(context.Background()) })
	for _, style := range []string{"pgx", "database-sql"} {
		for _, when := range []string{"while it reconnects", "after it listens again"} {
			t.Run(style+"/"+when, func(t *testing.T) {
				sp := smallPgPool(t, style, 2)
				wa := newAcquirerOn(t, sp.newDB(), &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 20 * time.Second, Max: 20 * time.Second}})
				holder := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil) // another process: its release reaches the waiter only by NOTIFY
				name := fencetest.Name("listener-killed")
				ctx := context.Background()
				l, err := holder.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				wctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				type result struct {
					l   fence.Lease
					err error
					at  time.Time
				}
				got := make(chan result, 1)
				go func() {
					l, err := wa.Acquire(wctx, name, time.Minute)
					got <- result{l, err, time.Now()}
				}()
				waitListening(t, sp.app, 1)
				old := listenerPids(t, direct, sp.app)
				if _, err := direct.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN fencekit_release'", sp.app); err != nil {
					t.Fatal(err)
				}
				if when == "after it listens again" {
					for deadline := time.Now().Add(30 * time.Second); ; {
						pids := listenerPids(t, direct, sp.app)
						if len(pids) > 0 && fmt.Sprint(pids) != fmt.Sprint(old) {
							break
						}
						if time.Now().After(deadline) {
							t.Fatalf("no new listening session 30s after the old one (%v) was ended", old)
						}
						time.Sleep(10 * time.Millisecond) // polling the server's view
					}
				}
				released := time.Now()
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-got
				if r.err != nil {
					t.Fatalf("waiter: %v", r.err)
				}
				if d := r.at.Sub(released); d > 10*time.Second {
					t.Errorf("waiter granted %v after the release, with its listener ended %s: it was not woken, it polled", d, when)
				}
				_ = r.l.Release(ctx)
			})
		}
	}
}

// TestWaiterArrivingAsListenerCloses (HAZARDS 6): the last waiter of a *DB
// is granted, so its listening session closes; at once another waiter
// arrives (a new session is opened) and the lock it waits for is released
// by another process before that session listens. The release is not lost
// between the two sessions: the new waiter is granted long before its next
// poll (20s).
func TestWaiterArrivingAsListenerCloses(t *testing.T) {
	for _, style := range []string{"pgx", "database-sql"} {
		t.Run(style, func(t *testing.T) {
			sp := smallPgPool(t, style, 2)
			wa := newAcquirerOn(t, sp.newDB(), &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 20 * time.Second, Max: 20 * time.Second}})
			holder := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
			ctx := context.Background()
			first, second := fencetest.Name("closing-1"), fencetest.Name("closing-2")
			l1, err := holder.TryAcquire(ctx, first, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			l2, err := holder.TryAcquire(ctx, second, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			wctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			got1 := make(chan error, 1)
			go func() {
				l, err := wa.Acquire(wctx, first, time.Minute)
				if err == nil {
					_ = l.Release(ctx)
				}
				got1 <- err
			}()
			waitListening(t, sp.app, 1)
			if err := l1.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-got1; err != nil {
				t.Fatalf("first waiter: %v", err)
			}
			// The listener is closing now: the next waiter opens another.
			got2 := make(chan error, 1)
			go func() {
				l, err := wa.Acquire(wctx, second, time.Minute)
				if err == nil {
					_ = l.Release(ctx)
				}
				got2 <- err
			}()
			released := time.Now()
			if err := l2.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-got2; err != nil {
				t.Fatalf("second waiter: %v", err)
			}
			if d := time.Since(released); d > 10*time.Second {
				t.Errorf("second waiter granted %v after the release made while its listener opened: the release was missed, it polled", d)
			}
		})
	}
}
