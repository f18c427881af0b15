package sqlfence

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fencekit/fencekit/internal/wakeup"
)

// A bell: MySQL has no notifications, so the waiters of other processes
// would only poll. Instead a grant also takes a user-level lock (GET_LOCK,
// held by the server session, in memory) named for the lease row, the
// bell, and keeps that session's connection with the lease; the release
// statement lets it go (RELEASE_ALL_LOCKS, inside the same statement); a
// handoff within the acquirer keeps it. While Acquire calls of an Acquirer
// wait for a name, one goroutine of that Acquirer (its ringer) waits for
// the bell in GET_LOCK; the server gives the bell to one waiting session
// when it is let go. The ringer then grants the lease to the head of its
// line itself, on the connection that holds the bell, at once, and hands
// the head the lease, which keeps that connection and so the bell (see
// handOn and Acquirer.ringGrant: a release's handoff within an Acquirer
// works the same way). The releasing statement lets the bell go before it
// commits and holds the row's lock until then, so the ringer's grant waits
// for the release to commit and sees its outcome; the head is not woken to
// send a grant of its own, which saves a round trip, a read and two
// goroutine wake-ups on every handoff between processes.
//
// The lease row stays the only truth: the bell only wakes. A grant that
// could not take the bell (another session had it) holds the row all the
// same. When the ringer's grant finds the row held (its holder had no bell:
// it was granted without it, or its session ended before its lease, and
// the server let the bell go with the session), the ringer keeps the bell
// and reads the row (with its shared lock) until it is free (see watch),
// then grants. Where it cannot hand the head a grant (the head is inside a
// stuck attempt of its own, or already offered a handoff), it wakes the head
// once the row is free, and the head's grant runs on the ringer's
// connection. A bell that nobody lets go only delays: every waiter keeps
// polling with its Backoff. The bell is never needed for a grant.
//
// Costs: a pinned connection of the pool per lease that holds (or tried
// for) the bell and per name that waiters of an Acquirer wait for, at most
// bellCap for all the Acquirers of a pool (a quarter of SetMaxOpenConns when
// set: none below 4; grants at most half of it, see pin); no statement of
// its own on a grant or a release; one GET_LOCK a second per ringer while
// it waits (see ring), and a locking read every 2-100ms while it watches a
// row held without the bell (see watch). GET_LOCK names are per server, not per
// database: the bell is named for the table and the lock name, so two
// databases on one server with the same table and lock name share a bell
// (a wake-up too many, or one too few, never a grant).

// bellCap bounds the connections the Acquirers of a pool pin for bells.
const bellCap = 16

// bellWait is how long, in seconds, a ringer's GET_LOCK waits before it
// looks again whether anyone still waits.
const bellWait = 1

// bells is an Acquirer's bell state: its ringers, per name, and the
// connections it pins.
type bells struct {
	db     *sql.DB
	table  string
	watchQ string // a ringer's read of the row's time left, in ms (see watch)
	hub    wakeup.Hub
	// grantHead grants name on c, which holds its bell, to the head of the
	// Acquirer's line and hands it the lease (see Acquirer.ringGrant).
	grantHead func(name string, c *sql.Conn) ringOutcome
	off       atomic.Bool // the server refused GET_LOCK: no bells from now on
	mu        sync.Mutex
	names     map[string]*ringer
	pinned    int
	// refusedCode and refusals count the grants in a row whose statement
	// with the bell failed with the same MySQL error while the same grant
	// without it did not: the server refuses GET_LOCK (see refused).
	refusedCode uint16
	refusals    int
}

// pinBudget counts the connections pinned for bells per pool, by all the
// Acquirers that share it: together they pin at most bellCap, a quarter of
// its SetMaxOpenConns when set. A pool's entry lives while it has pins.
var pinBudget = struct {
	sync.Mutex
	n map[*sql.DB]int
}{n: map[*sql.DB]int{}}

// ringer is the bell state of one name with waiters.
type ringer struct {
	subs    int       // waiters subscribed
	gen     int       // subscriptions made: a new head subscribed when it grows
	running bool      // its goroutine runs
	free    *sql.Conn // a connection holding the bell, for the next grant
	// held is a connection holding the bell that a woken head's grant gave
	// back because the row was held (by a grant without the bell): the
	// ringer keeps the bell and watches the row until it is free.
	held     *sql.Conn
	taken    bool // a grant runs on the connection that was free (see take)
	watching bool // the ringer holds the bell itself, granting or watching the row (see handOn)
	lates    int  // the ringer's grants in a row that came back late (see handOn; the ringer's goroutine only)
	changed  chan struct{}
}

func (r *ringer) poke() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

func newBells(db *sql.DB, table string, grantHead func(name string, c *sql.Conn) ringOutcome) *bells {
	return &bells{db: db, table: table, names: map[string]*ringer{}, grantHead: grantHead,
		watchQ: fmt.Sprintf("SELECT GREATEST(expires_at - %s, 0) FROM %s WHERE name = %s LOCK IN SHARE MODE", mysqlDialect.nowMs, table, mysqlText)}
}

// key is the GET_LOCK name of name's bell (41 bytes, within MySQL's 64).
func (b *bells) key(name string) string {
	h := sha256.Sum256([]byte(b.table + "\x00" + name))
	return "fencekit:" + hex.EncodeToString(h[:16])
}

// limit is how many connections the Acquirers on b's pool may pin together.
func (b *bells) limit() int {
	if m := b.db.Stats().MaxOpenConnections; m > 0 {
		return min(bellCap, m/4)
	}
	return bellCap
}

// pin takes a connection from the pool for a bell; nil when b is off, the
// pool's pin budget is spent, or the pool could not give one. A grant
// (forGrant) pins only while less than half the budget is pinned, so that
// held leases, which keep their grant's connection, leave the other half to
// the ringers: without a ringer, a name's waiters are woken by nothing but
// their Backoff.
func (b *bells) pin(ctx context.Context, forGrant bool) *sql.Conn {
	if b.off.Load() {
		return nil
	}
	limit := b.limit()
	if forGrant {
		limit = (limit + 1) / 2
	}
	pinBudget.Lock()
	if pinBudget.n[b.db] >= limit {
		pinBudget.Unlock()
		return nil
	}
	pinBudget.n[b.db]++
	pinBudget.Unlock()
	b.mu.Lock()
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
	pinBudget.Lock()
	if pinBudget.n[b.db]--; pinBudget.n[b.db] <= 0 {
		delete(pinBudget.n, b.db)
	}
	pinBudget.Unlock()
}

// refused counts a grant whose statement with the bell failed with MySQL
// error code while the same grant without it did not; after three in a row
// with one code the server is taken to refuse GET_LOCK, and b is off: its
// waiters poll, as without bells. A grant with the bell that the server
// ran (granted or not) starts the count again (accepted).
func (b *bells) refused(code uint16) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if code != b.refusedCode {
		b.refusedCode, b.refusals = code, 0
	}
	if b.refusals++; b.refusals >= 3 {
		b.off.Store(true)
	}
}

func (b *bells) accepted() {
	b.mu.Lock()
	b.refusals = 0
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
		c, r.free, r.taken = r.free, nil, true
		b.mu.Unlock()
		return c, true
	}
	b.mu.Unlock()
	return b.pin(ctx, true), false
}

// settled ends a grant on the connection take returned as free: the ringer
// goes on (waiting for the bell again, or watching the row when putBack
// gave the bell back).
func (b *bells) settled(name string) {
	b.mu.Lock()
	r := b.names[name]
	if r != nil {
		r.taken = false
	}
	b.mu.Unlock()
	if r != nil {
		r.poke()
	}
}

// putBack returns a connection holding name's bell that a woken head's
// grant took and did not use: the row was held, by a grant that did not
// get the bell (the first grant of a new row, one whose reply was lost, one
// made while this ringer held the bell), or by one whose connection ended
// before its lease (the bell went with the session). That holder's release
// will wake nobody: while anyone waits the ringer keeps the bell and
// watches the row until it is free (see watch); otherwise the bell is let go.
func (b *bells) putBack(name string, c *sql.Conn) {
	b.mu.Lock()
	if r := b.names[name]; r != nil && r.subs > 0 && r.free == nil && r.held == nil {
		r.held = c
		b.mu.Unlock()
		r.poke()
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
	r.gen++
	if !r.running {
		r.running = true
		go b.ring(name, r)
	}
	b.mu.Unlock()
	r.poke()
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
		// A connection in r.held is the ringer's: it lets it go when it
		// sees nobody waits.
	}
}

// forget drops name's ringer once nobody waits and its goroutine ended.
// Called with b.mu held.
func (b *bells) forget(name string, r *ringer) {
	if r.subs == 0 && !r.running && r.free == nil && r.held == nil && b.names[name] == r {
		delete(b.names, name)
	}
}

// ring waits for name's bell while anyone waits for name, and each time it
// gets it grants the lock to the head of the line on the connection that
// holds it (see handOn).
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
			held := r.held
			r.held, r.running = nil, false
			b.forget(name, r)
			b.mu.Unlock()
			if held != nil {
				b.letGo(held)
			}
			return
		}
		busy := r.free != nil || r.taken
		var held *sql.Conn
		if !busy {
			held, r.held = r.held, nil
		}
		b.mu.Unlock()
		if busy {
			// This acquirer's head has the bell: wait until a grant on it
			// is settled or nobody waits.
			<-r.changed
			continue
		}
		watchFirst := held != nil // given back by a head's grant that found the row held
		if held != nil {
			if c != nil {
				b.unpin(c, true) // holds no bell: held has it
				c = nil
			}
		} else {
			if c == nil {
				pctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				c = b.pin(pctx, false)
				cancel()
				if c == nil {
					b.pause(r, &fails)
					continue
				}
			}
			// wasFree: the bell was free when asked for (IS_FREE_LOCK runs
			// first), so no release let it go: its holder, if any, has none.
			var wasFree, got sql.NullInt64
			ctx, cancel := context.WithTimeout(context.Background(), (bellWait+5)*time.Second)
			err := stdConn{q: c, inline: true}.queryRow(ctx, "SELECT IS_FREE_LOCK(?), GET_LOCK(?, ?)", []any{key, key, bellWait}, &wasFree, &got)
			cancel()
			if err != nil {
				// A server that refuses GET_LOCK turns bells off through
				// the grants (see refused); until then, and for any other
				// failure, the ringer tries again after a pause.
				b.unpin(c, false)
				c = nil
				b.pause(r, &fails)
				continue
			}
			if got.Int64 != 1 {
				// Waited bellWait without the bell. Whoever has it may
				// never let it go (a process paused, or cut off, while its
				// session stays open): when the row is free all the same,
				// the head is woken to grant without the bell.
				if b.rowFree(name, c) {
					b.hub.WakeOne(name)
				}
				continue
			}
			held, c = c, nil
			// A bell that was free says nothing of the row: read it first.
			watchFirst = wasFree.Int64 == 1
		}
		b.mu.Lock()
		gen := r.gen
		b.mu.Unlock()
		if b.handOn(name, r, held, watchFirst, &fails) != ringHanded {
			continue
		}
		// The head just handed the lease leaves, and unsubscribes: until
		// another head subscribes (the next waiter of the line, once it is
		// the head, or a new Acquire), nobody waits here, and a GET_LOCK
		// now would take the bell the handed lease's release lets go from
		// the next grant of any process, which would then hold without it
		// (its release would wake nobody). At most bellWait: a head that
		// stays (a handoff taken back from a head stuck in an attempt of
		// its own) must not be left without a ringer.
		park := time.NewTimer(bellWait * time.Second)
		for parked := true; parked; {
			b.mu.Lock()
			parked = r.subs > 0 && r.gen == gen
			b.mu.Unlock()
			if parked {
				select {
				case <-r.changed:
				case <-park.C:
					parked = false
				}
			}
		}
		park.Stop()
	}
}

// handOn settles held, a connection holding name's bell, which it consumes.
// The bell was let go by a release, or by a lease whose session ended, or it
// was free (its holder, if any, did not have it). It grants the lock to the
// head of the line on held (grantHead, whose grant waits for the row lock
// the releasing statement holds until it commits) and hands the lease over;
// where the row is still held (by a holder without the bell) it watches the
// row until it is free and grants then. Where no head can be handed the
// lock (see wakeup.Line.Offer), held is kept for the head's own grant
// (ringer.free) and the head is woken, once the row is free, so that a bell
// never sends the head to a row still held. watchFirst: no release let the
// bell go (it was free when the ringer asked for it, or a head's grant gave
// it back having found the row held), so the row is read first: a grant
// now would most likely find it held, and would keep the head offered
// from a release's handoff within the Acquirer.
func (b *bells) handOn(name string, r *ringer, held *sql.Conn, watchFirst bool, fails *int) ringOutcome {
	b.mu.Lock()
	r.watching = true
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		r.watching = false
		b.mu.Unlock()
	}()
	for {
		watched := false
		if watchFirst {
			if !b.watch(name, r, held) {
				// Nobody waits any more, or a read failed: the session
				// ends, and the bell with it.
				b.unpin(held, false)
				b.pause(r, fails)
				return ringFailed
			}
			// Only a watch that read the row ends a run of failures: a
			// read that keeps failing (the table dropped) must not have
			// the ringer take the free bell again and again at once.
			*fails = 0
			watched = true
		}
		switch out := b.grantHead(name, held); out {
		case ringHanded, ringGaveBack:
			*fails = 0
			r.lates = 0
			return out
		case ringLate:
			// Grants that all come back late must not follow each other
			// at the pace of GET_LOCK (the give-back lets the bell go at
			// once): 10ms doubling to 1s, which a watch that reads the row
			// free does not reset.
			b.pause(r, &r.lates)
			return out
		case ringFailed:
			b.pause(r, fails)
			return out
		case ringHeld:
			watchFirst = true
			continue
		}
		if !watched {
			watchFirst = true
			continue
		}
		b.mu.Lock()
		if r.subs > 0 && r.free == nil {
			r.free, held = held, nil
		}
		b.mu.Unlock()
		if held != nil {
			b.letGo(held) // nobody waits any more
			return ringNoHead
		}
		b.hub.WakeOne(name)
		return ringNoHead
	}
}

// ringOutcome is what a ringer's grant for the head of its line (see
// bells.grantHead) did with the connection holding the bell.
type ringOutcome int

const (
	// ringNoHead: no head could be offered the lock; nothing was sent, and
	// the connection is the ringer's still.
	ringNoHead ringOutcome = iota
	// ringHanded: granted, and the lease (with the connection, and the
	// bell) handed to the head.
	ringHanded
	// ringGaveBack: granted, but the head had left: the grant was given
	// back, and the connection went with it.
	ringGaveBack
	// ringLate: granted, but the grant came back past the head's local
	// deadline and was given back, with the connection; the head waits on,
	// and the ringer pauses before it grants again (ringer.lates).
	ringLate
	// ringHeld: the row is held; the connection is the ringer's still,
	// holding the bell, and the head waits on at its own pace.
	ringHeld
	// ringFailed: the grant failed; the connection was closed (its
	// session ended, and the bell with it), and the head tries on its own
	// at once, or, where its attempt would end its wait for nothing (a
	// missing table, a deadlock), at its own pace.
	ringFailed
)

// timeLeft reads, on c, how long name's row is still held, in ms (0 when
// it is free, and when there is no row), with the row's shared lock (see
// watch).
func (b *bells) timeLeft(name string, c *sql.Conn) (int64, error) {
	var left int64
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := stdConn{q: c, inline: true}.queryRow(ctx, b.watchQ, []any{textArg(true, name)}, &left)
	if errors.Is(err, errNoRows) {
		return 0, nil
	}
	return left, err
}

// rowFree reports whether a read of name's row on c finds it free; false
// when the read fails.
func (b *bells) rowFree(name string, c *sql.Conn) bool {
	left, err := b.timeLeft(name, c)
	return err == nil && left <= 0
}

// watchMin and watchMax bound a watching ringer's pause between reads of
// the row (see watch): 2ms, doubling to 100ms, the zero Backoff's Max.
const (
	watchMin = 2 * time.Millisecond
	watchMax = 100 * time.Millisecond
)

// watch reads name's lease row on c, which holds the bell, until the row is
// free (expired, released, or gone), pausing up to the time it has left
// (2ms, doubling to 100ms, at most the time left); it reports whether it
// saw it free, false when nobody waits any more or a read failed (the
// caller closes c then). The read takes the row's shared lock, so it waits
// for the statement that let the bell go (a release lets it go before it
// commits) and sees its outcome.
func (b *bells) watch(name string, r *ringer, c *sql.Conn) bool {
	pause := watchMin
	for {
		left, err := b.timeLeft(name, c)
		if err != nil || left <= 0 {
			return err == nil
		}
		t := time.NewTimer(min(pause, time.Duration(left)*time.Millisecond))
		select {
		case <-t.C:
		case <-r.changed:
			t.Stop()
		}
		b.mu.Lock()
		subs := r.subs
		b.mu.Unlock()
		if subs == 0 {
			return false
		}
		pause = min(2*pause, watchMax)
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
