// Package handoff keeps the line of Acquire calls of one process waiting for a
// lock name, so that a Release in the same process can hand the lease straight
// to the longest-waiting of them (in one backend step that moves the grant from
// the releasing holder to the waiter), instead of freeing the lock and letting
// the waiter find out and ask for it.
package handoff

import (
	"context"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// MaxStreak bounds consecutive hand-overs within one process for one name; the
// next Release frees the lock for everyone, so waiters in other processes are
// not starved.
const MaxStreak = 8

// Waiter is one Acquire call in line.
type Waiter struct {
	// Wake wakes the waiter's loop: a hand-over, or a release elsewhere.
	Wake chan struct{}
	// TTL is the lease length the waiter asked for.
	TTL time.Duration

	claimed bool          // a Release is handing the lease over to it
	done    chan struct{} // closed when that hand-over has finished
	lease   fence.Lease   // what the hand-over gave it, until it takes it
}

// Line is the waiting line of every name. Its zero value is ready to use.
type Line struct {
	mu      sync.Mutex
	waiting map[string][]*Waiter
	streak  map[string]int
}

// Join puts a new waiter for name at the end of the line.
func (l *Line) Join(name string, ttl time.Duration) *Waiter {
	w := &Waiter{Wake: make(chan struct{}, 1), TTL: ttl}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.waiting == nil {
		l.waiting, l.streak = map[string][]*Waiter{}, map[string]int{}
	}
	l.waiting[name] = append(l.waiting[name], w)
	return w
}

// Take returns the lease a Release handed to w, if any.
func (l *Line) Take(w *Waiter) fence.Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	le := w.lease
	w.lease = nil
	return le
}

// Leave takes w out of the line. A hand-over to w still under way is waited
// for, and a lease handed over that w did not take is released.
func (l *Line) Leave(name string, w *Waiter) {
	l.mu.Lock()
	list := l.waiting[name]
	for i, x := range list {
		if x == w {
			list = append(list[:i:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(l.waiting, name)
		delete(l.streak, name)
	} else {
		l.waiting[name] = list
	}
	claimed, done := w.claimed, w.done
	l.mu.Unlock()
	if claimed {
		<-done
	}
	if le := l.Take(w); le != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = le.Release(ctx)
		cancel()
	}
}

// Next claims the first waiter of name that has not been handed a lease, unless
// the hand-over streak is used up (then it returns nil and starts a new streak).
func (l *Line) Next(name string) *Waiter {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.streak[name] >= MaxStreak {
		l.streak[name] = 0
		return nil
	}
	for _, w := range l.waiting[name] {
		if !w.claimed && w.lease == nil {
			w.claimed, w.done = true, make(chan struct{})
			l.streak[name]++
			return w
		}
	}
	return nil
}

// Finish records the outcome of a hand-over to w (nil when it failed) and wakes it.
func (l *Line) Finish(w *Waiter, le fence.Lease) {
	l.mu.Lock()
	w.lease = le
	w.claimed = false
	close(w.done)
	l.mu.Unlock()
	select {
	case w.Wake <- struct{}{}:
	default:
	}
}
