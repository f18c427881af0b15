package redislua_test

import (
	"context"
	"log"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/redis/go-redis/v9"
)

// A lock on Redis whose tokens keep growing across a failover (TokenFloor),
// protecting a value in Redis through the fenced Lua writer. It needs a Redis
// server, so it is compiled but not run.
func ExampleNewAcquirer() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	locks, err := redislua.NewAcquirer(rdb, &redislua.AcquirerOptions{TokenFloor: true})
	if err != nil {
		log.Fatal(err)
	}
	values, err := redislua.NewWriter(rdb, nil)
	if err != nil {
		log.Fatal(err)
	}
	err = fence.Hold(ctx, locks, "report", 10*time.Second, func(ctx context.Context, l fence.Lease) error {
		return values.Write(ctx, "report:today", []byte("42 rows"), l.Token())
	})
	if err != nil {
		log.Fatal(err)
	}
}

// A fenced script of your own: the body runs only when the token passes the
// fence key, in the same script. It needs a Redis server, so it is compiled
// but not run.
func ExampleNewFencedScript() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	// The body sees its own KEYS and ARGV.
	incr := redislua.NewFencedScript(`return redis.call('INCRBY', KEYS[1], ARGV[1])`)
	if _, err := incr.Run(ctx, rdb, "{counter}:fence", 7, []string{"{counter}"}, 5); err != nil {
		log.Fatal(err) // errors.Is(err, fence.ErrStale) for a token below the fence
	}
}
