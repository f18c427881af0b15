package main

import (
	"context"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// commandCount counts the commands a Redis client sends: each command of a
// pipeline, and a script as one (EVALSHA or EVAL). A nil count counts nothing.
type commandCount struct{ n atomic.Int64 }

func countCommands(c *redis.Client) *commandCount {
	cc := &commandCount{}
	c.AddHook(cc)
	return cc
}

func (cc *commandCount) reset() {
	if cc != nil {
		cc.n.Store(0)
	}
}

func (cc *commandCount) load() int64 {
	if cc == nil {
		return 0
	}
	return cc.n.Load()
}

func (cc *commandCount) DialHook(next redis.DialHook) redis.DialHook { return next }

func (cc *commandCount) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		cc.n.Add(1)
		return next(ctx, cmd)
	}
}

func (cc *commandCount) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		cc.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}
