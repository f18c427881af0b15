package redislua

import (
	"context"
	"time"

	"github.com/fencekit/fencekit/internal/wakeup"
	"github.com/redis/go-redis/v9"
)

// listener keeps one pub/sub subscription to the release channel while at least
// one Acquire waits, and passes each release to one waiter of that name. A
// missed message costs a waiter only its next backoff interval.
type listener struct {
	wakeup.Hub
	c       Client
	channel string
}

func newListener(c Client, channel string) *listener {
	l := &listener{c: c, channel: channel}
	l.Listen = l.run
	return l
}

func (l *listener) run(ctx context.Context) {
	ps := l.c.Subscribe(ctx, l.channel)
	defer ps.Close()
	// go-redis reconnects a broken subscription by itself; a message sent while
	// it was down is missed, and the waiters' backoff covers that. Receiving
	// here rather than through ps.Channel() saves a goroutine hop per release.
	for ctx.Err() == nil {
		msg, err := ps.Receive(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			l.WakeAll() // a broken connection may have lost messages
			select {
			case <-ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		switch m := msg.(type) {
		case *redis.Message:
			l.WakeOne(m.Payload)
		case *redis.Subscription:
			l.WakeAll() // (re)subscribed: a release may have happened before
		}
	}
}
