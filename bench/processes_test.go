package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/internal/childproc"
	"github.com/fencekit/fencekit/internal/rediscount"
	"github.com/fencekit/fencekit/internal/sweep"
	"github.com/redis/go-redis/v9"
)

// commands reads the server's total_commands_processed.
func commands(ctx context.Context, c *redis.Client) (int64, error) {
	info, err := c.Info(ctx, "stats").Result()
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "total_commands_processed:"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, errors.New("INFO stats has no total_commands_processed")
}

// BenchmarkPeersProcesses is BenchmarkPeers with the workers spread over
// BENCH_PROCESSES (default 4) child processes, as pods or worker processes
// would run them: the lesson's 20 workers x 50 locked increments of one
// counter, per contender, in rounds of random order with the round-trip floor
// (4 PINGs per increment, sequential). It also reports the commands each
// increment cost: sent by the clients (a script counts once), and processed by
// the server (total_commands_processed, which counts the commands a script
// runs too).
func BenchmarkPeersProcesses(b *testing.B) {
	c := redis.NewClient(&redis.Options{Addr: redisAddr()})
	defer c.Close()
	procs := envInt("BENCH_PROCESSES", 4)
	comparePeers(b, c, fmt.Sprintf(" in %d processes", procs), func(ctx context.Context, name string, workers, each int) (time.Duration, int64, int64, error) {
		return processIncrements(ctx, c, name, procs, workers, each)
	})
}

// processIncrements runs workers x each locked increments of a fresh counter
// in procs child processes (workers split between them), timed from the
// moment all are connected and ready, and returns the time, the Redis
// commands processed meanwhile, and an error when the count is not exact.
func processIncrements(ctx context.Context, c *redis.Client, name string, procs, workers, each int) (took time.Duration, server, sent int64, err error) {
	key := fmt.Sprintf("bench-counter-%d", time.Now().UnixNano())
	if err := c.Set(ctx, key, 0, time.Hour).Err(); err != nil {
		return 0, 0, 0, err
	}
	var cmds []*exec.Cmd
	for p := 0; p < procs; p++ {
		w := childproc.Share(workers, procs, p)
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), "BENCH_CHILD="+name, "BENCH_KEY="+key,
			"BENCH_CHILD_WORKERS="+strconv.Itoa(w), "BENCH_CHILD_EACH="+strconv.Itoa(each))
		cmds = append(cmds, cmd)
	}
	before, err := commands(ctx, c)
	if err != nil {
		return 0, 0, 0, err
	}
	took, out, err := childproc.Run(cmds, 30*time.Second)
	if err != nil {
		return 0, 0, 0, err
	}
	after, err := commands(ctx, c)
	if err != nil {
		return 0, 0, 0, err
	}
	n, err := c.Get(ctx, key).Int()
	if err != nil {
		return 0, 0, 0, err
	}
	if n != workers*each {
		return 0, 0, 0, fmt.Errorf("counter ended at %d, want %d: lost updates", n, workers*each)
	}
	// Less the INFO itself; the children's own connection set-up (before
	// they were ready) counts too, a few commands per connection.
	return took, after - before - 1, childproc.Sum(out, "sent "), nil
}

// TestMain runs this test binary as one process of BenchmarkPeersProcesses
// when the benchmark starts it with BENCH_CHILD set, as one of BenchmarkSweep
// when it is a sweep child, and as the test binary otherwise.
func TestMain(m *testing.M) {
	if sweep.IsChild() {
		c := redis.NewClient(&redis.Options{Addr: redisAddr()})
		err := sweep.RunChild(context.Background(), c, Contenders, os.Stdout)
		c.Close()
		if err != nil {
			fmt.Fprintf(os.Stderr, "sweep child: %v\n", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	name := os.Getenv("BENCH_CHILD")
	if name == "" {
		os.Exit(m.Run())
	}
	if err := peerChild(name); err != nil {
		fmt.Fprintf(os.Stderr, "bench child %s: %v\n", name, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// peerChild is one process of BenchmarkPeersProcesses: it connects, warms one
// connection per worker, prints "ready", waits for a line on stdin, runs its
// workers' locked increments with contender name, and prints "sent N".
func peerChild(name string) error {
	workers, each, key := envInt("BENCH_CHILD_WORKERS", 1), envInt("BENCH_CHILD_EACH", 1), os.Getenv("BENCH_KEY")
	c := redis.NewClient(&redis.Options{Addr: redisAddr(), PoolSize: 64})
	defer c.Close()
	ctx := context.Background()
	sent := rediscount.Attach(c)
	lock := contender(name, c)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() { defer wg.Done(); _ = c.Ping(ctx).Err() }()
	}
	wg.Wait()
	sent.Reset()
	if err := childproc.AwaitStart(os.Stdout); err != nil {
		return err
	}
	if err := incrementLoop(ctx, c, lock, key, workers, each); err != nil {
		return err
	}
	fmt.Printf("sent %d\n", sent.Load())
	return nil
}
