package sqlfence_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
)

// TestSQLiteFloorReadWhenRowIsCreated (HAZARDS 1): on SQLite a new lease row
// starts its counter at the host's clock in microseconds. That clock must be
// read when the row is created, not when the grant (or Bump) was called: a
// call that waits for a connection of a busy pool (or for SQLite's write
// lock) while another handle creates the row, hands out its token and the
// row is deleted, must not then create the row with its older reading, a
// token below the one handed out meanwhile.
//
// Handle 1 has one connection, which the test holds; the call on it is seen
// waiting for it (the pool's WaitCount) before handle 2 grants and the row
// is deleted, so the order is forced, not slept into.
func TestSQLiteFloorReadWhenRowIsCreated(t *testing.T) {
	for _, op := range []string{"TryAcquire", "Bump"} {
		t.Run(op, func(t *testing.T) {
			ctx := context.Background()
			path := filepath.Join(t.TempDir(), "floor.db")
			h1, err := sqlfence.OpenSQLite(path)
			if err != nil {
				t.Fatal(err)
			}
			defer h1.Close()
			h1.SetMaxOpenConns(1)
			h2, err := sqlfence.OpenSQLite(path)
			if err != nil {
				t.Fatal(err)
			}
			defer h2.Close()
			a1 := newSQLiteAcquirer(t, sqlfence.SQLite(h1))
			a2 := newSQLiteAcquirer(t, sqlfence.SQLite(h2))
			name := fencetest.Name("floor-late")

			held, err := h1.Conn(ctx) // handle 1's only connection
			if err != nil {
				t.Fatal(err)
			}
			type result struct {
				l   fence.Lease
				err error
			}
			done := make(chan result, 1)
			go func() {
				if op == "Bump" {
					done <- result{nil, a1.Bump(ctx, name, 1)}
					return
				}
				l, err := a1.TryAcquire(ctx, name, time.Minute)
				done <- result{l, err}
			}()
			for deadline := time.Now().Add(10 * time.Second); h1.Stats().WaitCount == 0; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the call on handle 1 never waited for its connection")
				}
			}
			// Meanwhile another process grants the name, and the row is deleted.
			lb, err := a2.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("handle 2 granted token %d while handle 1's %s waited", lb.Token(), op)
			if err := lb.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := h2.ExecContext(ctx, "DELETE FROM fence_leases WHERE name = $1", name); err != nil {
				t.Fatal(err)
			}
			held.Close() // handle 1's call goes on
			r := <-done
			if r.err != nil {
				t.Fatalf("%s on handle 1: %v", op, r.err)
			}
			l := r.l
			if op == "Bump" { // the next grant shows where the bumped row starts
				if l, err = a2.TryAcquire(ctx, name, time.Minute); err != nil {
					t.Fatal(err)
				}
			}
			defer l.Release(ctx)
			if l.Token() <= lb.Token() {
				t.Fatalf("after %s on handle 1: token %d, not above %d, granted on handle 2 before: the row was created with a clock reading from before that grant", op, l.Token(), lb.Token())
			}
			t.Logf("after %s on handle 1: token %d", op, l.Token())
		})
	}
}

// TestSQLiteIdempotencyFenceAfterPurgeAtOnce (HAZARDS 1): Store.Begin
// promises a fence larger than any the key had, also after Purge removed its
// record. A key claimed, released, purged and claimed again within one
// millisecond must not get the fence it had: on SQLite, whose clock counts
// milliseconds, a new record's fence must come from a microsecond clock.
// Two records of one key in state claimed with one fence are one to Update's
// compare-and-set.
func TestSQLiteIdempotencyFenceAfterPurgeAtOnce(t *testing.T) {
	ctx := context.Background()
	_, fdb := openSQLite(t)
	s := idemStore(t, fdb)
	key := fencetest.Name("purged-at-once")
	var prev fence.Token
	for i := 0; i < 50; i++ {
		rec, created, err := s.Begin(ctx, key, "fp", "owner", time.Minute)
		if err != nil || !created {
			t.Fatalf("claim %d: created %v, %v", i, created, err)
		}
		if rec.Fence <= prev {
			t.Fatalf("claim %d after the record was purged: fence %d, not above the key's earlier fence %d", i, rec.Fence, prev)
		}
		prev = rec.Fence
		if _, err := s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Released, Fence: rec.Fence}); err != nil {
			t.Fatal(err)
		}
		if n, err := s.Purge(ctx); err != nil || n != 1 {
			t.Fatalf("Purge: %d, %v; want 1 record removed", n, err)
		}
	}
}
