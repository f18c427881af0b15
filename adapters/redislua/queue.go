package redislua

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
)

// A waiter's place in line lives in Redis (see scripts/lock.lua): the script
// that frees a lock grants it to the first live waiter of any process, and
// tells that waiter's acquirer on its own channel, so the waiter holds the
// lease without asking again. grants is the acquirer's end of that channel.

// grantMsg is a grant to one waiter, made by a script on its behalf.
type grantMsg struct {
	token uint64
	// sent is when the waiter sent the last request that Redis handled before
	// the grant (its stamp), or the releaser's send time when later: the
	// grant happened after it, so the lease's local deadline counts from it.
	sent time.Time
}

// grants subscribes to an acquirer's grant channel while any of its Acquire
// calls wait, and passes each grant to the waiter whose nonce it names.
type grants struct {
	c       Client
	channel string
	epoch   time.Time // stamps are durations since epoch, on the monotonic clock

	mu      sync.Mutex
	waiters map[string]*waiter
	// departed holds the waiters that left while their leave is still sent
	// in the background: a grant to one of them sends that leave at once.
	departed map[string]chan struct{}
	sub      *subscription // the current subscription, nil when none
	stop     context.CancelFunc
	idle     *time.Timer // ends the subscription after a spell with no waiter
}

// waiter is one Acquire's end: its grant, and the notice that it is next in
// line (sent only to a waiter that spins, see AcquirerOptions.HeadSpin).
type waiter struct {
	grant chan grantMsg
	next  chan struct{}
}

// grantsLinger keeps the subscription after the last waiter leaves, so a
// process that waits again soon does not subscribe again.
const grantsLinger = 2 * time.Second

func newGrants(c Client, channel string) *grants {
	return &grants{c: c, channel: channel, epoch: time.Now(), waiters: map[string]*waiter{}}
}

// stamp encodes t for the line entry; a waiter that spins when it is next in
// line ends it with "s", which asks the script that grants the lease to the
// waiter before it to tell it so ("next <nonce>").
func (g *grants) stamp(t time.Time, spins bool) string {
	s := strconv.FormatInt(int64(t.Sub(g.epoch)), 10)
	if spins {
		s += "s"
	}
	return s
}

// sentAt decodes a stamp; a malformed one gives the epoch (the most
// conservative answer: the lease's deadline then lies in the past).
func (g *grants) sentAt(stamp string) time.Time {
	n, err := strconv.ParseInt(strings.TrimSuffix(stamp, "s"), 10, 64)
	if err != nil {
		return g.epoch
	}
	return g.epoch.Add(time.Duration(n))
}

// subscription is one subscription to the grant channel. ready is closed once
// Redis confirmed it, or refused it: then err says why (the Redis user may not
// subscribe to the channel), and the waiters poll instead.
type subscription struct {
	ready chan struct{}
	err   error

	mu sync.Mutex
	// notRun is the reply with which Redis last refused the SUBSCRIBE
	// without running it (BUSY, LOADING), while no other error came after
	// it; nil once Redis confirmed it.
	notRun error
}

// setNotRun records the latest reply that says the SUBSCRIBE did not run
// (nil: another outcome came after it).
func (s *subscription) setNotRun(err error) {
	s.mu.Lock()
	s.notRun = err
	s.mu.Unlock()
}

// notRunReply returns the reply with which Redis last refused the SUBSCRIBE
// unrun, or nil.
func (s *subscription) notRunReply() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.notRun
}

// join registers a waiter and returns its channel and the subscription: until
// its ready is closed a grant published to this acquirer may find no receiver,
// and the script would skip the waiter.
func (g *grants) join(nonce string) (*waiter, *subscription) {
	w := &waiter{grant: make(chan grantMsg, 1), next: make(chan struct{}, 1)}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.waiters[nonce] = w
	if g.idle != nil {
		g.idle.Stop()
		g.idle = nil
	}
	if g.stop == nil {
		ctx, cancel := context.WithCancel(context.Background())
		g.stop, g.sub = cancel, &subscription{ready: make(chan struct{})}
		go g.run(ctx, g.sub)
	}
	return w, g.sub
}

// leave unregisters a waiter; a grant for it from then on is dropped (the
// waiter's leave script releases it).
func (g *grants) leave(nonce string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.waiters, nonce)
	if len(g.waiters) == 0 && g.stop != nil && g.idle == nil {
		g.idle = time.AfterFunc(grantsLinger, func() {
			g.mu.Lock()
			defer g.mu.Unlock()
			if len(g.waiters) == 0 && g.stop != nil {
				g.stop()
				g.stop, g.sub, g.idle = nil, nil, nil
			}
		})
	}
}

// depart registers a waiter that left whose leave Redis has not answered:
// a grant to it signals the returned channel, until done is called.
func (g *grants) depart(nonce string) (kick <-chan struct{}, done func()) {
	k := make(chan struct{}, 1)
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.departed == nil {
		g.departed = map[string]chan struct{}{}
	}
	g.departed[nonce] = k
	return k, func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		if g.departed[nonce] == k {
			delete(g.departed, nonce)
		}
	}
}

// deliver hands a grant to the waiter with nonce; false when it has left
// (then a leave of it still sent in the background goes at once).
func (g *grants) deliver(nonce string, m grantMsg) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	w, ok := g.waiters[nonce]
	if !ok {
		if k, ok := g.departed[nonce]; ok {
			select {
			case k <- struct{}{}:
			default:
			}
		}
		return false
	}
	select {
	case w.grant <- m:
	default: // it has one already; the newer grant replaces nothing
	}
	return true
}

func (g *grants) run(ctx context.Context, sub *subscription) {
	var once sync.Once
	receive(ctx, g.c, g.channel,
		func() {
			sub.setNotRun(nil)
			once.Do(func() { close(sub.ready) })
		},
		g.message,
		// A grant published while the subscription was down found no
		// receiver and skipped its waiter, which finds itself out of line at
		// its next poll and queues again.
		func() { sub.setNotRun(nil) },
		func(err error) {
			once.Do(func() {
				sub.err = fmt.Errorf("redislua: subscribing to grant channel %s: %w", g.channel, err)
				close(sub.ready)
			})
			// The next waiter to join asks again (permissions may change).
			g.mu.Lock()
			defer g.mu.Unlock()
			if g.sub == sub {
				g.stop()
				g.stop, g.sub = nil, nil
				if g.idle != nil {
					g.idle.Stop()
					g.idle = nil
				}
			}
		},
		sub.setNotRun)
}

// message passes a published grant ("nonce token stamp name") to its waiter,
// and a notice that a waiter is next in line ("next nonce") to that waiter.
func (g *grants) message(payload string) {
	f := strings.SplitN(payload, " ", 4)
	if len(f) == 2 && f[0] == "next" {
		g.mu.Lock()
		if w, ok := g.waiters[f[1]]; ok {
			select {
			case w.next <- struct{}{}:
			default:
			}
		}
		g.mu.Unlock()
		return
	}
	if len(f) < 3 {
		return
	}
	tok, err := strconv.ParseUint(f[1], 10, 64)
	if err != nil {
		return
	}
	g.deliver(f[0], grantMsg{token: tok, sent: g.sentAt(f[2])})
}
