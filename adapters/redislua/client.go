package redislua

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// Client is the part of a go-redis client this package uses. Every
// redis.UniversalClient (*redis.Client, *redis.ClusterClient, a failover
// client) has it; a test can wrap one to inject faults.
type Client interface {
	redis.Scripter
	Do(ctx context.Context, args ...any) *redis.Cmd
	Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

var _ Client = redis.UniversalClient(nil)
