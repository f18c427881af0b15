package idempotencytest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/nemesisrun"
)

// NemesisSuite runs idempotency.Do from several clients on a few keys under
// combined faults, records every call and every run of the effect in one
// ledger, and checks the whole history. The point cases of Suite test one
// fault at a time; this finds the bugs that need two at once (a lost arm reply
// then a partition longer than the lease, a caller that leaves while its
// claim's reply is held). It takes fencetest.NemesisSuite's environment
// variables (fencetest.NemesisSeedEnv replays a seed, NemesisDurationEnv and
// NemesisSeedsEnv make a soak run). Each seed's run:
//
//   - Clients, each with a store of its own behind a proxy of its own, call
//     Do on two or three keys at a time (a new set every half lease, and
//     one call in three on a key of the last six sets), so several callers
//     ask for one key at once.
//     Every Do has the suite's short Lease and a CompleteTimeout of one to
//     three leases; one in four waits for another owner (Options.Wait), two
//     in three have a Reconcile hook (which asks the ledger, as a provider
//     would be asked), about one in five has a caller that leaves (its
//     context ends) at a random moment within 1.5 leases, and about one in
//     eleven one that leaves while Do holds the claim, before the effect: as
//     the claim's (or takeover's) reply comes, or as the arm is sent. After
//     such a claim was given back, a probe (a Do that does not wait, on a
//     Direct store) tries the key a little later. The effect pauses
//     (at times past the lease, cooperatively or not), then, in one step with
//     the ledger, checks its context: done, it returns NotSent; live, it
//     succeeds, fails definitively, says NotSent, or returns an ambiguous
//     error after it did, or did not, happen.
//   - A nemesis, from the same seed, loses the reply of a client's next
//     request, or of its next request of one step (claim, arm, renewal,
//     completion, release, takeover, unknown mark, read), drops a request
//     unsent, adds latency with jitter, and partitions a client for less and
//     for more than the lease. Faults stop at 70% of the run.
//
// Checked after the run, as idempotency's documentation states the
// guarantees (see checkRuns, checkDos and checkRecords):
// (1) a key's effect never runs while an earlier run of it could still see a
// live context, never runs again after a run that happened with a result,
// and after a run that failed definitively only when that failure was not
// recorded (its Do returned ErrNotRecorded); (2) each Do's result agrees with
// the ledger: a fresh result is its own run's, which happened; a replay is
// the result of the key's run that happened; an error from a Do whose effect
// succeeded is ErrNotRecorded; a replayed failure is a failure the effect
// returned; (3) once the faults have healed, every key's record (Get on a
// Direct store) agrees with the ledger: completed with the result of the run
// that happened, failed with a failure that happened, and never released,
// claimed or missing after a run that happened; armed and unknown are
// allowed unless a Do reported the key completed or failed; (4) once the
// faults have healed, a Do on every key, waiting for other owners, returns a
// result, ErrUnknown or a replayed failure within the settle time of the
// clients' last claims (3 leases), a lease and a margin; (5) a Do turned
// away (ErrInProgress) by another Do's claim was turned away while that
// claim could be live: not after the claim was given back (a release of it
// returned, or its caller left before the effect and Do frees the key
// before it returns) and the give-back could land, allowing for partitions,
// latency and a settle margin, nor after its lease ran out past every
// request of its Do that may have landed (see checkStalls).
//
// A failure logs the seed, the fault schedule, the command that replays the
// seed and the history.
type NemesisSuite struct {
	// Store returns a store with a client of its own that reaches the
	// backend only through the returned proxy, as Suite.Faulty. Called once
	// per client and seed. Required. A store with no network (SQLite)
	// returns a nil proxy: its clients then get no lost replies, latency or
	// partitions, only their own pauses and callers that leave.
	Store func(t *testing.T) (idempotency.Store, *faultnet.Proxy)

	// Direct returns a store that reaches the backend without a proxy, for
	// the checks after the run. Required.
	Direct func(t *testing.T) idempotency.Store

	// Lease is every Do's lease; partitions last from a quarter of it to
	// twice it. Default: 300ms.
	Lease time.Duration

	// Clients is how many clients run at once. Default: 4.
	Clients int

	// Duration is how long each seed runs (faults for its first 70%).
	// Default: 2s, or fencetest.NemesisDurationEnv.
	Duration time.Duration

	// Seeds is how many random seeds run, one after the other. Default: 2,
	// or fencetest.NemesisSeedsEnv; 1 when fencetest.NemesisSeedEnv names
	// the seed.
	Seeds int
}

// Run runs each seed as a subtest of t named seed=N.
func (s NemesisSuite) Run(t *testing.T) {
	if s.Store == nil || s.Direct == nil {
		t.Fatal("idempotencytest: NemesisSuite.Store and Direct are required")
	}
	if s.Lease <= 0 {
		s.Lease = 300 * time.Millisecond
	}
	if s.Clients <= 0 {
		s.Clients = 4
	}
	if s.Duration <= 0 {
		s.Duration = 2 * time.Second
	}
	if s.Seeds <= 0 {
		s.Seeds = 2
	}
	var seeds []uint64
	s.Duration, seeds = nemesisrun.Settings(t, "idempotencytest", s.Duration, s.Seeds)
	for _, seed := range seeds {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { s.runSeed(t, seed) })
	}
}

// The steps of Do, as the store sees them, that a lost reply or a dropped
// request can target.
const (
	nemClaim    = "claim"    // Begin
	nemArm      = "arm"      // claimed -> armed
	nemRenew    = "renew"    // armed -> armed
	nemComplete = "complete" // armed -> completed or failed
	nemRelease  = "release"  // -> released
	nemTakeover = "takeover" // a takeover (Restart)
	nemMark     = "unknown"  // armed -> unknown
	nemGet      = "get"      // Get
)

// stepOf names the step an Update makes.
func stepOf(from idempotency.State, ch idempotency.Change) string {
	switch {
	case ch.Restart:
		return nemTakeover
	case ch.State == idempotency.Released:
		return nemRelease
	case ch.State == idempotency.Unknown:
		return nemMark
	case ch.State == idempotency.Completed || ch.State == idempotency.Failed:
		return nemComplete
	case from == idempotency.Armed:
		return nemRenew
	}
	return nemArm
}

// idemFault is one entry of a run's fault schedule.
type idemFault struct {
	at     time.Duration // since the start of the run
	kind   string        // lose-reply, drop-request, latency, partition
	client int
	step   string        // lose-reply, drop-request: the step ("" for the next request)
	d      time.Duration // how long a latency or partition lasts
	lat    [2]time.Duration
}

func (f idemFault) String() string {
	switch f.kind {
	case "lose-reply", "drop-request":
		what := "lose the reply of"
		if f.kind == "drop-request" {
			what = "drop"
		}
		if f.step != "" {
			return fmt.Sprintf("%8v  client %d: %s its next %s request", f.at, f.client, what, f.step)
		}
		return fmt.Sprintf("%8v  client %d: %s its next request", f.at, f.client, what)
	case "latency":
		return fmt.Sprintf("%8v  client %d: latency %v..%v for %v", f.at, f.client, f.lat[0], f.lat[1], f.d)
	}
	return fmt.Sprintf("%8v  client %d: partitioned for %v", f.at, f.client, f.d)
}

// schedule draws a run's faults from rng, all within [0, end).
func (s NemesisSuite) schedule(rng *rand.Rand, end time.Duration) []idemFault {
	lease := s.Lease
	var (
		out  []idemFault
		busy = map[[2]int]time.Duration{} // {client, kind}: the end of its last span
	)
	between := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Int64N(int64(hi-lo)+1)) }
	steps := []string{nemClaim, nemArm, nemArm, nemRenew, nemRenew, nemComplete, nemComplete, nemComplete,
		nemRelease, nemTakeover, nemMark, nemGet}
	for at := between(0, lease/2); at < end; at += between(lease/10, lease/3) {
		f := idemFault{at: at, client: rng.IntN(s.Clients)}
		switch r := rng.IntN(100); {
		case r < 45:
			f.kind = "lose-reply"
			if rng.IntN(10) < 7 {
				f.step = steps[rng.IntN(len(steps))]
			}
		case r < 60:
			f.kind = "drop-request"
			if rng.IntN(10) < 7 {
				f.step = steps[rng.IntN(len(steps))]
			}
		case r < 72:
			f.kind = "latency"
			f.lat[0] = between(0, lease/20)
			f.lat[1] = f.lat[0] + between(0, lease/10)
			f.d = between(lease, 3*lease)
		default:
			f.kind = "partition"
			if rng.IntN(2) == 0 {
				f.d = between(lease/4, lease/2) // shorter than the lease: renewals may get through
			} else {
				f.d = between(lease+lease/4, 2*lease) // longer: the lease runs out
			}
		}
		if f.kind == "latency" || f.kind == "partition" {
			k := [2]int{f.client, 0}
			if f.kind == "partition" {
				k[1] = 1
			}
			if at < busy[k] {
				continue // one span of a kind at a time per client
			}
			f.d = min(f.d, end-at)
			busy[k] = at + f.d
		}
		out = append(out, f)
	}
	return out
}

// idemClient is one client of a run: a store behind a proxy of its own, and
// its own random source.
type idemClient struct {
	id  int
	st  idempotency.Store
	px  *faultnet.Proxy
	rng *rand.Rand

	mu   sync.Mutex
	lose map[string]int // armed by the nemesis: lose the reply of the next request of this step ("" any)
	drop map[string]int // armed by the nemesis: drop the next request of this step
}

// arm arms the client's proxy when the nemesis asked for a fault on the
// next request of step, just before that request is sent.
func (c *idemClient) arm(step string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.px == nil {
		return
	}
	if c.lose[step] > 0 {
		c.lose[step]--
		c.px.LoseReply(nil)
	}
	if c.drop[step] > 0 {
		c.drop[step]--
		c.px.DropRequest(nil)
	}
}

// disarm drops the faults the nemesis asked for and no request took.
func (c *idemClient) disarm() {
	c.mu.Lock()
	defer c.mu.Unlock()
	clear(c.lose)
	clear(c.drop)
}

// nemStore is a client's store, arming the nemesis's faults of a step
// before the request that makes it.
type nemStore struct {
	idempotency.Store
	c *idemClient
}

// Begin, Update and Get also tell the history about the claims of the Do
// they serve (see nemCall).
func (n nemStore) Begin(ctx context.Context, key, fingerprint, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	nc := callOf(ctx)
	nc.claiming(owner)
	n.c.arm(nemClaim)
	rec, created, err := n.Store.Begin(ctx, key, fingerprint, owner, lease)
	if err == nil && rec.Owner == owner && rec.State == idempotency.Claimed {
		nc.answered(owner)
	}
	return rec, created, err
}

func (n nemStore) Update(ctx context.Context, key string, from idempotency.State, fromFence fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	nc, step := callOf(ctx), stepOf(from, ch)
	switch step {
	case nemTakeover:
		nc.claiming(ch.Owner)
	case nemArm:
		nc.arming(ch.Owner)
	}
	n.c.arm(step)
	rec, err := n.Store.Update(ctx, key, from, fromFence, ch)
	switch {
	case err != nil:
	case step == nemTakeover:
		nc.answered(ch.Owner)
	case step == nemRelease:
		nc.released(ch.Owner)
	}
	return rec, err
}

func (n nemStore) Get(ctx context.Context, key string) (idempotency.Record, error) {
	n.c.arm(nemGet)
	rec, err := n.Store.Get(ctx, key)
	if err == nil {
		callOf(ctx).read(rec)
	}
	return rec, err
}

// nemNotifier is nemStore for a store that wakes waiters.
type nemNotifier struct {
	nemStore
	n idempotency.Notifier
}

func (n nemNotifier) Subscribe(key string) (<-chan struct{}, func()) { return n.n.Subscribe(key) }

func (c *idemClient) store() idempotency.Store {
	ns := nemStore{Store: c.st, c: c}
	if n, ok := c.st.(idempotency.Notifier); ok {
		return nemNotifier{ns, n}
	}
	return ns
}

// keyRing hands out a run's keys: a set of two or three, a new set every
// half lease.
type keyRing struct {
	base  string
	n     int
	every time.Duration
}

func (k keyRing) name(gen, i int) string { return fmt.Sprintf("%s-g%d-%d", k.base, gen, i) }

func (s NemesisSuite) runSeed(t *testing.T, seed uint64) {
	lease := s.Lease
	nrng := rand.New(rand.NewPCG(seed, 0))
	ring := keyRing{base: fencetest.Name("idemnem"), n: 2 + nrng.IntN(2), every: lease / 2}
	faultsEnd := s.Duration * 7 / 10
	sched := s.schedule(nrng, faultsEnd)

	clients := make([]*idemClient, s.Clients)
	for i := range clients {
		c := &idemClient{id: i, rng: rand.New(rand.NewPCG(seed, uint64(i)+1)), lose: map[string]int{}, drop: map[string]int{}}
		c.st, c.px = s.Store(t)
		clients[i] = c
	}
	// Warm up each client, so the first fault takes a request and not a
	// connection's handshake; the warm-up is not part of the history.
	for _, c := range clients {
		_, _ = c.st.Get(ctxT(t), ring.base+"-warm")
	}

	h := newIdemHistory()
	stopLag := nemesisrun.MeterLag(func(late time.Duration) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.lags = append(h.lags, nemesisrun.Lag{At: h.now(), Late: late})
	})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		s.runFaults(h, sched, clients, faultsEnd)
	}()
	pr := &prober{s: s, h: h, c: &idemClient{id: s.Clients, st: s.Direct(t)}}
	for _, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.runClient(h, c, ring, pr)
		}()
	}
	wg.Wait()
	pr.wg.Wait()
	stopLag()
	ended := time.Now()

	fail := func(format string, args ...any) {
		t.Helper()
		t.Errorf(format, args...)
	}
	h.checkStalls(fail, lease, s.stallBounds())
	direct := s.Direct(t)
	keys := h.keys()
	s.checkLive(fail, h, direct, keys, ended)
	recs := map[string]*idempotency.Record{}
	for _, k := range keys {
		rec, err := direct.Get(ctxT(t), k)
		switch {
		case err == nil:
			recs[k] = &rec
		case !errors.Is(err, fence.ErrNotFound):
			fail("reading the record of %q after the run: %v", k, err)
		}
	}
	h.check(fail, recs)
	if t.Failed() {
		var b strings.Builder
		for _, f := range sched {
			b.WriteString(f.String())
			b.WriteByte('\n')
		}
		t.Logf("nemesis seed %d: %d clients, keys %s-g*-0..%d (a set every %v), lease %v, %v with faults for %v; the fault schedule:\n%s"+
			"replay: %s",
			seed, s.Clients, ring.base, ring.n-1, ring.every, lease, s.Duration, faultsEnd, b.String(), nemesisrun.Replay(t, seed, s.Duration))
		t.Logf("history (%d calls, %d runs of the effect):\n%s", len(h.dos), len(h.runs), h.dump(recs))
		return
	}
	faults := fmt.Sprintf("%d faults scheduled", len(sched))
	if clients[0].px == nil {
		faults = "no network faults (no proxy)"
	}
	t.Logf("nemesis seed %d: %d calls of Do on %d keys, %d runs of the effect (%s), %s, %s: history checked",
		seed, len(h.dos), len(keys), len(h.runs), h.outcomes(), h.stallCounts(), faults)
}

// runFaults applies sched, then heals every proxy at end.
func (s NemesisSuite) runFaults(h *idemHistory, sched []idemFault, clients []*idemClient, end time.Duration) {
	type action struct {
		at time.Duration
		do func()
	}
	var acts []action
	for _, f := range sched {
		c := clients[f.client]
		p := c.px
		if p == nil {
			continue
		}
		switch f.kind {
		case "lose-reply", "drop-request":
			if f.step == "" {
				if f.kind == "lose-reply" {
					acts = append(acts, action{f.at, func() { p.LoseReply(nil) }})
				} else {
					acts = append(acts, action{f.at, func() { p.DropRequest(nil) }})
				}
				continue
			}
			acts = append(acts, action{f.at, func() {
				c.mu.Lock()
				if f.kind == "lose-reply" {
					c.lose[f.step]++
				} else {
					c.drop[f.step]++
				}
				c.mu.Unlock()
			}})
		case "latency":
			acts = append(acts, action{f.at, func() { p.Latency(f.lat[0], f.lat[1]) }},
				action{f.at + f.d, func() { p.Latency(0, 0) }})
		case "partition":
			var sp *nemesisrun.Span
			acts = append(acts, action{f.at, func() { sp = h.spanStart(f.client); p.Partition() }},
				action{f.at + f.d, func() { p.Heal(); h.spanEnd(sp) }})
		}
	}
	slices.SortStableFunc(acts, func(a, b action) int { return int(a.at - b.at) })
	for _, a := range acts {
		time.Sleep(time.Until(h.start.Add(a.at))) // the schedule's clock, not a synchronisation
		a.do()
	}
	time.Sleep(time.Until(h.start.Add(end)))
	for _, c := range clients {
		c.disarm()
		if c.px != nil {
			c.px.Heal()
			c.px.Latency(0, 0)
		}
	}
	h.mu.Lock()
	h.spans.EndClients(h.now())
	h.mu.Unlock()
}

// runClient calls Do until the run's Duration has passed.
func (s NemesisSuite) runClient(h *idemHistory, c *idemClient, ring keyRing, pr *prober) {
	lease := s.Lease
	st := c.store()
	for time.Since(h.start) < s.Duration {
		gen := int(time.Since(h.start) / ring.every)
		if gen > 0 && c.rng.IntN(3) == 0 {
			// A key of one of the last six sets: a replay, a takeover
			// once its owner's lease ran out, or a wait for it.
			gen -= 1 + c.rng.IntN(min(gen, 6))
		}
		key := ring.name(gen, c.rng.IntN(ring.n))
		pr.after(s.call(h, c, st, key))
		time.Sleep(time.Duration(c.rng.Int64N(int64(lease / 10)))) // pacing, not a synchronisation
	}
}

// call makes one Do with choices drawn from the client's random source and
// returns it.
func (s NemesisSuite) call(h *idemHistory, c *idemClient, st idempotency.Store, key string) *doOp {
	lease := s.Lease
	rng := c.rng
	between := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Int64N(int64(hi-lo)+1)) }
	var p effectPlan
	switch r := rng.IntN(100); {
	case r < 50:
	case r < 72:
		p.pause = between(0, lease/3)
	case r < 85:
		p.pause = between(lease/3, lease)
	default:
		p.pause = between(lease+lease/10, 2*lease) // past the lease: renewals must keep it
	}
	p.sleeps = rng.IntN(2) == 0
	switch r := rng.IntN(100); {
	case r < 50:
		p.outcome = outSuccess
	case r < 60:
		p.outcome = outFailed
	case r < 75:
		p.outcome = outNotSent
	case r < 83:
		p.outcome = outAmbiguousDone
	default:
		p.outcome = outAmbiguous
	}
	op := &doOp{client: c.id, key: key, plan: p, wait: rng.IntN(4) == 0, reconcile: rng.IntN(3) > 0}
	bound := 8 * lease
	if rng.IntN(100) < 22 {
		bound = between(0, lease+lease/2) // the caller leaves mid-Do
		op.leaves = bound
	} else if r := rng.IntN(100); r < 12 {
		// The caller leaves while Do holds the claim, before the effect.
		op.leaveAt = leaveClaim
		if r < 4 {
			op.leaveAt = leaveArm
		}
	}
	o := &idempotency.Options{
		Owner:           fmt.Sprintf("c%d", c.id),
		Lease:           lease,
		Retention:       time.Hour,
		Wait:            op.wait,
		CompleteTimeout: between(lease, 3*lease),
	}
	s.do(h, op, st, o, bound)
	return op
}

// do calls Do for op with o, its context ending after bound (or when the
// nemesis makes its caller leave), and records it.
func (s NemesisSuite) do(h *idemHistory, op *doOp, st idempotency.Store, o *idempotency.Options, bound time.Duration) {
	op.completeTimeout = o.CompleteTimeout
	h.begin(op)
	if op.reconcile {
		o.Reconcile = h.reconcile(op)
	}
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	ctx = context.WithValue(ctx, nemCallKey{}, &nemCall{h: h, op: op, leave: cancel})
	res, err := idempotency.Do(ctx, st, op.key, "fp", h.effect(op), o)
	h.end(op, res, err)
}

// checkLive calls Do, waiting, on every key through a Direct store once the
// clients are done and the faults healed, and checks that each returns within
// the settle time of the clients' last claims (CompleteTimeout, at most 3
// leases), a lease, and a margin: a result, ErrUnknown or a replayed failure.
func (s NemesisSuite) checkLive(fail func(string, ...any), h *idemHistory, st idempotency.Store, keys []string, ended time.Time) {
	lease := s.Lease
	deadline := ended.Add(3*lease + lease + max(lease, 2*time.Second))
	for _, k := range keys {
		op := &doOp{client: -1, key: k, plan: effectPlan{outcome: outSuccess}, wait: true}
		h.begin(op)
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		res, err := idempotency.Do(ctx, st, k, "fp", h.effect(op), &idempotency.Options{Owner: "live", Lease: lease, Retention: time.Hour, Wait: true})
		cancel()
		h.end(op, res, err)
		if err != nil && !errors.Is(err, idempotency.ErrUnknown) && !errors.Is(err, idempotency.ErrFailed) {
			fail("liveness: a Do on %q %v after the clients ended and the faults healed, waiting for other owners: %v",
				k, time.Since(ended).Round(time.Millisecond), err)
		}
	}
}
