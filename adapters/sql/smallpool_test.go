package sqlfence_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// smallPool is a handle on the test server whose pool has room for size
// connections, with a way to take them all (take) and give them back.
type smallPool struct {
	app   string              // application_name of every connection, to find them on the server
	newDB func() *sqlfence.DB // another sqlfence handle on the same pool
	// take holds every connection of the pool until the returned func runs.
	take func(t *testing.T) func()
}

func randomSuffix() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// smallPgPool opens a pool of size connections on the test PostgreSQL
// server: a *pgxpool.Pool with MaxConns (style "pgx") or a *sql.DB with
// SetMaxOpenConns (style "database-sql").
func smallPgPool(t *testing.T, style string, size int) smallPool {
	t.Helper()
	app := "fencekit-smallpool-" + randomSuffix()
	ctx := context.Background()
	switch style {
	case "pgx":
		cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = int32(size)
		cfg.ConnConfig.RuntimeParams["application_name"] = app
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		if err == nil {
			err = p.Ping(ctx)
		}
		if err != nil {
			testenv.Missing(t, "PostgreSQL at "+testenv.PostgresURL(), err)
		}
		t.Cleanup(p.Close)
		pgSetup(t, p)
		return smallPool{app: app, newDB: func() *sqlfence.DB { return sqlfence.Pgx(p) }, take: func(t *testing.T) func() {
			var cs []*pgxpool.Conn
			for range size {
				c, err := p.Acquire(ctx)
				if err != nil {
					t.Fatal(err)
				}
				cs = append(cs, c)
			}
			return func() {
				for _, c := range cs {
					c.Release()
				}
			}
		}}
	default:
		cc, err := pgx.ParseConfig(testenv.PostgresURL())
		if err != nil {
			t.Fatal(err)
		}
		cc.RuntimeParams["application_name"] = app
		db := stdlib.OpenDB(*cc)
		db.SetMaxOpenConns(size)
		if err := db.PingContext(ctx); err != nil {
			db.Close()
			testenv.Missing(t, "PostgreSQL at "+testenv.PostgresURL(), err)
		}
		t.Cleanup(func() { db.Close() })
		pgStd(t) // the default tables
		return smallPool{app: app, newDB: func() *sqlfence.DB { return sqlfence.Postgres(db) }, take: takeStd(db, size)}
	}
}

// takeStd takes all size connections of db.
func takeStd(db *sql.DB, size int) func(t *testing.T) func() {
	return func(t *testing.T) func() {
		var cs []*sql.Conn
		for range size {
			c, err := db.Conn(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			cs = append(cs, c)
		}
		return func() {
			for _, c := range cs {
				c.Close()
			}
		}
	}
}

// waitListening waits until at least n sessions named app listen for
// releases on the server, read on a connection of the test's own.
func waitListening(t *testing.T, app string, n int) {
	t.Helper()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	for deadline := time.Now().Add(30 * time.Second); ; {
		var got int
		if err := c.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN fencekit_release'", app).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sessions listening after 30s, want %d", got, n)
		}
		time.Sleep(10 * time.Millisecond) // polling the server's view; not a synchronisation with the code under test
	}
}

// TestWaitersLeaveSmallPoolToHolder: Acquire calls that wait (on three
// handles over one pool, each of which listens for releases) never take the
// connections that the holder's Renew and Release and a fenced Write need,
// on pools of 1, 2 and 3 connections; each waiter is then granted in turn.
func TestWaitersLeaveSmallPoolToHolder(t *testing.T) {
	for _, style := range []string{"pgx", "database-sql"} {
		for _, size := range []int{1, 2, 3} {
			t.Run(fmt.Sprintf("%s/%d", style, size), func(t *testing.T) {
				sp := smallPgPool(t, style, size)
				holdWhileWaiting(t, size, sp.newDB, func(*testing.T, []*sqlfence.Acquirer, string) {
					// Every handle that can listen on this pool does (before,
					// each took a connection of the pool to listen on).
					waitListening(t, sp.app, min(smallPoolWaiters, size))
				})
			})
		}
	}
}

// TestMySQLWaitersLeaveSmallPoolToHolder is TestWaitersLeaveSmallPoolToHolder
// on MariaDB, whose waiters pin connections for their bells: at most a
// quarter of SetMaxOpenConns, none below 4, so never all of them.
func TestMySQLWaitersLeaveSmallPoolToHolder(t *testing.T) {
	for _, size := range []int{1, 3, 4, 8} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			db, _ := openMySQL(t, "")
			db.SetMaxOpenConns(size)
			holdWhileWaiting(t, size, func() *sqlfence.DB { return sqlfence.MySQL(db) }, func(t *testing.T, waiters []*sqlfence.Acquirer, name string) {
				// Each waiter is in its line, and on a pool with room for
				// bells (the holder's grant took the first pin) a ringer
				// holds a pinned connection.
				wantPins := 0
				if size/4 > 1 {
					wantPins = 1
				}
				for deadline := time.Now().Add(30 * time.Second); ; {
					pins, lined := 0, 0
					for _, wa := range waiters {
						pins += sqlfence.BellPinned(wa)
						lined += sqlfence.LineLen(wa, name)
					}
					if lined == len(waiters) && pins >= wantPins {
						return
					}
					if time.Now().After(deadline) {
						t.Fatalf("after 30s %d waiters in line with %d pins, want %d with %d", lined, pins, len(waiters), wantPins)
					}
					time.Sleep(10 * time.Millisecond) // polling the waiters' state; nothing waits on this loop
				}
			})
		})
	}
}

const smallPoolWaiters = 3

// holdWhileWaiting holds a lease on a handle of newDB while three waiters,
// each on a handle of its own, wait for it; once ready says they all wait,
// the holder renews, writes and releases, each within a generous bound, and
// each waiter is then granted in turn with a larger token.
func holdWhileWaiting(t *testing.T, size int, newDB func() *sqlfence.DB, ready func(t *testing.T, waiters []*sqlfence.Acquirer, name string)) {
	hdb := newDB()
	ha := newAcquirerOn(t, hdb, nil)
	w, err := sqlfence.NewWriter(hdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	name := "smallpool-" + randomSuffix()
	ctx := context.Background()
	l, err := ha.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		l   fence.Lease
		err error
	}
	got := make(chan result, smallPoolWaiters)
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	var waiters []*sqlfence.Acquirer
	for range smallPoolWaiters {
		wa := newAcquirerOn(t, newDB(), nil)
		waiters = append(waiters, wa)
		go func() {
			l, err := wa.Acquire(wctx, name, time.Minute)
			got <- result{l, err}
		}()
	}
	ready(t, waiters, name)

	step := func(what string, f func(ctx context.Context) error) {
		t.Helper()
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := f(sctx); err != nil {
			t.Fatalf("%s while %d waiters wait on a pool of %d: %v", what, smallPoolWaiters, size, err)
		}
	}
	step("renew", l.Renew)
	step("write", func(ctx context.Context) error { return w.Write(ctx, name, []byte("v"), l.Token()) })
	step("release", l.Release)
	last := l.Token()
	for i := range smallPoolWaiters {
		r := <-got
		if r.err != nil {
			t.Fatalf("waiter %d: %v", i, r.err)
		}
		if r.l.Token() <= last {
			t.Fatalf("waiter %d granted token %d, not above %d", i, r.l.Token(), last)
		}
		last = r.l.Token()
		step("waiter's release", r.l.Release)
	}
}

// notSentHandle is a handle whose every connection the test can take, so
// that a call's context ends while it waits for one.
type notSentHandle struct {
	fdb  *sqlfence.DB
	take func(t *testing.T) func()
}

// TestStatementNotSentIsNotUnknown: a call whose context ends while it waits
// for a connection of a full pool sent nothing, and says so: its error
// matches the context's, never fence.ErrUnknown, and nothing changed.
func TestStatementNotSentIsNotUnknown(t *testing.T) {
	handles := map[string]func(t *testing.T) notSentHandle{
		"pgx": func(t *testing.T) notSentHandle {
			sp := smallPgPool(t, "pgx", 1)
			return notSentHandle{sp.newDB(), sp.take}
		},
		"database-sql": func(t *testing.T) notSentHandle {
			sp := smallPgPool(t, "database-sql", 1)
			return notSentHandle{sp.newDB(), sp.take}
		},
		"mysql": func(t *testing.T) notSentHandle {
			db, fdb := openMySQL(t, "")
			db.SetMaxOpenConns(1)
			return notSentHandle{fdb, takeStd(db, 1)}
		},
		"sqlite": func(t *testing.T) notSentHandle {
			db, err := sqlfence.OpenSQLite(filepath.Join(t.TempDir(), "f.db"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			db.SetMaxOpenConns(1)
			return notSentHandle{sqlfence.SQLite(db), takeStd(db, 1)}
		},
	}
	for style, open := range handles {
		t.Run(style, func(t *testing.T) {
			h := open(t)
			ctx := context.Background()
			w, err := sqlfence.NewWriter(h.fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			a := newAcquirerOn(t, h.fdb, nil)
			s, err := sqlfence.NewIdempotencyStore(h.fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			for _, create := range []func(context.Context) error{w.CreateTable, a.CreateTable, s.CreateTable} {
				if err := create(ctx); err != nil {
					t.Fatal(err)
				}
			}
			name, key := "notsent-"+randomSuffix(), "notsent-"+randomSuffix()
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			claimed, _, err := s.Begin(ctx, key+"-claimed", "fp", "me", time.Minute)
			if err != nil {
				t.Fatal(err)
			}

			giveBack := h.take(t)
			calls := []struct {
				what string
				f    func(ctx context.Context) error
			}{
				{"write", func(ctx context.Context) error { return w.Write(ctx, key, []byte("v"), l.Token()) }},
				{"delete", func(ctx context.Context) error { return w.Delete(ctx, key+"-deleted", l.Token()) }},
				{"renew", l.Renew},
				{"try acquire", func(ctx context.Context) error {
					_, err := a.TryAcquire(ctx, name+"-other", time.Minute)
					return err
				}},
				{"bump", func(ctx context.Context) error { return a.Bump(ctx, name+"-bumped", fence.MaxToken-1) }},
				{"idempotency begin", func(ctx context.Context) error {
					_, _, err := s.Begin(ctx, key, "fp", "me", time.Minute)
					return err
				}},
				{"idempotency update", func(ctx context.Context) error {
					_, err := s.Update(ctx, claimed.Key, idempotency.Claimed, claimed.Fence, idempotency.Change{State: idempotency.Released, Fence: claimed.Fence})
					return err
				}},
				{"idempotency get", func(ctx context.Context) error {
					_, err := s.Get(ctx, key)
					return err
				}},
				{"release", l.Release}, // last: the lease ends locally whatever the outcome
			}
			for _, c := range calls {
				cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
				err := c.f(cctx)
				cancel()
				if err == nil || errors.Is(err, fence.ErrUnknown) || !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("%s that waited for a connection until its context ended: %v; want the context's error, not fence.ErrUnknown", c.what, err)
				}
			}
			giveBack()

			// Nothing was sent: nothing changed.
			if _, _, err := w.Read(ctx, key); !errors.Is(err, fence.ErrNotFound) {
				t.Errorf("read of the key written: %v, want fence.ErrNotFound", err)
			}
			if info, err := a.Inspect(ctx, name); err != nil || !info.Held || info.Token != l.Token() {
				t.Errorf("inspect after the release that was not sent: %+v, %v; want held with token %d", info, err, l.Token())
			}
			if info, err := a.Inspect(ctx, name+"-other"); !errors.Is(err, fence.ErrNotFound) {
				t.Errorf("inspect of the name tried: %+v, %v; want fence.ErrNotFound", info, err)
			}
			if _, err := s.Get(ctx, key); !errors.Is(err, fence.ErrNotFound) {
				t.Errorf("idempotency get of the key begun: %v, want fence.ErrNotFound", err)
			}
			if rec, err := s.Get(ctx, claimed.Key); err != nil || rec.State != idempotency.Claimed {
				t.Errorf("idempotency get of the key updated: %+v, %v; want it claimed still", rec, err)
			}
		})
	}
}
