// Package rediscount counts the commands a go-redis client sends, for benchmarks
// that report commands per operation.
package rediscount

import (
	"context"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// Count counts the commands a Redis client sends: each command of a
// pipeline, and a script as one (EVALSHA or EVAL). A nil count counts nothing.
type Count struct{ n atomic.Int64 }

// Attach adds a Count to c, counting from now.
func Attach(c *redis.Client) *Count {
	cc := &Count{}
	c.AddHook(cc)
	return cc
}

// Reset sets the count to zero.
func (cc *Count) Reset() {
	if cc != nil {
		cc.n.Store(0)
	}
}

// Load returns the commands counted since Attach or the last Reset.
func (cc *Count) Load() int64 {
	if cc == nil {
		return 0
	}
	return cc.n.Load()
}

// DialHook, ProcessHook and ProcessPipelineHook make Count a redis.Hook.
func (cc *Count) DialHook(next redis.DialHook) redis.DialHook { return next }

func (cc *Count) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		cc.n.Add(1)
		return next(ctx, cmd)
	}
}

func (cc *Count) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		cc.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}
