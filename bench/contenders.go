package bench

import (
	"context"
	"errors"
	"math"
	"time"

	"github.com/bsm/redislock"
	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/internal/sweep"
	"github.com/go-redsync/redsync/v4"
	goredis "github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/redis/go-redis/v9"
)

// Contenders are the lock libraries compared, by name, each taking a lease of
// 10s: fencekit's Redis acquirer with its defaults, bsm/redislock with a 1ms
// retry and with its README's 100ms linear retry (it does not retry by
// default), and go-redsync with a 1ms retry and with its default 50-250ms
// retry (tries raised so that no contender gives up).
var Contenders = sweep.Contenders{
	"fencekit":           sweep.Fencekit(nil),
	"fencekit-spin1ms":   sweep.Fencekit(&redislua.AcquirerOptions{HeadSpin: time.Millisecond}),
	"fencekit-spin250us": sweep.Fencekit(&redislua.AcquirerOptions{HeadSpin: 250 * time.Microsecond}),
	"redislock-1ms":      redislockLocker(redislock.LinearBackoff(time.Millisecond)),
	"redislock-100ms":    redislockLocker(redislock.LinearBackoff(100 * time.Millisecond)),
	"redsync-1ms":        redsyncLocker(redsync.WithTries(math.MaxInt32), redsync.WithRetryDelay(time.Millisecond)),
	"redsync-default":    redsyncLocker(redsync.WithTries(math.MaxInt32)),
}

func redislockLocker(retry redislock.RetryStrategy) func(*redis.Client) (sweep.Locker, error) {
	return func(c *redis.Client) (sweep.Locker, error) {
		lc := redislock.New(c)
		return func(ctx context.Context, name string) (func(context.Context) error, error) {
			l, err := lc.Obtain(ctx, name, 10*time.Second, &redislock.Options{RetryStrategy: retry})
			if err != nil {
				return nil, err
			}
			return l.Release, nil
		}, nil
	}
}

func redsyncLocker(opts ...redsync.Option) func(*redis.Client) (sweep.Locker, error) {
	return func(c *redis.Client) (sweep.Locker, error) {
		rs := redsync.New(goredis.NewPool(c))
		return func(ctx context.Context, name string) (func(context.Context) error, error) {
			m := rs.NewMutex(name, append([]redsync.Option{redsync.WithExpiry(10 * time.Second)}, opts...)...)
			if err := m.LockContext(ctx); err != nil {
				return nil, err
			}
			return func(ctx context.Context) error {
				ok, err := m.UnlockContext(ctx)
				if err == nil && !ok {
					err = errors.New("redsync: unlock found the lock gone")
				}
				return err
			}, nil
		}, nil
	}
}

// Names are the Contenders in the order the sweep lists them by default.
var Names = []string{"fencekit", "redislock-1ms", "redislock-100ms", "redsync-1ms", "redsync-default"}
