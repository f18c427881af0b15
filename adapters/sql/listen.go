package sqlfence

import (
	"context"
	"crypto/md5"
	"database/sql"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/fencekit/fencekit/internal/wakeup"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// releaseChannel is the PostgreSQL notification channel that releases are
// announced on. The payload is md5(lock name), which stays within the payload
// size limit for any name.
const releaseChannel = "fencekit_release"

// withConn runs f on a connection of its own, opened for it outside the
// handle's pool and closed afterwards: a pool's connections stay for the
// statements of holders, writers and waiters, however small the pool.
type withConn func(ctx context.Context, f func(*pgx.Conn) error) error

// poolConn opens the listening connection with p's configuration (its
// BeforeConnect hook included).
func poolConn(p *pgxpool.Pool) withConn {
	return func(ctx context.Context, f func(*pgx.Conn) error) error {
		pc := p.Config()
		cc := pc.ConnConfig
		if pc.BeforeConnect != nil {
			if err := pc.BeforeConnect(ctx, cc); err != nil {
				return err
			}
		}
		return dedicated(ctx, cc, f)
	}
}

// stdlibConn opens the listening connection with the configuration of a
// connection of db, read for each new listening connection (a connector's
// BeforeConnect may change credentials between connections): the pool's
// connection is taken only for that read.
func stdlibConn(db *sql.DB) withConn {
	return func(ctx context.Context, f func(*pgx.Conn) error) error {
		c, err := db.Conn(ctx)
		if err != nil {
			return err
		}
		var cc *pgx.ConnConfig
		err = c.Raw(func(dc any) error {
			sc, ok := dc.(*stdlib.Conn)
			if !ok {
				return fmt.Errorf("sqlfence: LISTEN needs the pgx database/sql driver, have %T", dc)
			}
			cc = sc.Conn().Config()
			return nil
		})
		_ = c.Close()
		if err != nil {
			return err
		}
		return dedicated(ctx, cc, f)
	}
}

// dedicated connects with cc, runs f on that connection and closes it.
func dedicated(ctx context.Context, cc *pgx.ConnConfig, f func(*pgx.Conn) error) error {
	// pgx buffers notifications for WaitForNotification only without a
	// handler of the config's own (a connection's Config carries its own).
	cc.OnNotification = nil
	c, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = c.Close(cctx) // ends the session, and its LISTEN with it
	}()
	return f(c)
}

// listener keeps one connection of its own (see withConn) listening on
// releaseChannel while at least one Acquire waits, and passes each release
// to one waiter of that name. A missed notification costs a waiter only its
// next backoff interval.
type listener struct {
	wakeup.Hub // keyed by md5(name), the notification payload
	conn       withConn
}

func newListener(c withConn) *listener {
	l := &listener{conn: c}
	l.Listen = l.run
	return l
}

func nameHash(name string) string {
	h := md5.Sum([]byte(name))
	return hex.EncodeToString(h[:])
}

// subscribe returns a channel that receives when name may have been released,
// and the function that ends the subscription.
func (l *listener) subscribe(name string) (<-chan struct{}, func()) {
	return l.Subscribe(nameHash(name))
}

// run listens until ctx is cancelled, reconnecting after a broken connection.
func (l *listener) run(ctx context.Context) {
	for attempt := 0; ctx.Err() == nil; attempt++ {
		err := l.conn(ctx, func(c *pgx.Conn) error {
			if _, err := c.Exec(ctx, "LISTEN "+releaseChannel); err != nil {
				return err
			}
			attempt = 0
			l.WakeAll() // a release may have happened before LISTEN took effect
			for {
				n, err := c.WaitForNotification(ctx)
				if err != nil {
					return err
				}
				if n != nil {
					l.WakeOne(n.Payload)
				}
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
