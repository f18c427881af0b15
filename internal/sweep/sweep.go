// Package sweep runs the contention curve on Redis: the lesson's
// locked increments of one counter, spread over processes x workers per
// process at several points (1x20 up to 16x8), for several lock libraries
// alternated within each round, and prints one table per run: wall time,
// Redis commands per increment (sent by the clients and processed by the
// server), the wait per grant (p50, p99, max) and the ratio to the fastest
// peer.
//
// The fence CLI (fence bench -backend redis -sweep) runs it with fencekit's
// contenders; the bench module (cd bench && go run ./sweep) adds the peer
// libraries, which fencekit's own module does not depend on. Both start
// their workers as child processes of their own binary (Config.Command).
package sweep

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/internal/childproc"
	"github.com/fencekit/fencekit/internal/rediscount"
	"github.com/redis/go-redis/v9"
)

// Locker takes the lock on name, waiting as long as ctx allows, and returns
// its release.
type Locker func(ctx context.Context, name string) (release func(context.Context) error, err error)

// Contenders builds a library's Locker on a client, by name.
type Contenders map[string]func(c *redis.Client) (Locker, error)

// Point is one point of the curve: Procs processes of Workers workers each.
type Point struct{ Procs, Workers int }

func (p Point) String() string { return fmt.Sprintf("%dx%d", p.Procs, p.Workers) }

// DefaultPoints is the curve's default points.
const DefaultPoints = "1x20,4x5,8x8,16x8"

// ParsePoints reads "1x20,4x5,8x8": processes x workers per process.
func ParsePoints(s string) ([]Point, error) {
	var ps []Point
	for _, f := range strings.Split(s, ",") {
		a, b, ok := strings.Cut(strings.TrimSpace(f), "x")
		p, err1 := strconv.Atoi(a)
		w, err2 := strconv.Atoi(b)
		if !ok || err1 != nil || err2 != nil || p < 1 || w < 1 || p > 64 || w > 256 {
			return nil, fmt.Errorf("point %q is not PROCESSESxWORKERS (1-64 processes of 1-256 workers)", f)
		}
		ps = append(ps, Point{p, w})
	}
	return ps, nil
}

// Config is one sweep.
type Config struct {
	// Client reaches the server: it sets up each run's counter and reads
	// INFO stats around it.
	Client *redis.Client
	// Names are the contenders, alternated within each round (the order
	// changes from round to round). A name starting with "fencekit" is
	// fencekit's; the others are peers.
	Names  []string
	Points []Point
	Rounds int
	// Increments is the number of locked increments per run, split evenly
	// between the workers (rounded down to a multiple of their number).
	Increments int
	// Command returns a child process of this program that calls RunChild
	// with env among its environment.
	Command func(env string) *exec.Cmd
	// Progress, when not nil, gets a line per run.
	Progress io.Writer
}

// Result is one contender's figures at one point, over all rounds.
type Result struct {
	Point      Point
	Name       string
	Each       int             // increments per worker
	Walls      []time.Duration // one per round
	Sent       int64           // commands the clients sent, all rounds
	Processed  int64           // commands the server processed meanwhile, all rounds
	Waits      []time.Duration // every grant's wait, all rounds
	Increments int             // all rounds
	CPU        time.Duration   // CPU time of the child processes from the start, all rounds
}

// Mean is the mean wall time of the rounds.
func (r *Result) Mean() time.Duration {
	var t time.Duration
	for _, w := range r.Walls {
		t += w
	}
	return t / time.Duration(len(r.Walls))
}

// Quantile of the waits (0 <= q <= 1).
func (r *Result) Quantile(q float64) time.Duration {
	if len(r.Waits) == 0 {
		return 0
	}
	w := slices.Clone(r.Waits)
	slices.Sort(w)
	return w[min(len(w)-1, int(q*float64(len(w))))]
}

// childEnv carries a child's job: "contender key workers each".
const childEnv = "FENCEKIT_SWEEP_CHILD"

// Run runs the sweep: for each point, Rounds rounds, each running every
// contender once in an order that changes between rounds. A run whose
// counter does not end exact is an error (lost updates).
func Run(ctx context.Context, cfg Config) ([]*Result, error) {
	if cfg.Rounds < 1 || cfg.Increments < 1 || len(cfg.Names) == 0 || len(cfg.Points) == 0 {
		return nil, errors.New("sweep: need rounds, increments, contenders and points")
	}
	var out []*Result
	rng := rand.New(rand.NewPCG(28, 28))
	for _, pt := range cfg.Points {
		total := pt.Procs * pt.Workers
		each := max(1, cfg.Increments/total)
		res := map[string]*Result{}
		for _, n := range cfg.Names {
			res[n] = &Result{Point: pt, Name: n, Each: each}
			out = append(out, res[n])
		}
		for r := 0; r < cfg.Rounds; r++ {
			for _, k := range rng.Perm(len(cfg.Names)) {
				name := cfg.Names[k]
				if err := runOne(ctx, cfg, pt, name, each, res[name]); err != nil {
					return nil, fmt.Errorf("%s at %v: %w", name, pt, err)
				}
				if cfg.Progress != nil {
					fmt.Fprintf(cfg.Progress, "%v round %d %-16s %v\n", pt, r+1, name, res[name].Walls[len(res[name].Walls)-1].Round(time.Millisecond))
				}
			}
		}
	}
	return out, nil
}

func runOne(ctx context.Context, cfg Config, pt Point, name string, each int, res *Result) error {
	key := fmt.Sprintf("sweep-counter-%d", time.Now().UnixNano())
	if err := cfg.Client.Set(ctx, key, 0, time.Hour).Err(); err != nil {
		return err
	}
	var cmds []*exec.Cmd
	for p := 0; p < pt.Procs; p++ {
		cmds = append(cmds, cfg.Command(fmt.Sprintf("%s=%s %s %d %d", childEnv, name, key, pt.Workers, each)))
	}
	var before int64
	took, out, err := childproc.RunAtStart(cmds, time.Minute, func() (err error) {
		before, err = processed(ctx, cfg.Client)
		return err
	})
	if err != nil {
		return err
	}
	after, err := processed(ctx, cfg.Client)
	if err != nil {
		return err
	}
	n, err := cfg.Client.Get(ctx, key).Int()
	if err != nil {
		return err
	}
	want := pt.Procs * pt.Workers * each
	if n != want {
		return fmt.Errorf("counter ended at %d, want %d: lost updates", n, want)
	}
	cfg.Client.Del(ctx, key)
	res.Walls = append(res.Walls, took)
	res.Sent += childproc.Sum(out, "sent ")
	res.CPU += time.Duration(childproc.Sum(out, "cpu "))
	res.Processed += after - before - 1 // less the INFO itself
	res.Increments += want
	for _, lines := range out {
		for _, l := range lines {
			if v, ok := strings.CutPrefix(l, "waits "); ok {
				for _, f := range strings.Fields(v) {
					us, err := strconv.ParseInt(f, 10, 64)
					if err != nil {
						return fmt.Errorf("child printed a bad wait %q", f)
					}
					res.Waits = append(res.Waits, time.Duration(us)*time.Microsecond)
				}
			}
		}
	}
	if len(res.Waits) != res.Increments {
		return fmt.Errorf("children reported %d waits for %d increments", len(res.Waits), res.Increments)
	}
	return nil
}

// processed reads the server's total_commands_processed, which counts the
// commands scripts run too, and every client's.
func processed(ctx context.Context, c *redis.Client) (int64, error) {
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

// lockWait bounds each wait for the lock, in every library alike.
const lockWait = 5 * time.Minute

// IsChild reports whether this process was started as a sweep child.
func IsChild() bool { return os.Getenv(childEnv) != "" }

// RunChild is one process of a run, started by Run through Config.Command:
// it builds its contender on c, warms a connection per worker, prints
// "ready", waits for the start line on stdin, runs its workers' locked
// increments (a GET and a SET of the counter under the lock), and prints
// "sent N" (commands c sent), "cpu N" (its CPU time since the start, in ns)
// and "waits" with each grant's wait in µs.
func RunChild(ctx context.Context, c *redis.Client, contenders Contenders, stdout io.Writer) error {
	f := strings.Fields(os.Getenv(childEnv))
	if len(f) != 4 {
		return fmt.Errorf("%s=%q: want contender key workers each", childEnv, os.Getenv(childEnv))
	}
	mk, ok := contenders[f[0]]
	if !ok {
		return fmt.Errorf("unknown contender %q", f[0])
	}
	workers, err1 := strconv.Atoi(f[2])
	each, err2 := strconv.Atoi(f[3])
	if err1 != nil || err2 != nil || workers < 1 || each < 1 {
		return fmt.Errorf("%s=%q: bad workers or each", childEnv, os.Getenv(childEnv))
	}
	key := f[1]
	lock, err := mk(c)
	if err != nil {
		return err
	}
	sent := rediscount.Attach(c)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() { defer wg.Done(); _ = c.Ping(ctx).Err() }()
	}
	wg.Wait()
	sent.Reset()
	if err := childproc.AwaitStart(stdout); err != nil {
		return err
	}
	cpu0 := cpuTime()
	waits := make([][]time.Duration, workers)
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				start := time.Now()
				// One deadline for every library: bsm/redislock gives
				// up after the ttl (10s) when ctx has none.
				lctx, cancel := context.WithTimeout(ctx, lockWait)
				release, err := lock(lctx, key+"-lock")
				cancel()
				if err != nil {
					errs <- err
					return
				}
				waits[w] = append(waits[w], time.Since(start))
				v, err := c.Get(ctx, key).Int()
				if err == nil {
					err = c.Set(ctx, key, v+1, time.Hour).Err()
				}
				if err = errors.Join(err, release(ctx)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	var sb strings.Builder
	sb.WriteString("waits")
	for _, ws := range waits {
		for _, d := range ws {
			sb.WriteString(" ")
			sb.WriteString(strconv.FormatInt(d.Microseconds(), 10))
		}
	}
	fmt.Fprintf(stdout, "sent %d\ncpu %d\n%s\n", sent.Load(), int64(cpuTime()-cpu0), sb.String())
	return nil
}

// IsPeer reports whether a contender is another library (not fencekit's).
func IsPeer(name string) bool { return !strings.HasPrefix(name, "fencekit") }

// Print writes the table: per point and contender, the mean wall time of the
// rounds (and the range), its ratio to the fastest peer's mean at that point,
// commands per increment and the wait per grant.
func Print(w io.Writer, res []*Result, rounds int) {
	best := map[Point]time.Duration{}
	for _, r := range res {
		if IsPeer(r.Name) && (best[r.Point] == 0 || r.Mean() < best[r.Point]) {
			best[r.Point] = r.Mean()
		}
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "procs x workers\tincrements\tlibrary\twall (mean of %d)\trange\t/best peer\tsent/incr\tprocessed/incr\tclient CPU/incr\twait p50\tp99\tmax\t\n", rounds)
	for _, r := range res {
		ratio := "-"
		if b := best[r.Point]; b > 0 {
			ratio = fmt.Sprintf("%.2f", float64(r.Mean())/float64(b))
		}
		lo, hi := slices.Min(r.Walls), slices.Max(r.Walls)
		inc := float64(r.Increments)
		fmt.Fprintf(tw, "%v\t%d\t%s\t%v\t%v-%v\t%s\t%.1f\t%.1f\t%v\t%v\t%v\t%v\t\n",
			r.Point, r.Increments/len(r.Walls), r.Name, ms(r.Mean()), ms(lo), ms(hi), ratio,
			float64(r.Sent)/inc, float64(r.Processed)/inc, us(r.CPU/time.Duration(r.Increments)),
			us(r.Quantile(0.5)), us(r.Quantile(0.99)), us(r.Quantile(1)))
	}
	tw.Flush()
}

func ms(d time.Duration) string { return d.Round(time.Millisecond).String() }

func us(d time.Duration) string {
	if d >= 10*time.Millisecond {
		return d.Round(time.Millisecond).String()
	}
	return d.Round(10 * time.Microsecond).String()
}

// Fencekit is fencekit's Redis acquirer, with opts, as a contender (ttl 10s,
// as the peers').
func Fencekit(opts *redislua.AcquirerOptions) func(c *redis.Client) (Locker, error) {
	return func(c *redis.Client) (Locker, error) {
		a, err := redislua.NewAcquirer(c, opts)
		if err != nil {
			return nil, err
		}
		return func(ctx context.Context, name string) (func(context.Context) error, error) {
			l, err := a.Acquire(ctx, name, 10*time.Second)
			if err != nil {
				return nil, err
			}
			return l.Release, nil
		}, nil
	}
}

// Main runs the sweep and prints the table to out, with the load average
// before and after (progress lines go to progress).
func Main(ctx context.Context, out, progress io.Writer, cfg Config) error {
	cfg.Progress = progress
	fmt.Fprintf(out, "contention sweep on Redis %s: %d locked increments per run, %d rounds, contenders alternated; load average before: %s\n",
		cfg.Client.Options().Addr, cfg.Increments, cfg.Rounds, LoadAvg())
	res, err := Run(ctx, cfg)
	if err != nil {
		return err
	}
	Print(out, res, cfg.Rounds)
	fmt.Fprintf(out, "load average after: %s (processed/incr counts every client of the server)\n", LoadAvg())
	return nil
}

// LoadAvg is the first three fields of /proc/loadavg, or "unknown".
func LoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) >= 3 {
		return strings.Join(f[:3], " ")
	}
	return "unknown"
}
