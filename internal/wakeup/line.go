package wakeup

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// Line orders the waiting Acquire calls of one acquirer, per lock name, in the
// order they joined. Only the head asks the backend for the lock at its own
// pace; a release made through the same acquirer pokes the head, so it tries
// at once, and a caller that returns from its own release and asks again joins
// at the back instead of taking the lock before the waiters. The others ask
// only when the head has been inside one attempt for longer than the line's
// stall limit (a call stuck on a dead connection), so one slow call does not
// keep a free lock from them. It is safe for concurrent use; the zero value is
// an empty line whose stall limit is Stall.
type Line struct {
	// StallLimit, when not zero, replaces Stall (a millisecond at least) as the time the head may
	// spend in one attempt before the waiters behind it try too. Set it
	// before the line is used. Tests of the line's order raise it, so that
	// one slow statement on a loaded machine does not let a waiter try out
	// of turn, which the line allows by design.
	StallLimit time.Duration

	mu    sync.Mutex
	names map[string][]*Place
}

// Place is one waiter's place in a Line.
type Place struct {
	// Wake receives when the lock may have just become free: a release through
	// the acquirer while this place is the head, or the head before it leaving
	// without a grant. Its buffer of one lets it be subscribed to a Hub too.
	Wake chan struct{}

	head      chan struct{} // closed when this place becomes the head
	req       any           // the waiter's request, for a handoff (AcquireHanded); nil: never offered
	abandon   func(Handoff) // settles a handoff the waiter will not take (AcquireHanded's)
	handed    chan Handoff  // the outcome of an offer (buffer of one: one offer at a time)
	mu        sync.Mutex
	tryingFor time.Time // when the head's current attempt or the offer to it began; zero between them
	trying    bool      // the waiter is inside an attempt
	attempts  int       // the attempts the waiter began
	offered   bool      // a handoff to this place is in flight (Offer, until Hand)
	gone      bool      // the waiter left while an offer was in flight
}

// Handoff is the outcome of an offer made to the head of a line (Offer,
// Hand): Lease when the releaser granted the lock to the waiter, nil when
// the waiter is to try on its own, with Hint (the acquirer's own) for that
// attempt.
type Handoff struct {
	Lease fence.Lease
	Hint  any
}

// Offer reserves the head of name's line for a handoff: the releaser of the
// lock grants it straight to that waiter, then calls Hand with the outcome.
// It returns the head's place and its request, or nil when the line is
// empty, its head has no request (it did not join through AcquireHanded) or
// is already offered, or is stuck in an attempt of its own for longer than
// the stall limit. A head inside a younger attempt is offered too:
// that attempt finds the lock held (the releaser holds it until its
// statement grants it to the head), and the head then waits for the offer's
// outcome. Until Hand, the head makes no new attempt of its own, and the
// time counts as an attempt for the waiters behind it (they try after the
// stall limit, so a releaser stuck on a dead connection does not hold them
// up for ever).
func (l *Line) Offer(name string) (*Place, any) { return l.offer(name, false) }

// OfferIdle is Offer for an offerer that does not hold the lock, whose grant
// could succeed beside an attempt of the head's own (a waiter of another
// kind that was woken for the head): it offers only a head that is between
// attempts, which then makes none until Hand or Withdraw, so that the head
// is never granted twice. It returns nil for a head inside an attempt, and
// for one whose attempt was granted (it is leaving the line).
func (l *Line) OfferIdle(name string) (*Place, any) { return l.offer(name, true) }

func (l *Line) offer(name string, idle bool) (*Place, any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	list := l.names[name]
	if len(list) == 0 || list[0].req == nil {
		return nil, nil
	}
	p := list[0]
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.offered || p.gone || len(p.handed) > 0 || p.trying && (idle || time.Since(p.tryingFor) > l.stall()) {
		// (An outcome of an earlier offer not yet taken: one at a time.)
		// A head stuck in its attempt is passed over, as the waiters
		// behind it pass it over: a handoff would wait for that attempt.
		return nil, nil
	}
	p.offered = true
	if !p.trying {
		p.tryingFor = time.Now()
	}
	return p, p.req
}

// Hand ends the offer made to p: h.Lease is the lease granted to its waiter,
// or nil when the releaser made no grant (the waiter then tries at once, with
// h.Hint). It reports false when the waiter left while the offer was in
// flight (it gave up, or its own attempt ended the wait): the caller then
// gives the lease back, or settles what the Hint says may have been granted.
func (l *Line) Hand(p *Place, h Handoff) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.offered = false
	if !p.trying {
		p.tryingFor = time.Time{}
	}
	if p.gone {
		return false
	}
	select {
	case p.handed <- h: // one offer at a time, each outcome taken before the next offer (Offer checks)
	default:
		return false // not reached; were it, the caller settles h rather than block
	}
	if p.trying && (h.Lease != nil || h.Hint != nil) && p.abandon != nil {
		// The waiter is inside an attempt of its own and takes the handoff
		// when that ends. An attempt stuck longer than the stall limit (a
		// dead connection) must not keep the lock from the waiters behind
		// it: the handoff is then taken back and settled.
		time.AfterFunc(l.stall(), func() {
			select {
			case h := <-p.handed:
				p.abandon(h)
			default: // taken
			}
		})
	}
	return true
}

// Withdraw ends the offer made to p with no outcome: the offerer sent
// nothing that could grant, and the waiter goes on as before the offer, at
// its own pace (no attempt at once, unlike Hand with an empty Handoff).
func (l *Line) Withdraw(p *Place) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.offered = false
	if !p.trying {
		p.tryingFor = time.Time{}
	}
}

// beginTry marks the start of one attempt by p's waiter; false when an offer
// to it is in flight (the waiter then waits for its outcome instead).
func (p *Place) beginTry() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.offered {
		return false
	}
	p.trying, p.tryingFor = true, time.Now()
	p.attempts++
	return true
}

// HeadWaiting reports whether the head of name's line has made an attempt
// and is now waiting between attempts, with no offer to it in flight: a
// release through the acquirer now would find it ready for a handoff.
func (l *Line) HeadWaiting(name string) bool {
	l.mu.Lock()
	list := l.names[name]
	l.mu.Unlock()
	if len(list) == 0 {
		return false
	}
	h := list[0]
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.attempts > 0 && !h.trying && !h.offered
}

// leaving marks p's waiter as gone, so that the releaser of an offer in
// flight gives back what it granted; it returns a handoff already made to
// it and not yet received (ok), which the caller settles.
func (p *Place) leaving() (h Handoff, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.gone = true
	if p.offered {
		return Handoff{}, false
	}
	select {
	case h := <-p.handed:
		return h, true
	default:
		return Handoff{}, false
	}
}

// Join adds a waiter for name at the back of the line and returns its place.
// A place that joins an empty line is the head at once.
func (l *Line) Join(name string) *Place {
	return l.join(name, nil, nil)
}

func (l *Line) join(name string, req any, abandon func(Handoff)) *Place {
	p := &Place{Wake: make(chan struct{}, 1), head: make(chan struct{}), req: req, abandon: abandon, handed: make(chan Handoff, 1)}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.names == nil {
		l.names = map[string][]*Place{}
	}
	if len(l.names[name]) == 0 {
		close(p.head)
	}
	l.names[name] = append(l.names[name], p)
	return p
}

// ErrYield, matched by an attempt's error that also matches fence.ErrHeld,
// says the attempt made a grant it had to give back (it came back past its
// local deadline): the waiter lets the others of its line go first and waits
// its full backoff delay before it tries again, unwoken by the release of its
// own give-back, so that a head whose grants keep coming back late neither
// spins nor keeps a free lock from the waiters behind it.
var ErrYield = errors.New("wakeup: let the others go first")

// yield moves p, when it is the head and others wait, to the back of name's
// line and makes the next place the head; it reports whether p is
// still the head (it was alone). Only p's own waiting loop may call it.
func (l *Line) yield(name string, p *Place) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	list := l.names[name]
	if len(list) < 2 || list[0] != p {
		return len(list) > 0 && list[0] == p
	}
	list = append(list[1:], p)
	l.names[name] = list
	p.head = make(chan struct{})
	// The new head tries after its first delay: not woken at once, so that
	// waiters whose grants all come back late take turns at the backoff's
	// pace instead of spinning.
	close(list[0].head)
	return false
}

// Head is closed once p is the head of its line.
func (p *Place) Head() <-chan struct{} { return p.head }

// IsHead reports whether p is the head of its line.
func (p *Place) IsHead() bool {
	select {
	case <-p.head:
		return true
	default:
		return false
	}
}

// Trying marks the start (true) or end (false) of one attempt by the head.
func (p *Place) Trying(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.trying = on
	if on {
		p.tryingFor = time.Now()
	} else if !p.offered {
		p.tryingFor = time.Time{}
	}
}

// Leave removes p from name's line. When p was the head the next place becomes
// the head; unless p leaves with a grant (the lock is then held) the new head
// is also woken, since the lock may be free.
func (l *Line) Leave(name string, p *Place, granted bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	list := l.names[name]
	for i, q := range list {
		if q != p {
			continue
		}
		list = append(list[:i:i], list[i+1:]...)
		p.mu.Lock()
		p.gone = true // an offer in flight is settled by its releaser (Hand reports false)
		p.mu.Unlock()
		if i == 0 && len(list) > 0 {
			close(list[0].head)
			if !granted {
				poke(list[0])
			}
		}
		break
	}
	if len(list) == 0 {
		delete(l.names, name)
	} else {
		l.names[name] = list
	}
}

// Poke wakes the head of name's line, if any: the lock may have just been
// released.
func (l *Line) Poke(name string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if list := l.names[name]; len(list) > 0 {
		poke(list[0])
	}
}

func poke(p *Place) {
	select {
	case p.Wake <- struct{}{}:
	default: // already woken
	}
}

// Len returns the number of waiters in name's line.
func (l *Line) Len(name string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.names[name])
}

// HeadStalled reports whether the head of name's line has been inside one
// attempt for longer than limit.
func (l *Line) HeadStalled(name string, limit time.Duration) bool {
	l.mu.Lock()
	list := l.names[name]
	var h *Place
	if len(list) > 0 {
		h = list[0]
	}
	l.mu.Unlock()
	if h == nil {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return !h.tryingFor.IsZero() && time.Since(h.tryingFor) > limit
}

// Stall is how long the head of a Line may spend in one attempt before the
// waiters behind it try too.
const Stall = time.Second

func (l *Line) stall() time.Duration {
	if l.StallLimit > 0 {
		return max(l.StallLimit, time.Millisecond)
	}
	return Stall
}

// Acquire is the waiting loop of an acquirer whose Acquire calls wait in l.
// It joins name's line and calls try (with ctx bounded by b.MaxWait when it
// has no deadline) until try returns a lease or an error that does not match
// fence.ErrHeld: at once when the line was empty, then as the head, paced by
// b.Delay or woken by a Poke; behind the head, only when the head has spent
// more than its stall limit (Stall by default) in one attempt. listen, when not nil, subscribes the head's
// wake-up channel to the backend's release notifications and returns the
// function that ends the subscription. When ctx ends while waiting it
// returns an error matching fence.ErrHeld and ctx's cause; try decides what
// an attempt that fails as ctx ends returns.
func (l *Line) Acquire(ctx context.Context, b fence.Backoff, name string, listen func(wake chan struct{}) func(), try func(context.Context) (fence.Lease, error)) (fence.Lease, error) {
	return l.AcquireHanded(ctx, b, name, nil, listen, func(ctx context.Context, _ any) (fence.Lease, error) { return try(ctx) }, nil)
}

// AcquireHanded is Acquire for an acquirer whose releases can grant the lock
// straight to the head of the line (Offer, Hand): req, when not nil, is the
// waiter's request the releaser reads, and try gets the Hint of a handoff
// that made no grant (nil otherwise). A handed lease is returned as try's
// would be. A waiter whose ctx ends while an offer to it is in flight
// returns at once; the releaser gives back what it grants (Hand reports
// false). A handoff made just as ctx ended, not yet received, goes to
// abandon (when not nil) before AcquireHanded returns: the acquirer gives
// back its lease, or settles what its Hint says may have been granted.
func (l *Line) AcquireHanded(ctx context.Context, b fence.Backoff, name string, req any, listen func(wake chan struct{}) func(), try func(context.Context, any) (fence.Lease, error), abandon func(Handoff)) (fence.Lease, error) {
	b = b.WithDefaults()
	ctx, cancel := leasekit.WithMaxWait(ctx, b)
	defer cancel()
	p := l.join(name, req, abandon)
	granted := false
	defer func() { l.Leave(name, p, granted) }()
	var hint any // the hint of the last handoff that made no grant, for the next attempt
	errOffered := errors.New("offered")
	attempt := func() (fence.Lease, error) {
		if !p.beginTry() {
			return nil, errOffered
		}
		defer p.Trying(false)
		h := hint
		hint = nil
		lease, err := try(ctx, h)
		granted = err == nil
		if granted {
			// Leaving with the lock: no offer from here on (OfferIdle
			// checks gone), before the attempt ends (Trying(false)).
			p.mu.Lock()
			p.gone = true
			p.mu.Unlock()
		}
		return lease, err
	}
	gaveUp := func() (fence.Lease, error) {
		if h, ok := p.leaving(); ok && abandon != nil {
			// Handed as ctx ended: settled, so nobody waits out a ttl.
			abandon(h)
		}
		return nil, GaveUp(ctx)
	}
	// Only the head hears of releases from the backend: a hub wakes its
	// longest subscriber, which must not be a waiter behind the head.
	unsubscribe := func() {}
	defer func() { unsubscribe() }()
	subscribe := func() {
		if listen != nil {
			unsubscribe = listen(p.Wake)
		}
	}
	head := p.Head()
	paced := false // the next wait ignores wake-ups (the attempt yielded)
	// afterAttempt handles an attempt that ended in ErrHeld: a yielding
	// head moves to the back of the line (or stays the head, alone) and
	// waits its full delay.
	afterAttempt := func(err error) {
		if !errors.Is(err, ErrYield) {
			return
		}
		paced = true
		if l.yield(name, p) {
			return
		}
		unsubscribe()
		unsubscribe = func() {}
		head = p.Head()
	}
	if p.IsHead() {
		lease, err := attempt()
		if err != errOffered && !errors.Is(err, fence.ErrHeld) {
			return lease, err
		}
		head = nil
		afterAttempt(err)
	}
	if head == nil {
		subscribe()
	}
	stall := l.stall()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for n := 0; ; {
		var d time.Duration
		if head == nil {
			d = b.Delay(n)
			n++
		} else {
			// Behind the head: look again only to see whether it is stuck.
			d = stall/2 + rand.N(stall/2)
		}
		timer.Reset(d)
		wake := p.Wake
		if paced {
			// Not woken by its own give-back's release: the whole delay.
			wake, paced = nil, false
		}
		select {
		case <-ctx.Done():
			return gaveUp()
		case h := <-p.handed:
			timer.Stop()
			if ctx.Err() != nil {
				// Both were ready: the wait ended, and the handoff is
				// settled as one made just as it ended.
				p.leaving()
				if abandon != nil {
					abandon(h)
				}
				return nil, GaveUp(ctx)
			}
			if h.Lease != nil && h.Lease.Context().Err() != nil {
				// Taken late (after an attempt of the waiter's own):
				// already past its local deadline, or ended. Never
				// returned as held: settled, and the waiter tries now.
				// While it is settled nobody may offer this waiter the
				// lock: the release that gives the lease back would hand
				// it straight back to the waiter, again and again.
				if abandon != nil {
					p.mu.Lock()
					p.offered = true
					p.mu.Unlock()
					abandon(h)
					p.mu.Lock()
					p.offered = false
					p.mu.Unlock()
				}
				h = Handoff{}
			}
			if h.Lease != nil {
				granted = true
				return h.Lease, nil
			}
			hint = h.Hint
		case <-head:
			timer.Stop()
			head, n = nil, 0
			subscribe()
			continue // the lock was most likely just granted to the head before: wait a Delay(0), or a poke
		case <-wake:
			timer.Stop()
		case <-timer.C:
			if head != nil && !l.HeadStalled(name, stall) {
				continue
			}
		}
		lease, err := attempt()
		if err == errOffered {
			continue // the outcome of the offer comes through p.handed
		}
		if !errors.Is(err, fence.ErrHeld) {
			return lease, err
		}
		afterAttempt(err)
	}
}

// GaveUp is the error of a wait that ended with ctx: it matches
// fence.ErrHeld, ctx.Err() and, when the caller gave one, ctx's cause.
func GaveUp(ctx context.Context) error {
	if cause := context.Cause(ctx); cause != nil && cause != ctx.Err() {
		return errors.Join(fence.ErrHeld, ctx.Err(), cause)
	}
	return errors.Join(fence.ErrHeld, ctx.Err())
}
