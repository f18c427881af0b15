package redislua_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// TestMain runs this test binary as a waiter in another process when the
// cross-process tests and benchmarks start it with FENCEKIT_CHILD set, and as
// the test binary otherwise.
func TestMain(m *testing.M) {
	kind := os.Getenv("FENCEKIT_CHILD")
	if kind == "" {
		// go-redis logs each broken connection of the fault, failover and
		// node-loss tests; its logger is one per process, so it is set here,
		// before any test (several run in parallel).
		redis.SetLogger(quietLogger{})
		os.Exit(m.Run())
	}
	if err := runChild(kind, os.Getenv("FENCEKIT_CHILD_NAME")); err != nil {
		fmt.Fprintf(os.Stderr, "child %s: %v\n", kind, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// runChild is a waiter in its own process, on the lock FENCEKIT_CHILD_NAME:
//   - "queue": print "acquirer <id>", Acquire it (ttl 30s), print "granted <token>", hold it for
//     FENCEKIT_QUEUE_HOLD, release it, print "released";
//   - "handoff": for each line on stdin, Acquire it, print "granted <unix ns>",
//     release it.
func runChild(kind, name string) error {
	c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	defer c.Close()
	a, err := redislua.NewAcquirer(c, nil)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	switch kind {
	case "queue":
		fmt.Printf("acquirer %s\n", redislua.AcquirerID(a))
		hold, _ := time.ParseDuration(os.Getenv("FENCEKIT_QUEUE_HOLD"))
		l, err := a.Acquire(ctx, name, 30*time.Second)
		if err != nil {
			return err
		}
		fmt.Printf("granted %d\n", l.Token())
		time.Sleep(hold)
		if err := l.Release(ctx); err != nil {
			return err
		}
		fmt.Println("released")
	case "handoff":
		for in := bufio.NewScanner(os.Stdin); in.Scan(); {
			l, err := a.Acquire(ctx, name, time.Minute)
			if err != nil {
				return err
			}
			fmt.Printf("granted %d\n", time.Now().UnixNano())
			if err := l.Release(ctx); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("unknown child kind %q", kind)
	}
	return nil
}
