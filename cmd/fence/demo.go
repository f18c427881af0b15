package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// demo prints the scenarios and records whether each outcome was the expected one.
type demo struct {
	out    io.Writer
	b      *backend
	failed []string
	timing
}

// timing holds a scenario's durations. The lesson's are the default; a backend
// whose leases are longer (etcd counts whole seconds) scales them.
type timing struct {
	// The paused holder and the watchdog: the leases, and the slow step of
	// the watchdog's first scene. The lesson: 500ms, 1s. A's pauses
	// otherwise last until B has written, an event, not a duration.
	lease, stall time.Duration
	// The release bug: A's lease. The lesson: 300ms.
	bugLease time.Duration
}

func (d *demo) printf(format string, args ...any) { fmt.Fprintf(d.out, format, args...) }

// check prints an outcome and remembers it when it is not the expected one.
func (d *demo) check(ok bool, what string) {
	mark := "ok  "
	if !ok {
		mark = "FAIL"
		d.failed = append(d.failed, what)
	}
	d.printf("   [%s] %s\n", mark, what)
}

var lessonTiming = timing{
	lease: 500 * time.Millisecond, stall: time.Second,
	bugLease: 300 * time.Millisecond,
}

func runDemo(args []string, stdout, stderr io.Writer) error {
	fs, bc := commandFlags("demo", "demo [flags]",
		"Replays the lesson's scenarios on a real backend and checks each outcome:\n"+
			"the plain release bug, 20 workers x 50 locked increments, the paused holder\n"+
			"with and without fencing tokens (with a timeline), what the watchdog can and\n"+
			"cannot do, a card charged once by two workers of which one crashes, and the\n"+
			"same over HTTP (Idempotency-Key middleware, a client whose response is lost).\n"+
			"Exits 1 if any outcome is not the expected one.", false, stdout, stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if err := bc.checkFlags(fs.FlagSet); err != nil {
		return err
	}
	ctx := context.Background()
	b, err := openBackend(ctx, *bc)
	if err != nil {
		return err
	}
	defer b.close()
	d := &demo{out: stdout, b: b, timing: lessonTiming}
	if b.timing != nil {
		d.timing = *b.timing
	}
	d.printf("fence demo on %s\n", b.name)
	if d.timing != lessonTiming {
		d.printf("(this backend's leases are whole seconds: the lesson's timings are stretched)\n")
	}
	d.printf("\n")
	for _, sc := range []func(context.Context) error{d.releaseBug, d.contention, d.pausedHolder, d.watchdog, d.payment, d.httpPayment} {
		if err := sc(ctx); err != nil {
			return err
		}
		d.printf("\n")
	}
	if len(d.failed) > 0 {
		return fmt.Errorf("%d outcome(s) not as expected: %s", len(d.failed), strings.Join(d.failed, "; "))
	}
	d.printf("Every outcome was the expected one.\n")
	return nil
}

// releaseBug: A's lease expires, B takes the lock, then A releases. A plain
// release frees B's lock and lets C in; a token-checked release does not.
func (d *demo) releaseBug(ctx context.Context) error {
	d.printf("1. Releasing a lock that expired\n")
	d.printf("   A takes a %v lease and stalls; B waits and is granted the lock once A's lease expired; then A releases.\n", d.bugLease)
	for _, checked := range []bool{false, true} {
		name := fmt.Sprintf("report-%v", checked)
		a, err := d.b.acq.TryAcquire(ctx, name, d.bugLease)
		if err != nil {
			return fmt.Errorf("worker A acquires: %w", err)
		}
		// A stalls while B waits: B's grant is the moment A's lease expired
		// on the backend.
		bl, err := d.b.acq.Acquire(ctx, name, 5*time.Second)
		if err != nil {
			return fmt.Errorf("worker B acquires after A's lease expired: %w", err)
		}
		var relErr error
		if checked {
			relErr = a.Release(ctx)
		} else {
			relErr = d.b.forceRelease(ctx, name)
		}
		c, cErr := d.b.acq.TryAcquire(ctx, name, 5*time.Second)
		cGot := cErr == nil
		if cGot {
			_ = c.Release(ctx)
		} else if !errors.Is(cErr, fence.ErrHeld) {
			return fmt.Errorf("worker C acquires: %w", cErr)
		}
		_ = bl.Release(ctx)
		if !checked {
			d.printf("   plain release (no token check): A's release -> %s; C acquires while B still works -> %v\n", result(relErr), cGot)
			d.check(cGot, "the plain release freed B's lock and let C in (the bug)")
		} else {
			d.printf("   token-checked Release:          A's release -> %s; C acquires while B still works -> %v\n", result(relErr), cGot)
			d.check(errors.Is(relErr, fence.ErrLost) && !cGot, "A's Release reported the lost lease and left B's lock alone")
		}
	}
	return nil
}

func result(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, fence.ErrLost):
		return "lease lost"
	case errors.Is(err, fence.ErrStale):
		return "REJECTED"
	default:
		return err.Error()
	}
}

// contention: 20 workers x 50 read-modify-write increments under the lock.
func (d *demo) contention(ctx context.Context) error {
	const workers, each = 20, 50
	d.printf("2. Mutual exclusion under contention\n")
	d.printf("   %d workers x %d increments of a counter, each a read then a write, under the lock.\n", workers, each)
	n, took, err := lockedIncrements(ctx, d.b, "balance", workers, each)
	if err != nil {
		return err
	}
	d.printf("   %d workers x %d locked increments -> balance %d in %.2fs\n", workers, each, n, took.Seconds())
	d.check(n == workers*each, fmt.Sprintf("the balance is exactly %d: no lost updates", workers*each))
	return nil
}

// lockedIncrements runs the contention workload on a fresh counter key and
// returns the final count and the time taken.
func lockedIncrements(ctx context.Context, b *backend, name string, workers, each int) (int, time.Duration, error) {
	key := fmt.Sprintf("%s-%d", name, time.Now().UnixNano())
	if err := b.plainPut(ctx, key, []byte("0")); err != nil {
		return 0, 0, err
	}
	took, err := parallel(workers, each, func() error { return lockedIncrement(ctx, b, key) })
	if err != nil {
		return 0, 0, err
	}
	v, err := b.plainGet(ctx, key)
	if err != nil {
		return 0, 0, err
	}
	n, err := strconv.Atoi(string(v))
	return n, took, err
}

// parallel runs op each times in each of workers goroutines and returns the
// time taken and the first error.
func parallel(workers, each int, op func() error) (time.Duration, error) {
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				if err := op(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	close(errs)
	return took, <-errs
}

func lockedIncrement(ctx context.Context, b *backend, key string) error {
	// A worker waits its turn behind every other worker (a line of 19 on
	// etcd, Redis and SQL); an acquirer's default maximum wait (30s) is
	// for one call, and a loaded machine took longer than that for 19
	// increments on etcd.
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	l, err := b.acq.Acquire(ctx, key, 10*time.Second)
	if err != nil {
		return err
	}
	return errors.Join(incrementPlain(ctx, b, key), l.Release(ctx))
}

// incrementPlain is the locked increments' read-modify-write of key's
// counter in b's plain store.
func incrementPlain(ctx context.Context, b *backend, key string) error {
	v, err := b.plainGet(ctx, key)
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(string(v))
	if err != nil {
		return err
	}
	return b.plainPut(ctx, key, []byte(strconv.Itoa(n+1)))
}

// clientTimes are one client's moments in the paused-holder scenario, from its start.
type clientTimes struct {
	granted, wrote, released time.Duration
	token                    fence.Token
}

// timeline draws the scenario: each client's lease as the backend counts it
// ([ granted, ) expired or released), the pause, and the write, one column per
// 50ms, so a reader sees A's write land after B's lease began.
func (d *demo) timeline(tl map[string]*clientTimes, log *storageLog, fenced bool) {
	const col = 50 * time.Millisecond
	a, b := tl["A"], tl["B"]
	if a == nil || b == nil {
		return
	}
	end := max(a.released, b.released) + col
	width := int(end / col)
	row := func() []byte { return []byte(strings.Repeat(" ", width+40)) }
	at := func(t time.Duration) int { return min(int(t/col), width) }
	axis := row()
	for t := time.Duration(0); t < end; t += 10 * col {
		copy(axis[at(t):], fmt.Sprintf("|%v", t))
	}
	d.printf("     timeline, one column per %v:\n", col)
	d.printf("       %-9s %s\n", "", strings.TrimRight(string(axis), " "))
	for _, who := range []string{"A", "B"} {
		c := tl[who]
		leaseEnd := min(c.granted+d.lease, c.released)
		lease := row()
		for i := at(c.granted); i < at(leaseEnd); i++ {
			lease[i] = '='
		}
		lease[at(c.granted)] = '['
		lease[at(leaseEnd)] = ')'
		d.printf("       %-9s %s\n", who+" lease", strings.TrimRight(string(lease), " "))
		act := row()
		for i := at(c.granted) + 1; i < at(c.wrote); i++ {
			act[i] = '.'
		}
		mark := "W ok"
		for _, e := range log.entries {
			if strings.Contains(e, "written by "+who) && strings.HasPrefix(e, "REJECTED") {
				mark = "W REJECTED"
			}
		}
		if fenced {
			mark += fmt.Sprintf(" (token %d)", c.token)
		}
		copy(act[at(c.wrote):], mark)
		d.printf("       %-9s %s\n", who, strings.TrimRight(string(act), " "))
	}
	d.printf("       ([=) lease on the backend's clock, ... waiting or paused, W the write)\n")
}

// storageLog records the writes that reach the storage, as the lesson prints them.
type storageLog struct {
	mu      sync.Mutex
	entries []string
}

func (s *storageLog) add(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.entries = append(s.entries, fmt.Sprintf(format, args...))
}

// pausedHolder: A takes a 500ms lease and stalls; B, arriving once A holds
// the lock, waits for A's lease to expire on the backend and writes; then A
// wakes and writes. Without and with fencing tokens. The order comes from
// events (A's grant, B's write), not from durations.
func (d *demo) pausedHolder(ctx context.Context) error {
	d.printf("3. The paused holder\n")
	d.printf("   A takes a %v lease and stalls (a GC pause, a slow call) until B, granted after A's lease expired, has written.\n", d.lease)
	for _, fenced := range []bool{false, true} {
		name := fmt.Sprintf("invoice-%v-%d", fenced, time.Now().UnixNano())
		log := &storageLog{}
		write := func(who string, l fence.Lease) error {
			if fenced {
				return d.fencedWrite(ctx, log, name, who, l.Token())
			}
			value := []byte("written by " + who)
			err := d.b.plainPut(ctx, name, value)
			if err == nil {
				log.add("ok        %-14q", value)
			}
			return err
		}
		var (
			wg        sync.WaitGroup
			releases  = map[string]error{}
			relOrder  []string
			mu        sync.Mutex
			clientErr error
			start     = time.Now()
			tl        = map[string]*clientTimes{}
		)
		// granted: A holds the lock (B arrives then); written: B's write is
		// done (A wakes then). Each is closed whatever happened, so a failed
		// step ends the scene instead of hanging it.
		granted, written := make(chan struct{}), make(chan struct{})
		// work is how long a client works before its write (B's 100ms is the
		// picture's, nothing waits on it).
		client := func(who string, after, pause <-chan struct{}, work time.Duration, done chan<- struct{}) {
			defer wg.Done()
			<-after
			ct := &clientTimes{}
			l, err := d.b.acq.Acquire(ctx, name, d.lease)
			ct.granted = time.Since(start)
			if who == "A" {
				close(granted)
			}
			if err == nil {
				ct.token = l.Token()
				time.Sleep(work)
				<-pause
				ct.wrote = time.Since(start)
				err = write(who, l)
			}
			if done != nil {
				close(done)
			}
			var rel error
			if l != nil {
				rel = l.Release(ctx)
			}
			ct.released = time.Since(start)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				clientErr = errors.Join(clientErr, fmt.Errorf("client %s: %w", who, err))
			}
			releases[who] = rel
			relOrder = append(relOrder, who)
			tl[who] = ct
		}
		now := make(chan struct{})
		close(now)
		wg.Add(2)
		go client("A", now, written, 0, nil)
		go client("B", granted, now, 100*time.Millisecond, written)
		wg.Wait()
		if clientErr != nil {
			return clientErr
		}
		if fenced {
			d.printf("   With fencing tokens:\n")
		} else {
			d.printf("   Without fencing:\n")
		}
		for _, who := range relOrder {
			d.printf("     %s: release -> %s\n", who, result(releases[who]))
		}
		for _, e := range log.entries {
			d.printf("     storage: %s\n", e)
		}
		var final []byte
		var err error
		if fenced {
			final, _, err = d.b.fenced.Read(ctx, name)
		} else {
			final, err = d.b.plainGet(ctx, name)
		}
		if err != nil {
			return err
		}
		d.printf("     final value: %q\n", final)
		d.timeline(tl, log, fenced)
		if !fenced {
			d.check(string(final) == "written by A" && errors.Is(releases["A"], fence.ErrLost),
				"A, whose lease had expired, wrote last and overwrote B's newer result (the failure no TTL fixes)")
		} else {
			rejected := len(log.entries) == 2 && strings.HasPrefix(log.entries[1], "REJECTED") && strings.Contains(log.entries[1], "written by A")
			d.check(rejected && string(final) == "written by B", "the storage rejected A's stale token; the final value is B's")
		}
	}
	return nil
}
