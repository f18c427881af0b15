package sqlfence

import (
	"context"
	"crypto/md5"
	"database/sql"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// releaseChannel is the PostgreSQL notification channel that releases are
// announced on. The payload is md5(lock name), which stays within the payload
// size limit for any name.
const releaseChannel = "fencekit_release"

// withConn runs f on a dedicated connection.
type withConn func(ctx context.Context, f func(*pgx.Conn) error) error

func stdlibConn(db *sql.DB) withConn {
	return func(ctx context.Context, f func(*pgx.Conn) error) error {
		c, err := db.Conn(ctx)
		if err != nil {
			return err
		}
		defer c.Close()
		return c.Raw(func(dc any) error {
			sc, ok := dc.(*stdlib.Conn)
			if !ok {
				return fmt.Errorf("sqlfence: LISTEN needs the pgx database/sql driver, have %T", dc)
			}
			return f(sc.Conn())
		})
	}
}

// listener keeps one connection listening on releaseChannel while at least one
// Acquire waits, and wakes the waiters of the released name. A missed
// notification costs a waiter only its next backoff interval.
type listener struct {
	conn withConn

	mu      sync.Mutex
	waiters map[string]map[chan struct{}]struct{} // by md5(name)
	cancel  context.CancelFunc
	done    chan struct{}
}

func newListener(c withConn) *listener {
	return &listener{conn: c, waiters: map[string]map[chan struct{}]struct{}{}}
}

func nameHash(name string) string {
	h := md5.Sum([]byte(name))
	return hex.EncodeToString(h[:])
}

// subscribe returns a channel that receives when name may have been released,
// and the function that ends the subscription.
func (l *listener) subscribe(name string) (<-chan struct{}, func()) {
	key := nameHash(name)
	ch := make(chan struct{}, 1)
	l.mu.Lock()
	if l.waiters[key] == nil {
		l.waiters[key] = map[chan struct{}]struct{}{}
	}
	l.waiters[key][ch] = struct{}{}
	if l.cancel == nil {
		ctx, cancel := context.WithCancel(context.Background())
		l.cancel, l.done = cancel, make(chan struct{})
		go l.run(ctx, l.done)
	}
	l.mu.Unlock()
	return ch, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		delete(l.waiters[key], ch)
		if len(l.waiters[key]) == 0 {
			delete(l.waiters, key)
		}
		if len(l.waiters) == 0 && l.cancel != nil {
			l.cancel()
			l.cancel = nil
		}
	}
}

// run listens until ctx is cancelled, reconnecting after a broken connection.
func (l *listener) run(ctx context.Context, done chan struct{}) {
	defer close(done)
	for attempt := 0; ctx.Err() == nil; attempt++ {
		err := l.conn(ctx, func(c *pgx.Conn) error {
			if _, err := c.Exec(ctx, "LISTEN "+releaseChannel); err != nil {
				return err
			}
			defer func() {
				uctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				_, _ = c.Exec(uctx, "UNLISTEN "+releaseChannel)
			}()
			attempt = 0
			l.wakeAll() // a release may have happened before LISTEN took effect
			for {
				n, err := c.WaitForNotification(ctx)
				if err != nil {
					return err
				}
				l.wake(n.Payload)
			}
		})
		if ctx.Err() != nil || err == nil {
			return
		}
		select { // reconnect with a capped delay; waiters poll meanwhile
		case <-ctx.Done():
			return
		case <-time.After(min(time.Duration(1<<min(attempt, 6))*10*time.Millisecond, time.Second)):
		}
	}
}

func (l *listener) wake(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for ch := range l.waiters[key] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

func (l *listener) wakeAll() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, chs := range l.waiters {
		for ch := range chs {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
}
