package sqlfence

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fencekit/fencekit/internal/wakeup"
	"github.com/go-sql-driver/mysql"
)

// A bell: MySQL has no notifications, so the waiters of other processes
// would only poll. Instead a grant also takes a user-level lock (GET_LOCK,
// held by the server session, in memory) named for the lease row, the
// bell, and keeps that session's connection with the lease; the release
// statement lets it go (RELEASE_ALL_LOCKS, inside the same statement); a
// handoff within the acquirer keeps it. While Acquire calls of an Acquirer
// wait for a name, one goroutine of that Acquirer (its ringer) waits for
// the bell in GET_LOCK; the server gives the bell to one waiting session
// when it is let go, and that wakes the head of the ringer's line, whose
// grant then runs on the ringer's connection and so keeps the bell.
//
// The lease row stays the only truth: the bell only wakes. A grant that
// could not take the bell (another session had it) holds the row all the
// same; a ringer that gets a bell whose holder did not hold the row (it was
// granted without the bell, or its lease ended without a release: its
// connection is closed, and the server lets the bell go with the session)
// wakes a head that finds the row held and waits with its Backoff, as
// without the bell; a bell that nobody lets go only delays: every waiter
// keeps polling with its Backoff. The bell is never needed for a grant.
//
// Costs: a pinned connection of the pool per lease that holds (or tried
// for) the bell and per name that waiters of this Acquirer wait for, at most
// bellCap in all (a quarter of SetMaxOpenConns when set: none below 4); no
// statement of its own on a grant or a release. GET_LOCK names are per
// server, not per database: the bell is named for the table and the lock
// name, so two databases on one server with the same table and lock name
// share a bell (a wake-up too many, or one too few, never a grant).

// bellCap bounds the connections an Acquirer pins for bells.
const bellCap = 16

// bellWait is how long, in seconds, a ringer's GET_LOCK waits before it
// looks again whether anyone still waits.
const bellWait = 1

// bells is an Acquirer's bell state: its ringers, per name, and the
// connections it pins.
type bells struct {
	db     *sql.DB
	table  string
	hub    wakeup.Hub
	off    atomic.Bool // the server refused GET_LOCK: no bells from now on
	mu     sync.Mutex
	names  map[string]*ringer
	pinned int
}

// ringer is the bell state of one name with waiters.
type ringer struct {
	subs    int       // waiters subscribed
	running bool      // its goroutine runs
	free    *sql.Conn // a connection holding the bell, for the next grant
	changed chan struct{}
}

func (r *ringer) poke() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

func newBells(db *sql.DB, table string) *bells {
	return &bells{db: db, table: table, names: map[string]*ringer{}}
}

// key is the GET_LOCK name of name's bell (41 bytes, within MySQL's 64).
func (b *bells) key(name string) string {
	h := sha256.Sum256([]byte(b.table + "\x00" + name))
	return "fencekit:" + hex.EncodeToString(h[:16])
}

// limit is how many connections b may pin.
func (b *bells) limit() int {
	if m := b.db.Stats().MaxOpenConnections; m > 0 {
		return min(bellCap, m/4)
	}
	return bellCap
}

// pin takes a connection from the pool for a bell; nil when b is off, at
// its limit, or the pool could not give one.
func (b *bells) pin(ctx context.Context) *sql.Conn {
	b.mu.Lock()
	if b.off.Load() || b.pinned >= b.limit() {
		b.mu.Unlock()
		return nil
	}
	b.pinned++
	b.mu.Unlock()
	c, err := b.db.Conn(ctx)
	if err != nil {
		b.unpinned()
		return nil
	}
	return c
}

func (b *bells) unpinned() {
	b.mu.Lock()
	b.pinned--
	b.mu.Unlock()
}

// unpin gives c back: to the pool when it holds no bell, else closed, which
// ends its server session and with it any bell it held.
func (b *bells) unpin(c *sql.Conn, holdsNone bool) {
	if !holdsNone {
		_ = c.Raw(func(any) error { return driver.ErrBadConn })
	}
	_ = c.Close()
	b.unpinned()
}

// letGo lets go of the bell c holds and gives c back.
func (b *bells) letGo(c *sql.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err := c.ExecContext(ctx, "DO RELEASE_ALL_LOCKS()")
	b.unpin(c, err == nil)
}

// take returns the connection holding name's bell for a grant, if the
// ringer has one (free reports it), or else a newly pinned one (nil when
// none can be pinned).
func (b *bells) take(ctx context.Context, name string) (c *sql.Conn, free bool) {
	b.mu.Lock()
	if r := b.names[name]; r != nil && r.free != nil {
		c, r.free = r.free, nil
		b.mu.Unlock()
		r.poke()
		return c, true
	}
	b.mu.Unlock()
	return b.pin(ctx), false
}

// putBack returns a connection holding name's bell that a grant took and
// did not use (the row was held): the ringer keeps it for the next grant
// while anyone waits; otherwise the bell is let go.
func (b *bells) putBack(name string, c *sql.Conn) {
	b.mu.Lock()
	if r := b.names[name]; r != nil && r.subs > 0 && r.free == nil {
		r.free = c
		b.mu.Unlock()
		return
	}
	b.mu.Unlock()
	b.letGo(c)
}

// subscribe registers wake as a waiter of name's bell (see Acquire's
// listen) and returns the function that ends it.
func (b *bells) subscribe(name string, wake chan struct{}) func() {
	if b.off.Load() {
		return func() {}
	}
	unsub := b.hub.SubscribeChan(name, wake)
	b.mu.Lock()
	r := b.names[name]
	if r == nil {
		r = &ringer{changed: make(chan struct{}, 1)}
		b.names[name] = r
	}
	r.subs++
	if !r.running {
		r.running = true
		go b.ring(name, r)
	}
	b.mu.Unlock()
	return func() {
		unsub()
		b.mu.Lock()
		r.subs--
		var free *sql.Conn
		if r.subs == 0 {
			free, r.free = r.free, nil
			b.forget(name, r)
		}
		b.mu.Unlock()
		r.poke()
		if free != nil {
			go b.letGo(free)
		}
	}
}

// forget drops name's ringer once nobody waits and its goroutine ended.
// Called with b.mu held.
func (b *bells) forget(name string, r *ringer) {
	if r.subs == 0 && !r.running && r.free == nil && b.names[name] == r {
		delete(b.names, name)
	}
}

// ring waits for name's bell while anyone waits for name, and wakes the
// head of the line each time it gets it.
func (b *bells) ring(name string, r *ringer) {
	key := b.key(name)
	var c *sql.Conn
	defer func() {
		if c != nil {
			b.unpin(c, true)
		}
	}()
	for fails := 0; ; {
		b.mu.Lock()
		if r.subs == 0 || b.off.Load() {
			r.running = false
			b.forget(name, r)
			b.mu.Unlock()
			return
		}
		busy := r.free != nil
		b.mu.Unlock()
		if busy {
			// This acquirer's head has the bell: wait until a grant takes
			// it or nobody waits.
			<-r.changed
			continue
		}
		if c == nil {
			pctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			c = b.pin(pctx)
			cancel()
			if c == nil {
				b.pause(r, &fails)
				continue
			}
		}
		var got sql.NullInt64
		ctx, cancel := context.WithTimeout(context.Background(), (bellWait+5)*time.Second)
		err := c.QueryRowContext(ctx, "SELECT GET_LOCK(?, ?)", key, bellWait).Scan(&got)
		cancel()
		if err != nil {
			b.unpin(c, false)
			c = nil
			var me *mysql.MySQLError
			if errors.As(err, &me) {
				// The server refuses GET_LOCK (a cluster that does not
				// replicate user locks): waiters poll, as without bells.
				b.off.Store(true)
			}
			b.pause(r, &fails)
			continue
		}
		fails = 0
		if got.Int64 != 1 {
			continue // waited bellWait: look again whether anyone waits
		}
		b.mu.Lock()
		if r.subs > 0 && r.free == nil {
			r.free, c = c, nil
		}
		b.mu.Unlock()
		if c != nil {
			b.letGo(c) // nobody waits any more
			c = nil
			continue
		}
		b.hub.WakeOne(name)
	}
}

// pause waits before a ringer's next try after a failure: 10ms doubling to
// 1s, or until its waiters change.
func (b *bells) pause(r *ringer, fails *int) {
	t := time.NewTimer(min(10*time.Millisecond<<min(*fails, 7), time.Second))
	defer t.Stop()
	*fails++
	select {
	case <-t.C:
	case <-r.changed:
	}
}
