// Package wakeup hands release notifications to the Acquire calls waiting for a
// lock name, one waiter per notification, in the order they began to wait.
package wakeup

import (
	"context"
	"sync"
)

// Hub tracks the waiters of each name. Listen runs in its own goroutine from the
// moment the first waiter arrives until its context is cancelled when the last
// one leaves, so that a backend listens only while someone waits; it calls
// WakeOne (or WakeAll) as notifications arrive. It is safe for concurrent use.
type Hub struct {
	Listen func(ctx context.Context)

	mu      sync.Mutex
	waiters map[string][]chan struct{}
	count   int
	cancel  context.CancelFunc
}

// Subscribe registers a waiter for name and returns its wake-up channel and the
// function that ends the wait.
func (h *Hub) Subscribe(name string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	return ch, h.SubscribeChan(name, ch)
}

// SubscribeChan registers ch, a channel with a buffer of one that the waiter
// also uses for other wake-ups, as a waiter for name, and returns the function
// that ends the wait.
func (h *Hub) SubscribeChan(name string, ch chan struct{}) func() {
	h.mu.Lock()
	if h.waiters == nil {
		h.waiters = map[string][]chan struct{}{}
	}
	h.waiters[name] = append(h.waiters[name], ch)
	h.count++
	if h.count == 1 && h.Listen != nil {
		ctx, cancel := context.WithCancel(context.Background())
		h.cancel = cancel
		go h.Listen(ctx)
	}
	h.mu.Unlock()
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		list := h.waiters[name]
		for i, c := range list {
			if c == ch {
				list = append(list[:i:i], list[i+1:]...)
				break
			}
		}
		if len(list) == 0 {
			delete(h.waiters, name)
		} else {
			h.waiters[name] = list
		}
		// A wake-up this waiter had not taken goes to the next one.
		select {
		case <-ch:
			h.wakeOneLocked(name)
		default:
		}
		h.count--
		if h.count == 0 && h.cancel != nil {
			h.cancel()
			h.cancel = nil
		}
	}
}

// WakeOne wakes the longest-waiting waiter of name that is not already awake.
// Waking one instead of all keeps the waiters from stampeding the backend on
// every release; the others still poll with their backoff.
func (h *Hub) WakeOne(name string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.wakeOneLocked(name)
}

func (h *Hub) wakeOneLocked(name string) {
	for _, ch := range h.waiters[name] {
		select {
		case ch <- struct{}{}:
			return
		default: // already awake: it will try anyway
		}
	}
}

// WakeAll wakes every waiter of every name (after a reconnect, when
// notifications may have been missed).
func (h *Hub) WakeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, list := range h.waiters {
		for _, ch := range list {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
}
