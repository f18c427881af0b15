package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bsm/redislock"
	"github.com/fencekit/fencekit/internal/childproc"
	"github.com/go-redsync/redsync/v4"
	"github.com/redis/go-redis/v9"
)

// contender builds one of the compared lockers by name.
func contender(name string, c *redis.Client) locker {
	switch name {
	case "fencekit":
		return fencekitLocker(c)
	case "redislock-100ms":
		return redislockLocker(c, redislock.LinearBackoff(100*time.Millisecond))
	case "redislock-1ms":
		return redislockLocker(c, redislock.LinearBackoff(time.Millisecond))
	case "redsync-default":
		return redsyncLocker(c, redsync.WithTries(math.MaxInt32))
	case "redsync-1ms":
		return redsyncLocker(c, redsync.WithTries(math.MaxInt32), redsync.WithRetryDelay(time.Millisecond))
	}
	panic("unknown contender " + name)
}

var contenderNames = []string{"fencekit", "redislock-100ms", "redislock-1ms", "redsync-default", "redsync-1ms"}

func redisAddr() string {
	if a := os.Getenv("FENCEKIT_REDIS_ADDR"); a != "" {
		return a
	}
	return "127.0.0.1:6379"
}

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
	ctx := context.Background()
	if err := c.Ping(ctx).Err(); err != nil {
		b.Skipf("Redis at %s: %v (run scripts/test.sh once to start it)", redisAddr(), err)
	}
	procs := envInt("BENCH_PROCESSES", 4)
	rounds, workers, each := envInt("BENCH_ROUNDS", 5), envInt("BENCH_WORKERS", 20), envInt("BENCH_EACH", 50)
	only := contenderNames
	if v := os.Getenv("BENCH_CONTENDERS"); v != "" {
		only = strings.Split(v, ",")
	}
	for i := 0; i < b.N; i++ {
		total, cmds, sent := map[string]time.Duration{}, map[string]int64{}, map[string]int64{}
		rng := rand.New(rand.NewPCG(uint64(i), 11))
		for r := 0; r < rounds; r++ {
			for _, k := range rng.Perm(len(only) + 1) {
				if k == len(only) {
					d, err := floor(ctx, c, workers*each)
					if err != nil {
						b.Fatal(err)
					}
					total["floor"] += d
					continue
				}
				d, n, m, err := processIncrements(ctx, c, only[k], procs, workers, each)
				if err != nil {
					b.Fatalf("%s: %v", only[k], err)
				}
				total[only[k]] += d
				cmds[only[k]] += n
				sent[only[k]] += m
			}
		}
		names := make([]string, 0, len(total))
		for n := range total {
			names = append(names, n)
		}
		sort.Slice(names, func(i, j int) bool { return total[names[i]] < total[names[j]] })
		var sb strings.Builder
		fmt.Fprintf(&sb, "%d processes x %d workers x %d locked increments, mean of %d rounds (floor: 4 PINGs per increment, sequential)\n",
			procs, workers/procs, each, rounds)
		fmt.Fprintf(&sb, "%-16s %10s %8s %10s %10s %12s\n", "", "time", "/floor", "/fencekit", "sent/incr", "server/incr")
		for _, n := range names {
			mean := total[n] / time.Duration(rounds)
			per, server := "4.0", "4.0"
			if n != "floor" {
				incr := float64(rounds * workers * each)
				per, server = fmt.Sprintf("%.1f", float64(sent[n])/incr), fmt.Sprintf("%.1f", float64(cmds[n])/incr)
			}
			fmt.Fprintf(&sb, "%-16s %10v %8.2f %10.2f %10s %12s\n", n, mean.Round(time.Millisecond),
				float64(total[n])/float64(total["floor"]), float64(total[n])/float64(total["fencekit"]), per, server)
			b.ReportMetric(float64(mean.Milliseconds()), n+"-ms")
		}
		b.Log("\n" + sb.String())
	}
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
		w := workers / procs
		if p < workers%procs {
			w++
		}
		cmd := exec.Command(os.Args[0], "-test.run=^TestPeerChild$", "-test.count=1")
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

// TestPeerChild is one process of BenchmarkPeersProcesses: it connects,
// warms one connection per worker, prints "ready", waits for a line on stdin,
// then runs its workers' locked increments and exits.
func TestPeerChild(t *testing.T) {
	name := os.Getenv("BENCH_CHILD")
	if name == "" {
		t.Skip("only run as a child process of BenchmarkPeersProcesses")
	}
	workers, each, key := envInt("BENCH_CHILD_WORKERS", 1), envInt("BENCH_CHILD_EACH", 1), os.Getenv("BENCH_KEY")
	c := redis.NewClient(&redis.Options{Addr: redisAddr(), PoolSize: 64})
	defer c.Close()
	ctx := context.Background()
	var sent atomic.Int64
	c.AddHook(countHook{&sent})
	lock := contender(name, c)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() { defer wg.Done(); _ = c.Ping(ctx).Err() }()
	}
	wg.Wait()
	sent.Store(0)
	if err := childproc.AwaitStart(os.Stdout); err != nil {
		t.Fatal(err)
	}
	if err := incrementLoop(ctx, c, lock, key, workers, each); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("sent %d\n", sent.Load())
}

// countHook counts the commands a client sends (each command of a pipeline,
// and a script as one command, EVALSHA or EVAL).
type countHook struct{ n *atomic.Int64 }

func (h countHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}

func (h countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}
