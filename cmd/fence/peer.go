package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A peer: the lock users would pick instead of fencekit on the same server,
// held by a session of its own (PostgreSQL's pg_advisory_lock, MySQL's
// GET_LOCK). It lives in the server's memory, gives no fencing token, and
// has no ttl: it ends with its session. fence bench runs it beside
// fencekit's figures, on the same workload, as their baseline.

// peerSession is one session of a peer lock: lock waits for it, unlock lets
// it go, close gives the connection back.
type peerSession struct {
	lock, unlock func(context.Context) error
	close        func()
}

// peerLock is the peer of a backend: its name and how to open a session.
type peerLock struct {
	name string
	open func(ctx context.Context) (*peerSession, error)
}

// peerKey and peerName are the peer's lock in fence bench.
const (
	peerKey  = 7_100_040
	peerName = "fence-bench-peer"
)

// postgresPeer is pg_advisory_lock and pg_advisory_unlock on a connection
// of its own to p's server (not one of p's: a session holds its connection
// for the whole run, and p's are few).
func postgresPeer(p *pgxpool.Pool) *peerLock {
	return &peerLock{name: "pg_advisory_lock + pg_advisory_unlock", open: func(ctx context.Context) (*peerSession, error) {
		c, err := pgx.ConnectConfig(ctx, p.Config().ConnConfig)
		if err != nil {
			return nil, err
		}
		return &peerSession{
			lock: func(ctx context.Context) error {
				_, err := c.Exec(ctx, "SELECT pg_advisory_lock("+strconv.Itoa(peerKey)+")")
				return err
			},
			unlock: func(ctx context.Context) error {
				var held bool
				err := c.QueryRow(ctx, "SELECT pg_advisory_unlock("+strconv.Itoa(peerKey)+")").Scan(&held)
				if err == nil && !held {
					err = errors.New("pg_advisory_unlock: the session did not hold the lock")
				}
				return err
			},
			close: func() { c.Close(context.Background()) },
		}, nil
	}}
}

// mysqlPeer is GET_LOCK and RELEASE_LOCK on a connection of db held for the
// session; the statements carry the name as a literal (one round trip each).
func mysqlPeer(db *sql.DB) *peerLock {
	return &peerLock{name: "GET_LOCK + RELEASE_LOCK", open: func(ctx context.Context) (*peerSession, error) {
		c, err := db.Conn(ctx)
		if err != nil {
			return nil, err
		}
		one := func(ctx context.Context, q string) error {
			var got sql.NullInt64
			if err := c.QueryRowContext(ctx, q).Scan(&got); err != nil {
				return err
			}
			if got.Int64 != 1 {
				return fmt.Errorf("%s returned %v", q, got)
			}
			return nil
		}
		return &peerSession{
			lock:   func(ctx context.Context) error { return one(ctx, "SELECT GET_LOCK('"+peerName+"', 300)") },
			unlock: func(ctx context.Context) error { return one(ctx, "SELECT RELEASE_LOCK('"+peerName+"')") },
			close:  func() { c.Close() },
		}, nil
	}}
}

// acquireReleasePair interleaves n uncontended acquire + release of b with n
// lock + unlock of its peer (on one session), in random order, and returns
// the mean time of each.
func acquireReleasePair(ctx context.Context, b *backend, n int) (acq, peer time.Duration, err error) {
	s, err := b.peer.open(ctx)
	if err != nil {
		return 0, 0, err
	}
	defer s.close()
	name := fmt.Sprintf("bench-lock-%d", time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < n; i++ {
		peerFirst := rng.IntN(2) == 0
		for k := 0; k < 2; k++ {
			start := time.Now()
			if peerFirst == (k == 0) {
				if err = s.lock(ctx); err == nil {
					err = s.unlock(ctx)
				}
				peer += time.Since(start)
			} else {
				var l interface{ Release(context.Context) error }
				if l, err = b.acq.TryAcquire(ctx, name, 10*time.Second); err == nil {
					err = l.Release(ctx)
				}
				acq += time.Since(start)
			}
			if err != nil {
				return 0, 0, err
			}
		}
	}
	return acq / time.Duration(n), peer / time.Duration(n), nil
}

// peerIncrements is lockedIncrements with the peer's lock: workers x each
// increments of a counter in b's plain store (the same read and write as
// fencekit's workers, unfenced: the peer has no token), each worker on a
// session of its own. It returns the counter's final value and the time.
func peerIncrements(ctx context.Context, b *backend, name string, workers, each int) (int, time.Duration, error) {
	key := fmt.Sprintf("%s-%d", name, time.Now().UnixNano())
	if err := b.plainPut(ctx, key, []byte("0")); err != nil {
		return 0, 0, err
	}
	sessions := make([]*peerSession, 0, workers)
	defer func() {
		for _, s := range sessions {
			s.close()
		}
	}()
	for range workers {
		s, err := b.peer.open(ctx)
		if err != nil {
			return 0, 0, err
		}
		sessions = append(sessions, s)
	}
	start := time.Now()
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for _, s := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				if err := peerIncrement(ctx, b, s, key); err != nil {
					mu.Lock()
					first = errors.Join(first, err)
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	if first != nil {
		return 0, 0, first
	}
	v, err := b.plainGet(ctx, key)
	if err != nil {
		return 0, 0, err
	}
	n, err := strconv.Atoi(string(v))
	return n, took, err
}

func peerIncrement(ctx context.Context, b *backend, s *peerSession, key string) error {
	if err := s.lock(ctx); err != nil {
		return err
	}
	return errors.Join(incrementPlain(ctx, b, key), s.unlock(ctx))
}
