package redislua_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// replicated starts a primary and a replica of it, and waits until they are in sync.
func replicated(t *testing.T) (primary, replica *testenv.RedisServer) {
	primary = testenv.StartRedis(t, "--repl-diskless-sync-delay", "0")
	replica = testenv.StartRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	rc := replica.Client(t)
	deadline := time.Now().Add(10 * time.Second)
	for {
		info, _ := rc.Info(context.Background(), "replication").Result()
		if strings.Contains(info, "master_link_status:up") {
			// The replica is linked; wait until the primary counts its
			// acknowledgements too (WAIT sees it), or the first WAIT can miss it.
			waitReplicated(t, primary.Client(t))
			return primary, replica
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica did not sync:\n%s", info)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitReplicated waits until the replica has everything the primary wrote.
func waitReplicated(t *testing.T, pc *redis.Client) {
	if n, err := pc.Do(context.Background(), "WAIT", 1, 5000).Int(); err != nil || n != 1 {
		t.Fatalf("WAIT: %d, %v", n, err)
	}
}

// TestFailoverLosesCounter acknowledges a grant on a primary whose replica is
// paused, kills the primary, promotes the replica and grants again, with each
// durability option. It shows what the package documentation says: without an
// option (CounterTokens) the token is reused; WaitReplicas refuses the grant
// that could be lost; the default clock floor keeps tokens growing.
func TestFailoverLosesCounter(t *testing.T) {
	// "none" is CounterTokens (the clock floor off), "wait-replicas" adds
	// WaitReplicas to it, "token-floor" is the default.
	for _, mode := range []string{"none", "wait-replicas", "token-floor"} {
		t.Run(mode, func(t *testing.T) {
			ctx := context.Background()
			opts := redislua.AcquirerOptions{}
			switch mode {
			case "wait-replicas":
				// Generous: on a loaded machine (CI runs packages side by
				// side on 2 cores) a replica's acknowledgement took over 500ms.
				opts.WaitReplicas, opts.WaitTimeout = 1, 2*time.Second
			}
			opts.CounterTokens = mode != "token-floor"
			primary, replica := replicated(t)
			pc := redis.NewClient(&redis.Options{Addr: primary.Addr, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: 4 * time.Second})
			t.Cleanup(func() { pc.Close() })
			a := newAcquirerOn(t, pc, &opts)
			if mode == "wait-replicas" {
				long := opts
				long.WaitTimeout = 5 * time.Second // the test client reads with a 4s timeout
				if _, err := redislua.NewAcquirer(pc, &long); !errors.Is(err, fence.ErrInvalid) {
					t.Errorf("WaitTimeout above the client's ReadTimeout: %v, want ErrInvalid", err)
				}
			}
			handedOut := []fence.Token{}
			l1 := mustTryAcquire(ctx, t, a, "job", time.Minute)
			handedOut = append(handedOut, l1.Token())
			if err := l1.Release(ctx); err != nil {
				t.Fatal(err)
			}
			waitReplicated(t, pc)

			// The replica stops hearing from the primary (it is pointed at a dead
			// port: SIGSTOP would not do, since the kernel still buffers the
			// stream for it); the primary grants again.
			rc := replica.Client(t)
			if err := rc.Do(ctx, "REPLICAOF", "127.0.0.1", "1").Err(); err != nil {
				t.Fatal(err)
			}
			l2, err := a.TryAcquire(ctx, "job", time.Minute)
			switch mode {
			case "wait-replicas":
				if !errors.Is(err, redislua.ErrNotReplicated) {
					t.Fatalf("grant while the replica cannot acknowledge: %v, want ErrNotReplicated", err)
				}
			default:
				if err != nil {
					t.Fatal(err)
				}
				handedOut = append(handedOut, l2.Token())
			}
			primary.Kill()
			if err := rc.Do(ctx, "REPLICAOF", "NO", "ONE").Err(); err != nil {
				t.Fatal(err)
			}
			opts.WaitReplicas = 0 // the promoted node has no replica left
			a2, _ := redislua.NewAcquirer(rc, &opts)
			// The lost grant's lock key is gone too: the new primary grants at once.
			l3 := mustTryAcquire(ctx, t, a2, "job", time.Minute)
			maxOut := handedOut[len(handedOut)-1]
			t.Logf("%s: tokens handed out before the failover %v, after it %d", mode, handedOut, l3.Token())
			switch mode {
			case "none":
				if l3.Token() > maxOut {
					t.Errorf("without an option the counter was expected to go back: token %d after %v", l3.Token(), handedOut)
				}
			default:
				if l3.Token() <= maxOut {
					t.Errorf("token %d after the failover is not larger than %d, handed out before it", l3.Token(), maxOut)
				}
			}
		})
	}
}

// TestRestartWhileHeld restarts Redis (empty) while Hold runs: the watchdog's
// renewal finds the lease gone, the work is cancelled with ErrLost, and with
// the token floor the next grant's token is still larger.
func TestRestartWhileHeld(t *testing.T) {
	for _, floor := range []bool{true, false} {
		t.Run(fmt.Sprintf("floor=%v", floor), func(t *testing.T) {
			s := testenv.StartRedis(t)
			c := s.Client(t)
			a, _ := redislua.NewAcquirer(c, &redislua.AcquirerOptions{CounterTokens: !floor})
			ctx := context.Background()
			var (
				token fence.Token
				cause error
			)
			err := fence.Hold(ctx, a, "job", 600*time.Millisecond, func(ctx context.Context, l fence.Lease) error {
				token = l.Token()
				s.Restart(t)
				select {
				case <-ctx.Done():
					cause = context.Cause(ctx)
					return nil
				case <-time.After(5 * time.Second):
					return errors.New("work was not cancelled")
				}
			})
			if !errors.Is(cause, fence.ErrLost) || !errors.Is(err, fence.ErrLost) {
				t.Fatalf("Hold across a restart: cause %v, returned %v; want ErrLost", cause, err)
			}
			l := mustTryAcquire(ctx, t, a, "job", time.Second)
			defer l.Release(ctx)
			if floor && l.Token() <= token {
				t.Errorf("with the floor, token %d after the restart is not above %d", l.Token(), token)
			}
			if !floor && l.Token() != 1 {
				t.Errorf("without the floor the restarted counter starts over: token %d, want 1", l.Token())
			}
		})
	}
}
