package redislua

import (
	"context"
	"sync"
)

// listener keeps one pub/sub subscription to the release channel while at least
// one Acquire waits, and wakes the waiters of the released name. A missed
// message costs a waiter only its next backoff interval.
type listener struct {
	c       Client
	channel string

	mu      sync.Mutex
	waiters map[string]map[chan struct{}]struct{}
	cancel  context.CancelFunc
}

func newListener(c Client, channel string) *listener {
	return &listener{c: c, channel: channel, waiters: map[string]map[chan struct{}]struct{}{}}
}

func (l *listener) subscribe(name string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	l.mu.Lock()
	if l.waiters[name] == nil {
		l.waiters[name] = map[chan struct{}]struct{}{}
	}
	l.waiters[name][ch] = struct{}{}
	if l.cancel == nil {
		ctx, cancel := context.WithCancel(context.Background())
		l.cancel = cancel
		go l.run(ctx)
	}
	l.mu.Unlock()
	return ch, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		delete(l.waiters[name], ch)
		if len(l.waiters[name]) == 0 {
			delete(l.waiters, name)
		}
		if len(l.waiters) == 0 && l.cancel != nil {
			l.cancel()
			l.cancel = nil
		}
	}
}

func (l *listener) run(ctx context.Context) {
	ps := l.c.Subscribe(ctx, l.channel)
	defer ps.Close()
	// go-redis reconnects a broken subscription by itself; a message sent while
	// it was down is missed, and the waiters' backoff covers that.
	msgs := ps.Channel()
	for {
		select {
		case <-ctx.Done():
			return
		case m, ok := <-msgs:
			if !ok {
				return
			}
			l.wake(m.Payload)
		}
	}
}

func (l *listener) wake(name string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for ch := range l.waiters[name] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}
