package redislua

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// Client is the part of a go-redis client this package uses. Every
// redis.UniversalClient (*redis.Client, *redis.ClusterClient, a failover
// client) has it; a test can wrap one to inject faults.
//
// Every call of this package returns once its context ends, also with a
// client that does not honour context deadlines (ContextTimeoutEnabled off,
// go-redis's default, waits its ReadTimeout and sends again): a request then
// still on its way may land later, so a step that writes returns an error
// matching fence.ErrUnknown, and a read the context's error (an
// IdempotencyStore's Get, like its other steps, also fence.ErrUnknown).
type Client interface {
	redis.Scripter
	Do(ctx context.Context, args ...any) *redis.Cmd
	Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

var _ Client = redis.UniversalClient(nil)
