package redislua

import (
	"context"
	"fmt"
	"math"
	"reflect"
	"strings"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/redis/go-redis/v9"
)

// DefaultPrefix starts every key this package writes, unless options say otherwise.
const DefaultPrefix = "fence:"

// checkPrefix refuses a prefix with braces: the hash tag that follows must be the
// first one in the key.
func checkPrefix(op, prefix string) error {
	if strings.ContainsAny(prefix, "{}") {
		return &fence.InvalidError{Op: op, Arg: "prefix", Reason: "contains { or }, which would move the hash tag"}
	}
	return nil
}

// MaxTTL is the longest lease this package grants: the largest time.Duration.
// The ttl is rounded up to whole milliseconds for PX, and Redis accepts any
// such ttl added to its clock.
const MaxTTL = time.Duration(math.MaxInt64)

// checkTagged refuses a nil ctx, and a name or key that cannot sit inside a
// hash tag. Names and keys are stored as bytes: any other byte, NUL and
// invalid UTF-8 included, is kept as it is.
func checkTagged(ctx context.Context, op, arg, s string) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if s == "" {
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "empty"}
	}
	if strings.ContainsAny(s, "{}") {
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "contains { or }, which Redis Cluster reads as a hash tag"}
	}
	return nil
}

// lockKeys returns the lock key and the token counter key of name, which share
// the hash tag {name} and so one Cluster slot.
func lockKeys(prefix, name string) (lock, counter string) {
	base := prefix + "{" + name + "}"
	return base + ":lock", base + ":token"
}

// checkNotRing refuses a redis.Ring: it routes a pub/sub channel and a key
// by different hashes, so a grant or a notification published by a script on
// the key's shard never reaches a subscriber on the channel's shard.
func checkNotRing(op string, c any) error {
	if _, ok := c.(*redis.Ring); ok {
		return &fence.InvalidError{Op: op, Arg: "client", Reason: "a *redis.Ring sends pub/sub and keys to different shards; use a Client, a ClusterClient or a failover client"}
	}
	return nil
}

// checkClient refuses a nil client, also a nil pointer in the interface.
func checkClient(op string, c any) error {
	if c == nil {
		return &fence.InvalidError{Op: op, Arg: "client", Reason: "nil"}
	}
	if v := reflect.ValueOf(c); v.Kind() == reflect.Pointer && v.IsNil() {
		return &fence.InvalidError{Op: op, Arg: "client", Reason: fmt.Sprintf("nil %T", c)}
	}
	return nil
}
