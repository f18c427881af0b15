package sqlfence_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/linetest"
)

// lineDialects returns one handle per dialect, each with its lease table.
func lineDialects(t *testing.T) map[string]*sqlfence.DB {
	_, sq := openSQLite(t)
	newSQLiteAcquirer(t, sq) // creates the table
	_, my := openMySQL(t, "")
	return map[string]*sqlfence.DB{
		"sqlite":   sq,
		"postgres": sqlfence.Pgx(pgPool(t, pgOpts{})),
		"mysql":    my,
	}
}

// waitLine waits until n Acquire calls of a wait in name's line.
func waitLine(t *testing.T, a *sqlfence.Acquirer, name string, n int) {
	t.Helper()
	linetest.Wait(t, func(name string) int { return sqlfence.LineLen(a, name) }, name, n)
}

// TestAcquireLineOrder: the waiting Acquire calls of one acquirer are granted
// in the order they began, and a holder that releases and asks again joins at
// the back (linetest.Order).
func TestAcquireLineOrder(t *testing.T) {
	for dialect, fdb := range lineDialects(t) {
		t.Run(dialect, func(t *testing.T) {
			a := newAcquirerOn(t, fdb, nil)
			if err := a.CreateTable(context.Background()); err != nil {
				t.Fatal(err)
			}
			// A grant statement slower than wakeup.Stall on a loaded machine lets
			// the waiters behind the head try out of turn, by design (CI: [0 4 1 2
			// 3 -1] on PostgreSQL); the order itself is what is checked here.
			sqlfence.SetLineStall(a, time.Minute)
			linetest.Order(t, a, func(name string) int { return sqlfence.LineLen(a, name) }, time.Minute)
		})
	}
}

// TestAcquireLineWaiterGivesUp: a waiter whose context ends leaves the line,
// and when it was the head the next waiter is granted as soon as the lock is
// released, not after a stall.
func TestAcquireLineWaiterGivesUp(t *testing.T) {
	ctx := context.Background()
	for dialect, fdb := range lineDialects(t) {
		t.Run(dialect, func(t *testing.T) {
			// The head tries when it joins and when a release through a
			// pokes it, never on a timer: the cancel below then comes
			// while it waits, not during a grant statement. (A grant
			// statement cancelled in flight can land after the give-back's
			// read: watchGrant gives it back, but within its polling, not
			// at once; TestLineCancelAtGrant. Loaded run 6 on
			// fa779fc most likely hit it on MySQL here: the next waiter
			// was not granted within 20s.)
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: time.Minute, Max: time.Minute}})
			name := fencetest.Name("line")
			h, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			hctx, cancel := context.WithCancel(ctx)
			headDone := make(chan error, 1)
			go func() {
				_, err := a.Acquire(hctx, name, time.Minute)
				headDone <- err
			}()
			waitLine(t, a, name, 1)
			next := make(chan fence.Lease, 1)
			nextErr := make(chan error, 1)
			go func() {
				l, err := a.Acquire(ctx, name, time.Minute)
				if err != nil {
					nextErr <- err
					return
				}
				next <- l
			}()
			waitLine(t, a, name, 2)
			for end := time.Now().Add(10 * time.Second); sqlfence.LineHeadTrying(a, name); {
				if time.Now().After(end) {
					t.Fatal("the head's first attempt did not end within 10s")
				}
				time.Sleep(5 * time.Millisecond) // polling the line's state
			}
			cancel()
			if err := <-headDone; !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) {
				t.Fatalf("head whose context was cancelled: %v, want ErrHeld and context.Canceled", err)
			}
			waitLine(t, a, name, 1)
			if err := h.Release(ctx); err != nil {
				t.Fatal(err)
			}
			// The lock is free once the release's statement has committed:
			// timed from there, not from its start (loaded run l1 this
			// session: 514ms from the release's start, most of it the
			// statement itself on a loaded machine). A waiter left behind a
			// head that had gone waits out its Stall timer (0.5-1s) or a
			// Backoff of a minute.
			released := time.Now()
			select {
			case l := <-next:
				took := time.Since(released)
				if took > 500*time.Millisecond {
					t.Fatalf("the new head was granted %v after the release: it waited as a waiter behind a head that had left", took)
				}
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
			case err := <-nextErr:
				t.Fatal(err)
			case <-time.After(20 * time.Second):
				t.Fatal("the waiter behind a head that gave up was never granted")
			}
			if n := sqlfence.LineLen(a, name); n != 0 {
				t.Fatalf("line has %d waiters after every Acquire returned", n)
			}
		})
	}
}

// TestAcquireLineMaxWait: a waiter behind the head gives up at the acquirer's
// MaxWait, as any wait does, with ErrHeld and the maximum wait named.
func TestAcquireLineMaxWait(t *testing.T) {
	ctx := context.Background()
	_, fdb := openSQLite(t)
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: fence.Backoff{MaxWait: 300 * time.Millisecond}})
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("line")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Release(ctx)
	errs := make(chan error, 2)
	for i := range 2 {
		go func() {
			_, err := a.Acquire(ctx, name, time.Minute)
			errs <- err
		}()
		waitLine(t, a, name, i+1)
	}
	for range 2 {
		err := <-errs
		if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Acquire past MaxWait: %v, want ErrHeld and DeadlineExceeded", err)
		}
		if want := fmt.Sprint(300 * time.Millisecond); !strings.Contains(err.Error(), want) {
			t.Fatalf("Acquire past MaxWait: %q does not name the maximum wait %s", err, want)
		}
	}
}
