package etcdfence_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/childproc"
	"github.com/fencekit/fencekit/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

// The peer of these benchmarks is go.etcd.io/etcd/client/v3/concurrency.Mutex
// on a session whose lease is reused across locks: one transaction to lock
// (uncontended), one delete to unlock. It gives no per-lock ttl (its
// session's lease is kept alive by the client as long as the process runs)
// and no fencing of a paused holder, so it is a yardstick, not an
// equivalent.

// peerContenders are the locks compared, by name: fencekit with its lease
// pool, fencekit without it, and the Mutex.
var peerContenders = []string{"fencekit", "fencekit-nopool", "mutex"}

// locker locks name, returning the function that unlocks it.
type locker func(ctx context.Context, name string) (unlock func() error, err error)

// newLockers returns n lockers of contender kind on client cl, as n workers
// of one process use them: fencekit's share one Acquirer; the Mutex's have a
// session each (two Mutexes on one session would share its key).
func newLockers(ctx context.Context, cl *clientv3.Client, kind string, n int) ([]locker, func(), error) {
	var out []locker
	switch kind {
	case "fencekit", "fencekit-nopool":
		a, err := etcdfence.NewAcquirer(cl, &etcdfence.AcquirerOptions{NoPool: kind == "fencekit-nopool"})
		if err != nil {
			return nil, nil, err
		}
		l := func(ctx context.Context, name string) (func() error, error) {
			l, err := a.Acquire(ctx, name, 10*time.Second)
			if err != nil {
				return nil, err
			}
			return func() error { return l.Release(ctx) }, nil
		}
		for range n {
			out = append(out, l)
		}
		return out, func() { _ = a.Close(context.Background()) }, nil
	case "mutex":
		var sessions []*concurrency.Session
		done := func() {
			for _, s := range sessions {
				_ = s.Close()
			}
		}
		for range n {
			s, err := concurrency.NewSession(cl, concurrency.WithTTL(10), concurrency.WithContext(ctx))
			if err != nil {
				done()
				return nil, nil, err
			}
			sessions = append(sessions, s)
			out = append(out, func(ctx context.Context, name string) (func() error, error) {
				m := concurrency.NewMutex(s, "/bench-mutex/"+name)
				if err := m.Lock(ctx); err != nil {
					return nil, err
				}
				return func() error { return m.Unlock(ctx) }, nil
			})
		}
		return out, done, nil
	}
	return nil, nil, fmt.Errorf("no contender %q", kind)
}

// BenchmarkAcquireRelease/etcd-vs-mutex: an uncontended TryAcquire + Release
// with the lease pool, the same without it, and concurrency.Mutex's TryLock
// + Unlock (its session's lease reused), the three interleaved in random
// order within each iteration on one embedded etcd. It reports each one's
// p50 and mean in microseconds and the ratios of fencekit's p50 to the
// Mutex's.
//
//	go test -run '^$' -bench 'BenchmarkAcquireRelease/etcd-vs-mutex' -benchtime 2000x ./adapters/etcd/
func acquireReleaseVsMutex(b *testing.B, cl *clientv3.Client) {
	ctx := context.Background()
	pool, err := etcdfence.NewAcquirer(cl, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close(ctx)
	nopool, err := etcdfence.NewAcquirer(cl, &etcdfence.AcquirerOptions{NoPool: true})
	if err != nil {
		b.Fatal(err)
	}
	s, err := concurrency.NewSession(cl, concurrency.WithTTL(10))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	name := fencetest.Name("bench-vs-mutex")
	m := concurrency.NewMutex(s, "/bench-mutex/"+name)
	ops := []func() error{
		func() error {
			l, err := pool.TryAcquire(ctx, name+"-pool", 10*time.Second)
			if err != nil {
				return err
			}
			return l.Release(ctx)
		},
		func() error {
			l, err := nopool.TryAcquire(ctx, name+"-nopool", 10*time.Second)
			if err != nil {
				return err
			}
			return l.Release(ctx)
		},
		func() error {
			if err := m.TryLock(ctx); err != nil {
				return err
			}
			return m.Unlock(ctx)
		},
	}
	times := make([][]time.Duration, len(ops))
	rng := rand.New(rand.NewPCG(1, 2))
	order := []int{0, 1, 2}
	for i := 0; i < b.N; i++ {
		rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		for _, k := range order {
			start := time.Now()
			if err := ops[k](); err != nil {
				b.Fatal(err)
			}
			times[k] = append(times[k], time.Since(start))
		}
	}
	p50 := make([]float64, len(ops))
	for k, ts := range times {
		var sum time.Duration
		for _, t := range ts {
			sum += t
		}
		slices.Sort(ts)
		p50[k] = float64(ts[len(ts)/2].Microseconds())
		b.ReportMetric(p50[k], peerContenders[k]+"-p50-µs")
		b.ReportMetric(float64(sum.Microseconds())/float64(len(ts)), peerContenders[k]+"-mean-µs")
	}
	b.ReportMetric(p50[0]/p50[2], "pool/mutex-p50")
	b.ReportMetric(p50[1]/p50[2], "nopool/mutex-p50")
}

// BenchmarkLockedIncrements: BENCH_WORKERS (default 8) workers x BENCH_EACH
// (25) increments of a counter kept in an etcd key (a read and a put under
// the lock), with fencekit (its lease pool on, then off) and with
// concurrency.Mutex, in BENCH_ROUNDS (5) rounds of random order on one
// embedded etcd; "1process" runs the workers in this process (fencekit's
// share one Acquirer, each Mutex worker has its own session on one client),
// "4processes" spreads them over BENCH_PROCESSES (4) child processes, each
// with a client of its own. It reports each contender's median time in ms
// and its ratio to the Mutex's; a counter that ends anywhere but at workers
// x each fails it. It makes one pass of its rounds whatever b.N is.
//
//	go test -run '^$' -bench BenchmarkLockedIncrements -benchtime 1x ./adapters/etcd/
func BenchmarkLockedIncrements(b *testing.B) {
	c := etcdtest.Start(b, 1)
	cl := c.Client(b)
	workers, each, rounds := envInt("BENCH_WORKERS", 8), envInt("BENCH_EACH", 25), envInt("BENCH_ROUNDS", 5)
	procs := envInt("BENCH_PROCESSES", 4)
	ctx := context.Background()
	run := map[string]func(kind, name string) (time.Duration, error){
		"1process": func(kind, name string) (time.Duration, error) {
			lockers, done, err := newLockers(ctx, cl, kind, workers)
			if err != nil {
				return 0, err
			}
			defer done()
			start := time.Now()
			if err := incrementLoop(ctx, cl, lockers, name, each); err != nil {
				return 0, err
			}
			return time.Since(start), nil
		},
		fmt.Sprintf("%dprocesses", procs): func(kind, name string) (time.Duration, error) {
			var cmds []*exec.Cmd
			for p := 0; p < procs; p++ {
				cmd := exec.Command(os.Args[0])
				cmd.Env = append(os.Environ(), "ETCDFENCE_BENCH_CHILD="+kind, "ETCDFENCE_BENCH_NAME="+name,
					"ETCDFENCE_BENCH_ENDPOINT="+c.ClientAddr(0),
					"BENCH_CHILD_WORKERS="+strconv.Itoa(childproc.Share(workers, procs, p)), "BENCH_CHILD_EACH="+strconv.Itoa(each))
				cmds = append(cmds, cmd)
			}
			took, _, err := childproc.Run(cmds, 30*time.Second)
			return took, err
		},
	}
	for _, where := range []string{"1process", fmt.Sprintf("%dprocesses", procs)} {
		b.Run(where, func(b *testing.B) {
			// BENCH_ROUNDS sizes it, not b.N: one pass of the rounds
			// however large -benchtime is.
			for range 1 {
				took := map[string][]time.Duration{}
				for r := 0; r < rounds; r++ {
					order := slices.Clone(peerContenders)
					rand.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
					for _, kind := range order {
						name := fencetest.Name("incr-" + kind)
						d, err := run[where](kind, name)
						if err != nil {
							b.Fatalf("%s: %v", kind, err)
						}
						if err := checkCounter(ctx, cl, name, workers*each); err != nil {
							b.Fatalf("%s: %v", kind, err)
						}
						took[kind] = append(took[kind], d)
					}
				}
				med := map[string]float64{}
				for kind, ds := range took {
					slices.Sort(ds)
					med[kind] = float64(ds[len(ds)/2].Milliseconds())
					b.ReportMetric(med[kind], kind+"-ms")
				}
				b.ReportMetric(med["fencekit"]/med["mutex"], "fencekit/mutex")
				b.ReportMetric(med["fencekit-nopool"]/med["mutex"], "nopool/mutex")
			}
		})
	}
}

func counterKey(name string) string { return "/bench-counter/" + name }

// incrementLoop runs len(lockers) workers, each doing each increments of
// name's counter under its locker.
func incrementLoop(ctx context.Context, cl *clientv3.Client, lockers []locker, name string, each int) error {
	var wg sync.WaitGroup
	errs := make(chan error, len(lockers))
	for _, lock := range lockers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				if err := increment(ctx, cl, lock, name); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

func increment(ctx context.Context, cl *clientv3.Client, lock locker, name string) error {
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	unlock, err := lock(wctx, name)
	if err != nil {
		return err
	}
	resp, err := cl.Get(ctx, counterKey(name))
	if err != nil {
		_ = unlock()
		return err
	}
	n := 0
	if len(resp.Kvs) == 1 {
		n, _ = strconv.Atoi(string(resp.Kvs[0].Value))
	}
	if _, err := cl.Put(ctx, counterKey(name), strconv.Itoa(n+1)); err != nil {
		_ = unlock()
		return err
	}
	return unlock()
}

func checkCounter(ctx context.Context, cl *clientv3.Client, name string, want int) error {
	resp, err := cl.Get(ctx, counterKey(name))
	if err != nil {
		return err
	}
	got := 0
	if len(resp.Kvs) == 1 {
		got, _ = strconv.Atoi(string(resp.Kvs[0].Value))
	}
	if got != want {
		return fmt.Errorf("the counter ended at %d, want %d: an increment was lost or doubled", got, want)
	}
	return nil
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// TestMain runs this test binary as one process of BenchmarkLockedIncrements
// when the benchmark starts it with ETCDFENCE_BENCH_CHILD set (the
// contender), and as the test binary otherwise.
func TestMain(m *testing.M) {
	kind := os.Getenv("ETCDFENCE_BENCH_CHILD")
	if kind == "" {
		os.Exit(m.Run())
	}
	if err := benchChild(kind); err != nil {
		fmt.Fprintf(os.Stderr, "bench child %s: %v\n", kind, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// benchChild is one process of BenchmarkLockedIncrements: it connects, makes
// its workers' lockers, prints "ready", waits for the start, and runs its
// workers' increments.
func benchChild(kind string) error {
	ctx := context.Background()
	cl, err := clientv3.New(clientv3.Config{Endpoints: []string{os.Getenv("ETCDFENCE_BENCH_ENDPOINT")}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return err
	}
	defer cl.Close()
	name := os.Getenv("ETCDFENCE_BENCH_NAME")
	if _, err := cl.Get(ctx, counterKey(name)); err != nil { // connected
		return err
	}
	lockers, done, err := newLockers(ctx, cl, kind, envInt("BENCH_CHILD_WORKERS", 1))
	if err != nil {
		return err
	}
	defer done()
	if err := childproc.AwaitStart(os.Stdout); err != nil {
		return err
	}
	return incrementLoop(ctx, cl, lockers, name, envInt("BENCH_CHILD_EACH", 1))
}
