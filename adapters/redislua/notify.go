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
	receive(ctx, l.c, l.channel,
		l.WakeAll, // (re)subscribed: a release may have happened before
		l.WakeOne,
		l.WakeAll, // a broken connection may have lost messages
		nil,       // refused: waiters still wake at their backoff
		nil)
}

// receive subscribes to channel and, until ctx ends, calls subscribed on each
// (re)subscription, message with each message's payload, and broken after a
// receive error. When Redis refuses the subscription (NOPERM: the user's ACL
// has no such channel) and refused is set, it calls refused and returns. go-redis reconnects a broken subscription by itself; a
// message sent while it was down is lost. A SUBSCRIBE that Redis did not run
// (BUSY while another client's script runs, LOADING) is sent again, paced,
// until it runs: go-redis keeps the connection, subscribed to nothing;
// notRunReply, when set, is called with each such reply.
// Receiving here rather than through ps.Channel() saves a goroutine hop per
// message.
func receive(ctx context.Context, c Client, channel string, subscribed func(), message func(payload string), broken func(), refused func(error), notRunReply func(error)) {
	ps := c.Subscribe(ctx, channel)
	defer ps.Close()
	notRuns := 0 // SUBSCRIBEs refused in a row without being run
	for ctx.Err() == nil {
		msg, err := ps.Receive(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if refused != nil && redis.HasErrorPrefix(err, "NOPERM") {
				refused(err)
				return
			}
			if notRun(err) {
				if notRunReply != nil {
					notRunReply(err)
				}
				// The only commands on this connection are SUBSCRIBEs.
				if notRunDelay.Sleep(ctx, notRuns) != nil {
					return
				}
				notRuns++
				_ = ps.Subscribe(ctx, channel) // a failed send shows at the next Receive
				continue
			}
			broken()
			select {
			case <-ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		switch m := msg.(type) {
		case *redis.Message:
			message(m.Payload)
		case *redis.Subscription:
			notRuns = 0
			subscribed()
		}
	}
}
