package sweep_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/fencekit/fencekit/internal/sweep"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// testContenders lock with a mutex of the process (exact with one process):
// "exact" as it is, "lossy" loses the first increment of each process (its
// release takes the counter back by one, as a lock that let two workers in
// would).
var testContenders = sweep.Contenders{
	"exact": mutexLocker(false),
	"lossy": mutexLocker(true),
}

func mutexLocker(lose bool) func(c *redis.Client) (sweep.Locker, error) {
	return func(c *redis.Client) (sweep.Locker, error) {
		var mu sync.Mutex
		var lost atomic.Bool
		return func(ctx context.Context, name string) (func(context.Context) error, error) {
			mu.Lock()
			return func(ctx context.Context) error {
				defer mu.Unlock()
				if lose && lost.CompareAndSwap(false, true) {
					return c.Decr(ctx, strings.TrimSuffix(name, "-lock")).Err()
				}
				return nil
			}, nil
		}, nil
	}
}

func TestMain(m *testing.M) {
	if sweep.IsChild() {
		c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
		if err := sweep.RunChild(context.Background(), c, testContenders, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func config(c *redis.Client, name string) sweep.Config {
	return sweep.Config{
		Client: c, Names: []string{name}, Points: []sweep.Point{{Procs: 1, Workers: 4}},
		Rounds: 1, Increments: 40,
		Command: func(env string) *exec.Cmd {
			cmd := exec.Command(os.Args[0])
			cmd.Env = append(os.Environ(), env)
			return cmd
		},
	}
}

// TestSweepFailsOnALostUpdate: a run whose counter does not end exact fails
// the sweep; one that does passes, with a wait per increment.
func TestSweepFailsOnALostUpdate(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	res, err := sweep.Run(ctx, config(c, "exact"))
	if err != nil {
		t.Fatalf("exact: %v", err)
	}
	if len(res) != 1 || res[0].Increments != 40 || len(res[0].Waits) != 40 {
		t.Fatalf("exact: %+v, want one result of 40 increments and waits", res)
	}
	_, err = sweep.Run(ctx, config(c, "lossy"))
	if err == nil || !strings.Contains(err.Error(), "lost updates") {
		t.Fatalf("lossy: %v, want the sweep to fail on a lost update", err)
	}
}
