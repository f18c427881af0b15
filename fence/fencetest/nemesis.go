package fencetest

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
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/nemesisrun"
)

// NemesisSeedEnv names the environment variable that replays one seed of the
// NemesisSuite: the same fault schedule and, per client, the same sequence of
// random decisions (the clients run concurrently, so the interleaving of
// their calls may still differ).
const NemesisSeedEnv = nemesisrun.SeedEnv

// NemesisDurationEnv names the environment variable that sets the length of
// each seed's run (a time.Duration, such as 2m), for a soak run.
const NemesisDurationEnv = nemesisrun.DurationEnv

// NemesisSeedsEnv names the environment variable that sets how many random
// seeds run, for a soak run.
const NemesisSeedsEnv = nemesisrun.SeedsEnv

// NemesisSuite runs random operations from several clients on a few lock
// names under combined faults, records the history and checks it. Point cases
// test one fault at a time; the bugs they miss need two at once (a lost reply
// then a recognition on the next send, state deleted between a grant and a
// renewal). Each seed's run:
//
//   - Clients (each an acquirer and a writer behind proxies of their own)
//     call TryAcquire, Acquire with a short wait, Renew and Release on two or
//     three names, write the name's key with the token they hold or with one
//     they held before (a paused holder), read it, and sometimes stop
//     renewing for longer than the ttl and then write (a frozen client).
//     Some waits run fence.Hold instead, whose work writes with its token,
//     sometimes pauses past the ttl while Hold renews, and sometimes panics
//     (the lease counts as renewed until Hold returned, and released by it).
//   - A nemesis, from the same seed, loses the reply of a client's next
//     request, adds latency with jitter, partitions a client for less and for
//     more than the ttl, and deletes a name's state (DeleteState). Faults stop
//     at 70% of the run; the rest is quiet.
//
// Checked after the run: (1) per name, no token is granted twice, and a grant
// that completed before another was asked for has the smaller token; (2) no
// two leases of one name have live contexts at one moment (tested at each
// grant, from the grant's return; a lease being released or whose state may
// have been deleted since it was asked for, by a DeleteState that returned
// after that, is left out), and a Renew asked for after a
// newer grant of the name had returned does not succeed; (3) each key's
// writes and reads are linearizable as a fenced register (porcupine): a write
// with ErrStale or ErrInvalid did not happen, a write with ErrUnknown or any
// other error may have happened at any time after it was sent, and a read
// returns what some linearization holds; (4) once the faults have stopped and
// every lease was released, a Direct TryAcquire of each name succeeds within
// ShortTTL + ExpiryLag + a margin; (5) while the run goes on, no TryAcquire
// is refused (ErrHeld) at a moment when nothing could hold its name: no
// lease that was neither released nor a ttl and ExpiryLag past its last
// renewal that may have landed (a renewal whose reply was lost may land as
// late as its client's partition heals), and no grant call of unknown
// outcome (a lost reply, an Acquire that gave up) whose give-back may not
// have landed yet: a third of the ttl and ExpiryLag after its call returned
// and every partition of its client and not-run window in between had
// ended (with SplitVotes, also no other TryAcquire refused whose give-back
// may not have landed yet); a failure says how late the test process ran
// around it (a timer firing late on a loaded machine). A waiter that
// left without its leave reaching the backend, or a TryAcquire's cleanup
// that gave up before the grant request it cleans up after landed, leaves
// the name held by nobody for a ttl and fails it. So that the name is tried
// in that stretch, the Direct acquirer tries it (up to three times,
// releasing a grant at once) within a third of the ttl after each such
// call's give-back bound has passed.
//
// A failure logs the seed, the fault schedule and the command that replays
// the seed (NemesisSeedEnv).
type NemesisSuite struct {
	// Acquirer returns an acquirer with a client of its own that reaches the
	// backend only through the returned proxy, as AcquirerSuite.Faulty.
	// Called once per client and seed. Required. A backend with no network
	// (an embedded database) returns a nil proxy: its clients then get no
	// lost replies, latency or partitions, only deletions and their own
	// pauses.
	Acquirer func(t *testing.T) (fence.Acquirer, *faultnet.Proxy)

	// Writer returns a fenced writer with a client of its own behind the
	// returned proxy (nil as for Acquirer). Its writes are checked, and its
	// reads when it is a fence.Reader. Default: nil, lease checks only.
	Writer func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy)

	// AcquirerProxies and WriterProxies, when set, are used instead of
	// Acquirer and Writer, for a backend of several servers (a Redis
	// Cluster, Redlock's nodes, the members of an etcd or NATS cluster):
	// each returns an acquirer or a writer whose client reaches every
	// server, or each of its connections, only through a proxy of its own
	// (an empty list for no network, as a nil proxy). With either set, each
	// fault on a client takes all of the proxies it concerns, in one fault
	// in three, as it takes the one proxy of Acquirer or Writer, or else
	// only one of them: a lost reply on one connection of the acquirer's
	// (or the writer's), latency or a partition on one proxy of the
	// client's (the acquirer's first, then the writer's): a client cut
	// from one Redlock node, from the etcd leader only, from the NATS node
	// it is connected to. Which proxies a fault takes comes from a random
	// source of its own, so a seed's fault schedule (kinds, clients and
	// times) is the one it has with Acquirer and Writer. Default: nil.
	AcquirerProxies func(t *testing.T) (fence.Acquirer, []*faultnet.Proxy)
	WriterProxies   func(t *testing.T) (fence.FencedWriter, []*faultnet.Proxy)

	// Nodes and StopNode, when both are set, add server crashes to each
	// seed's run: StopNode stops server i of the backend (0 <= i < Nodes: a
	// Redlock node, a cluster member) as a crash would and returns a
	// function that starts it again. The nemesis stops one server at a time,
	// each for one to two ttls, about one crash every four ttls of the part
	// of the run with faults, at times and on servers drawn from a random
	// source of its own (the seed's other faults are unchanged). It calls
	// both from a goroutine of its own (report with t.Error, not t.Fatal).
	// Default: 0, nil.
	Nodes    int
	StopNode func(t *testing.T, i int) (start func())

	// Direct returns an acquirer and a writer (nil when Writer is nil) that
	// reach the backend without a proxy, for the checks after the run.
	// Required.
	Direct func(t *testing.T) (fence.Acquirer, fence.FencedWriter)

	// DeleteState, when set, removes every piece of state the backend keeps
	// for a lock name, as AcquirerSuite.DeleteState, and leaves the writer's
	// keys alone (a name is also a key: its fence must stay). The nemesis
	// calls it, from a goroutine of its own (report with t.Error, not
	// t.Fatal), while clients may hold the name or it may have no state.
	// Default: nil, no deletions.
	DeleteState func(t *testing.T, name string)

	// ShortTTL is every lease's ttl; partitions last from a quarter of it to
	// twice it. Default: 300ms.
	ShortTTL time.Duration

	// ExpiryLag is how long past a lease's ttl the backend may still hold a
	// name nobody renewed, as AcquirerSuite.ExpiryLag. Default: 0.
	ExpiryLag time.Duration

	// SplitVotes is set for a backend that grants a name on a majority of
	// servers, each of which locks it for the first grant request it runs
	// (Redlock): contenders that split the servers between them (three on
	// three nodes, two while a node is down) are all refused, although none
	// holds the name, and each keeps its minority until its give-back lands.
	// The stall check then takes a refused TryAcquire as a possible holder
	// of its name for the other calls, from its call until its give-back
	// may have landed (as for a grant call of unknown outcome); a refusal
	// with no other call to account for it still fails. Default: false.
	SplitVotes bool

	// Clients is how many clients run at once. Default: 4.
	Clients int

	// Duration is how long each seed runs (faults for its first 70%).
	// Default: 4s, or NemesisDurationEnv.
	Duration time.Duration

	// Seeds is how many random seeds run, one after the other. Default: 3,
	// or NemesisSeedsEnv; 1 when NemesisSeedEnv names the seed.
	Seeds int
	// NotRun, when set, makes the backend answer every request, for about
	// d, with a reply that says the step did not run (Redis BUSY while a
	// script runs past busy-reply-threshold, LOADING, a pool with no free
	// connection), and returns when that window has ended. The nemesis calls
	// it, from a goroutine of its own (report with t.Error), for windows of
	// a tenth to half of ShortTTL: a step answered so is not done, and one
	// that gives a name back (a waiter's leave) must be sent again. Default:
	// nil, no such windows.
	NotRun func(t *testing.T, d time.Duration)
}

// nemesisNamesMax is the most lock names a run uses; each name is also a key.
const nemesisNamesMax = 3

// Run runs each seed as a subtest of t named seed=N.
func (s NemesisSuite) Run(t *testing.T) {
	if (s.Acquirer == nil && s.AcquirerProxies == nil) || s.Direct == nil {
		t.Fatal("fencetest: NemesisSuite.Acquirer (or AcquirerProxies) and Direct are required")
	}
	if s.ShortTTL <= 0 {
		s.ShortTTL = 300 * time.Millisecond
	}
	if s.Clients <= 0 {
		s.Clients = 4
	}
	if s.Duration <= 0 {
		s.Duration = 4 * time.Second
	}
	if s.Seeds <= 0 {
		s.Seeds = 3
	}
	var seeds []uint64
	s.Duration, seeds = nemesisrun.Settings(t, "fencetest", s.Duration, s.Seeds)
	for _, seed := range seeds {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { s.runSeed(t, seed) })
	}
}

// fault is one entry of a run's fault schedule.
type fault struct {
	at     time.Duration // since the start of the run
	kind   string        // lose-reply, latency, partition, delete, not-run
	client int
	writer bool          // the client's writer proxy (lose-reply), not its acquirer's
	call   string        // lose-reply: the kind of call whose reply is lost ("" for the next request)
	d      time.Duration // how long a latency or partition lasts
	lat    [2]time.Duration
	name   string // delete

	// With AcquirerProxies or WriterProxies: one is set when the fault
	// takes only the proxy at index proxy (resolved when the clients are
	// made: of the acquirer's proxies for a lost reply, of the writer's
	// with writer, of the acquirer's then the writer's for latency and a
	// partition); otherwise it takes all of them.
	one   bool
	proxy int

	node int // crash: the server stopped (the client is unused)
}

func (f fault) String() string {
	switch f.kind {
	case "lose-reply":
		if f.call != "" {
			return fmt.Sprintf("%8v  client %d: lose the reply of its next %s", f.at, f.client, f.call)
		}
		which := "acquirer"
		if f.writer {
			which = "writer"
		}
		return fmt.Sprintf("%8v  client %d: lose the reply of the next request on its %s proxy", f.at, f.client, which)
	case "latency":
		return fmt.Sprintf("%8v  client %d: latency %v..%v for %v", f.at, f.client, f.lat[0], f.lat[1], f.d)
	case "partition":
		return fmt.Sprintf("%8v  client %d: partitioned for %v", f.at, f.client, f.d)
	case "not-run":
		return fmt.Sprintf("%8v  the backend runs no request for %v", f.at, f.d)
	case "hold-request":
		return fmt.Sprintf("%8v  client %d: hold its next TryAcquire's request for %v, past the call's deadline", f.at, f.client, f.d)
	case "crash":
		return fmt.Sprintf("%8v  server %d stopped for %v", f.at, f.node, f.d)
	}
	return fmt.Sprintf("%8v  delete the state of %q", f.at, f.name)
}

// crashes draws the server crashes of a run with Nodes and StopNode, all
// within [0, end), from a source of its own (the seed's stream 1<<63+1).
func (s NemesisSuite) crashes(seed uint64, end time.Duration) []fault {
	if s.Nodes <= 0 || s.StopNode == nil {
		return nil
	}
	ttl := s.ShortTTL
	rng := rand.New(rand.NewPCG(seed, 1<<63+1))
	between := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Int64N(int64(hi-lo)+1)) }
	var out []fault
	for at := between(ttl/2, 2*ttl); at < end; {
		f := fault{at: at, kind: "crash", node: rng.IntN(s.Nodes), d: between(ttl, 2*ttl)}
		if at+f.d > end {
			// A crash is never cut short by the end of the faults: a node
			// that comes back empty before a ttl has passed breaks the
			// condition Redlock states (its grants may be repeated).
			break
		}
		out = append(out, f)
		at += f.d + between(ttl, 4*ttl)
	}
	return out
}

// onProxies is String with the proxies a fault takes, for a run with
// AcquirerProxies or WriterProxies.
func (f fault) onProxies() string {
	switch {
	case f.kind == "delete" || f.kind == "crash":
		return f.String()
	case f.one:
		return fmt.Sprintf("%s [its proxy %d only]", f, f.proxy)
	}
	return f.String() + " [all its proxies]"
}

// multiProxy reports whether the clients may have several proxies each.
func (s NemesisSuite) multiProxy() bool { return s.AcquirerProxies != nil || s.WriterProxies != nil }

// pickProxies draws, for a run with several proxies per client, which
// proxies each fault takes (fault.one, fault.proxy), from a source of its
// own (the seed's stream 1<<63), once the clients' proxies are known.
func (s NemesisSuite) pickProxies(seed uint64, sched []fault, clients []*nemClient) {
	rng := rand.New(rand.NewPCG(seed, 1<<63))
	for i := range sched {
		f := &sched[i]
		if f.kind == "delete" || f.kind == "crash" {
			continue
		}
		if set := f.set(clients[f.client]); rng.IntN(3) > 0 && len(set) > 1 {
			f.one, f.proxy = true, rng.IntN(len(set))
		}
	}
}

// set returns the proxies of c that f concerns: the acquirer's, or the
// writer's (a Write's, or the next request's on the writer), for a lost
// reply; the acquirer's then the writer's for latency and a partition.
func (f fault) set(c *nemClient) []*faultnet.Proxy {
	switch {
	case f.kind != "lose-reply":
		return append(slices.Clip(c.ap), c.wp...)
	case f.call == "Write" || (f.call == "" && f.writer):
		return c.wp
	}
	return c.ap
}

// takes returns the proxies of c that f takes: its set, or only one of
// them (fault.one).
func (f fault) takes(c *nemClient) []*faultnet.Proxy {
	set := f.set(c)
	if f.one {
		return set[f.proxy : f.proxy+1]
	}
	return set
}

// hasWriter reports whether the clients have writers.
func (s NemesisSuite) hasWriter() bool { return s.Writer != nil || s.WriterProxies != nil }

// schedule draws a run's faults from rng, all within [0, end).
func (s NemesisSuite) schedule(rng *rand.Rand, names []string, end time.Duration) []fault {
	ttl := s.ShortTTL
	var (
		out  []fault
		busy = map[[2]int]time.Duration{} // {client, kind}: the end of its last span
	)
	between := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Int64N(int64(hi-lo)+1)) }
	for at := between(0, ttl/2); at < end; at += between(ttl/10, ttl/3) {
		f := fault{at: at, client: rng.IntN(s.Clients)}
		switch r := rng.IntN(100); {
		case r < 50:
			// Three in ten lost replies are of the next request, whatever
			// it is; the others are of the client's next call of one kind
			// (a Renew more often than not), the proxy armed by the client
			// just before that call.
			f.kind = "lose-reply"
			f.writer = s.hasWriter() && rng.IntN(5) < 2
			if rng.IntN(10) < 7 {
				f.call = []string{"Renew", "Renew", "Renew", "Renew", "TryAcquire", "TryAcquire", "Release", "Write"}[rng.IntN(8)]
				if f.call == "Write" && !s.hasWriter() {
					f.call = "Renew"
				}
				if f.call == "TryAcquire" && rng.IntN(4) > 0 {
					// Most of these hold the request instead, in a
					// partition of the client's acquirer proxy that
					// outlasts the call's short deadline: the grant
					// may land after the call and its cleanup.
					f.kind, f.call, f.writer = "hold-request", "", false
					f.d = between(ttl/2, ttl)
				}
			}
		case r < 58:
			f.kind = "latency"
			f.lat[0] = between(0, ttl/20)
			f.lat[1] = f.lat[0] + between(0, ttl/10)
			f.d = between(ttl, 3*ttl)
		case r < 75:
			f.kind = "partition"
			if rng.IntN(2) == 0 {
				f.d = between(ttl/4, ttl/2) // shorter than the ttl: the lease may survive
			} else {
				f.d = between(ttl+ttl/4, 2*ttl) // longer: the lease is lost
			}
		case r >= 88 && s.NotRun != nil:
			// A window of replies that say the step did not run, in place
			// of one deletion in two.
			f.kind = "not-run"
			f.d = min(between(ttl/10, ttl/2), end-at)
		default:
			if s.DeleteState == nil {
				continue
			}
			f.kind = "delete"
			f.name = names[rng.IntN(len(names))]
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

// nemClient is one client of a run: an acquirer and a writer, each behind
// proxies of its own (one each, but with AcquirerProxies or WriterProxies),
// and its own random source.
type nemClient struct {
	id     int
	a      fence.Acquirer
	ap, wp []*faultnet.Proxy // the acquirer's and the writer's proxies; none for no network
	w      fence.FencedWriter
	r      fence.Reader
	rng    *rand.Rand
	held   map[string]*leaseRec

	mu   sync.Mutex
	lose map[string][]fault // armed by the nemesis: lose the reply of the next call of this kind
	// holds: armed by the nemesis: hold the request of the next
	// TryAcquire for this long (hold-request).
	holds []time.Duration

	old    []*leaseRec // leases it held before, for a paused holder's writes
	writes int

	// probe: called after a grant call of unknown outcome (prober.after).
	probe func(op *nemOp)
}

func (s NemesisSuite) runSeed(t *testing.T, seed uint64) {
	ttl := s.ShortTTL
	nrng := rand.New(rand.NewPCG(seed, 0))
	names := make([]string, 2+nrng.IntN(nemesisNamesMax-1))
	for i := range names {
		names[i] = Name(fmt.Sprintf("nemesis%d", i))
	}
	faultsEnd := s.Duration * 7 / 10
	sched := s.schedule(nrng, names, faultsEnd)

	clients := make([]*nemClient, s.Clients)
	for i := range clients {
		c := &nemClient{id: i, rng: rand.New(rand.NewPCG(seed, uint64(i)+1)), held: map[string]*leaseRec{}, lose: map[string][]fault{}}
		var ap, wp *faultnet.Proxy
		switch {
		case s.AcquirerProxies != nil:
			c.a, c.ap = s.AcquirerProxies(t)
		default:
			c.a, ap = s.Acquirer(t)
		}
		switch {
		case s.WriterProxies != nil:
			c.w, c.wp = s.WriterProxies(t)
		case s.Writer != nil:
			c.w, wp = s.Writer(t)
		}
		if ap != nil {
			c.ap = []*faultnet.Proxy{ap}
		}
		if wp != nil {
			c.wp = []*faultnet.Proxy{wp}
		}
		c.r, _ = c.w.(fence.Reader)
		clients[i] = c
	}
	if s.multiProxy() {
		s.pickProxies(seed, sched, clients)
	}
	if crashes := s.crashes(seed, faultsEnd); len(crashes) > 0 {
		sched = append(sched, crashes...)
		slices.SortStableFunc(sched, func(a, b fault) int { return int(a.at - b.at) })
	}
	// Warm up each client, so the first fault takes a request and not a
	// connection's handshake; the warm-up is not part of the history.
	for _, c := range clients {
		if l, err := c.a.TryAcquire(ctxT(t), Name("warm"), ttl); err == nil {
			_ = l.Release(ctxT(t))
		}
		if c.w != nil {
			_ = c.w.Write(ctxT(t), Name("warm"), []byte("warm"), 1)
		}
	}

	direct, dw := s.Direct(t)
	h := newHistory()
	pr := &prober{s: s, h: h, a: direct, id: s.Clients}
	for _, c := range clients {
		c.probe = pr.after
	}
	stopLag := nemesisrun.MeterLag(func(late time.Duration) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.lags = append(h.lags, nemesisrun.Lag{At: h.now(), Late: late})
	})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		s.runFaults(t, h, sched, clients, faultsEnd)
	}()
	for _, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.runClient(h, c, names)
		}()
	}
	wg.Wait()
	pr.wg.Wait()
	stopLag()
	ended := time.Now()
	if r, ok := dw.(fence.Reader); ok {
		for _, name := range names {
			op := h.begin(-1, "Read", name, 0, "")
			v, tok, err := r.Read(ctxT(t), name)
			h.read(op, string(v), tok, err)
		}
	}

	fail := func(format string, args ...any) {
		t.Helper()
		t.Errorf(format, args...)
	}
	h.check(t, fail)
	h.checkStalls(fail, ttl, s.stallBounds(), s.SplitVotes)
	s.checkLive(t, fail, direct, names, ended)
	if t.Failed() {
		var b strings.Builder
		for _, f := range sched {
			if s.multiProxy() {
				b.WriteString(f.onProxies())
			} else {
				b.WriteString(f.String())
			}
			b.WriteByte('\n')
		}
		t.Logf("nemesis seed %d: %d clients, names %q, ttl %v, %v with faults for %v; the fault schedule:\n%s"+
			"replay: %s",
			seed, s.Clients, names, ttl, s.Duration, faultsEnd, b.String(), nemesisrun.Replay(t, seed, s.Duration))
		t.Logf("history (%d operations):\n%s", len(h.ops), h.dump())
		return
	}
	crashes := ""
	if s.Nodes > 0 && s.StopNode != nil {
		n := 0
		for _, f := range sched {
			if f.kind == "crash" {
				n++
			}
		}
		crashes = fmt.Sprintf(", %d of them server crashes", n)
	}
	t.Logf("nemesis seed %d: %d operations (%.0f/s), %d grants, %d faults scheduled (%.1f/s in the %v with faults%s): history checked",
		seed, len(h.ops), float64(len(h.ops))/s.Duration.Seconds(), h.grants(), len(sched), float64(len(sched))/faultsEnd.Seconds(), faultsEnd, crashes)
}

// runFaults applies sched, then heals every proxy at end.
func (s NemesisSuite) runFaults(t *testing.T, h *history, sched []fault, clients []*nemClient, end time.Duration) {
	type action struct {
		at time.Duration
		do func()
	}
	var acts []action
	var notRuns sync.WaitGroup
	defer notRuns.Wait()
	for _, f := range sched {
		c := clients[f.client]
		switch f.kind {
		case "lose-reply":
			if f.call != "" {
				acts = append(acts, action{f.at, func() {
					c.mu.Lock()
					c.lose[f.call] = append(c.lose[f.call], f)
					c.mu.Unlock()
				}})
				continue
			}
			for _, p := range f.takes(c) {
				acts = append(acts, action{f.at, func() { p.LoseReply(nil) }})
			}
		case "hold-request":
			acts = append(acts, action{f.at, func() {
				c.mu.Lock()
				c.holds = append(c.holds, f.d)
				c.mu.Unlock()
			}})
		case "latency":
			acts = append(acts, action{f.at, func() {
				for _, p := range f.takes(c) {
					p.Latency(f.lat[0], f.lat[1])
				}
			}}, action{f.at + f.d, func() {
				for _, p := range f.takes(c) {
					p.Latency(0, 0)
				}
			}})
		case "partition":
			var sp *nemesisrun.Span
			acts = append(acts, action{f.at, func() {
				sp = h.spanStart(f.client)
				for _, p := range f.takes(c) {
					p.Partition()
				}
			}}, action{f.at + f.d, func() {
				for _, p := range f.takes(c) {
					p.Heal()
				}
				h.spanEnd(sp)
			}})
		case "not-run":
			acts = append(acts, action{f.at, func() {
				notRuns.Add(1)
				go func() {
					defer notRuns.Done()
					sp := h.spanStart(-1)
					s.NotRun(t, f.d)
					h.spanEnd(sp)
				}()
			}})
		case "crash":
			var start func()
			acts = append(acts, action{f.at, func() { start = s.StopNode(t, f.node) }},
				action{f.at + f.d, func() {
					if start != nil {
						start()
					}
				}})
		case "delete":
			acts = append(acts, action{f.at, func() {
				op := h.deleting(f.name)
				s.DeleteState(t, f.name)
				h.end(op, nil)
			}})
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
		for _, p := range append(slices.Clip(c.ap), c.wp...) {
			p.Heal()
			p.Latency(0, 0)
		}
	}
	h.mu.Lock()
	h.spans.EndClients(h.now())
	h.mu.Unlock()
}

// runClient makes random calls until the run's Duration has passed, then
// releases what it holds.
func (s NemesisSuite) runClient(h *history, c *nemClient, names []string) {
	ttl := s.ShortTTL
	for time.Since(h.start) < s.Duration {
		s.step(h, c, names)
		c.pause(time.Duration(c.rng.Int64N(int64(ttl / 10)))) // pacing
	}
	for _, name := range sortedKeys(c.held) {
		s.release(h, c, c.held[name])
	}
}

// opCtx bounds one call: a partition longer than the ttl outlasts it.
func (s NemesisSuite) opCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), s.ShortTTL+s.ShortTTL/2)
}

// step makes one random call, more often on a name the client holds.
func (s NemesisSuite) step(h *history, c *nemClient, names []string) {
	ttl := s.ShortTTL
	// A lease whose context ended is no longer held; keep it for the paused
	// holder's writes.
	for _, n := range sortedKeys(c.held) {
		if l := c.held[n]; l.lease.Context().Err() != nil {
			if c.rng.IntN(4) == 0 {
				s.release(h, c, l) // a Release of a lease already lost
			} else {
				delete(c.held, n)
				c.old = append(c.old, l)
			}
		}
	}
	// A holder renews each lease at a jittered third or so of its ttl,
	// unless it chose to let it lapse.
	for _, n := range sortedKeys(c.held) {
		if l := c.held[n]; time.Now().After(l.nextRenew) {
			s.renew(h, c, l)
			return
		}
	}
	name := names[c.rng.IntN(len(names))]
	if held := sortedKeys(c.held); len(held) > 0 && c.rng.IntN(10) < 6 {
		name = held[c.rng.IntN(len(held))]
	}
	l := c.held[name]
	r := c.rng.IntN(100)
	if l == nil {
		switch {
		case r < 60:
			// A client waits (Acquire) only while it holds nothing: the
			// wait would hold up its renewals.
			wait := time.Duration(0)
			if len(c.held) == 0 && c.rng.IntN(3) == 0 {
				wait = ttl/4 + time.Duration(c.rng.Int64N(int64(ttl/2)))
				if c.rng.IntN(3) == 0 {
					s.hold(h, c, name, wait)
					return
				}
			}
			s.grant(h, c, name, wait)
		case r < 80:
			s.read(h, c, name)
		case r < 95:
			s.writeOld(h, c)
		default:
			c.pause(time.Duration(c.rng.Int64N(int64(ttl / 2)))) // idle
		}
		return
	}
	switch {
	case r < 5:
		// Stops renewing this lease for longer than its ttl, then writes
		// with its token and renews.
		l.nextRenew = time.Now().Add(ttl + time.Duration(c.rng.Int64N(int64(ttl/2))))
		l.lapsed = true
	case r < 11:
		s.release(h, c, l)
	case r < 60:
		s.write(h, c, name, l.token)
	case r < 70:
		s.writeOld(h, c)
	case r < 85:
		s.read(h, c, name)
	case r < 88:
		// A frozen client: holds past the ttl without renewing, then writes
		// with its token and renews.
		time.Sleep(ttl + time.Duration(c.rng.Int64N(int64(ttl/2))))
		s.write(h, c, name, l.token)
		s.renew(h, c, l)
	default:
		c.pause(time.Duration(c.rng.Int64N(int64(ttl / 4)))) // idle
	}
}

// pause sleeps for d, or until a held lease is due for renewal if that is
// sooner: only a frozen client misses its renewals.
func (c *nemClient) pause(d time.Duration) {
	until := time.Now().Add(d)
	for _, l := range c.held {
		if l.nextRenew.Before(until) {
			until = l.nextRenew
		}
	}
	time.Sleep(time.Until(until)) // pacing, not a synchronisation
}

// writeOld writes with a token the client held before: a paused holder.
func (s NemesisSuite) writeOld(h *history, c *nemClient) {
	if len(c.old) == 0 {
		return
	}
	old := c.old[c.rng.IntN(len(c.old))]
	s.write(h, c, old.name, old.token)
}

// renewLater sets when l is renewed next, after a grant or a renewal that
// returned err: a jittered sixth to a third of the ttl from now. After an
// unknown outcome, it renews again a tenth of the ttl later or more and,
// when the lease says when its local deadline is, in the last two thirds of
// the time left before it (a later send that may find the lost one done).
// After a renewal, two holders in three stop renewing and let the lease run
// out (they finish their work in the time left).
func (s NemesisSuite) renewLater(c *nemClient, l *leaseRec, renewed bool, err error) {
	ttl := s.ShortTTL
	now := time.Now()
	switch {
	case err != nil && !errors.Is(err, fence.ErrLost):
		lo, hi := ttl/10, ttl/2
		if d, ok := l.lease.(interface{ LocalDeadline() time.Time }); ok {
			left := d.LocalDeadline().Sub(now)
			lo, hi = max(lo, left/3), max(lo, left-ttl/30)
		}
		l.nextRenew = now.Add(lo + time.Duration(c.rng.Int64N(int64(hi-lo)+1)))
	case renewed && c.rng.IntN(3) > 0:
		l.nextRenew = now.Add(time.Hour)
	default:
		l.nextRenew = now.Add(ttl/6 + time.Duration(c.rng.Int64N(int64(ttl/6))))
	}
}

// armLose arms the client's proxies that the fault takes (all of the
// acquirer's, or of the writer's for a Write, unless the fault takes only
// one) to lose the reply of the call about to be made when the nemesis asked
// for a lost reply of the next call of kind.
func (c *nemClient) armLose(kind string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if q := c.lose[kind]; len(q) > 0 {
		c.lose[kind] = q[1:]
		for _, p := range q[0].takes(c) {
			p.LoseReply(nil)
		}
	}
}

// disarm drops the lost replies the nemesis asked for and no call took.
func (c *nemClient) disarm() {
	c.mu.Lock()
	defer c.mu.Unlock()
	clear(c.lose)
	c.holds = nil
}

// holdNext partitions the client's acquirer proxy for the duration of an
// armed hold-request, if there is one, and reports whether it did.
func (c *nemClient) holdNext(h *history) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.holds) == 0 || len(c.ap) == 0 {
		return false
	}
	d := c.holds[0]
	c.holds = c.holds[1:]
	sp := h.spanStart(c.id)
	for _, p := range c.ap {
		p.Partition()
	}
	time.AfterFunc(d, func() {
		for _, p := range c.ap {
			p.Heal()
		}
		h.spanEnd(sp)
	})
	return true
}

func (s NemesisSuite) grant(h *history, c *nemClient, name string, wait time.Duration) {
	kind, call := "TryAcquire", c.a.TryAcquire
	ctx, cancel := s.opCtx()
	if wait > 0 {
		cancel()
		ctx, cancel = context.WithTimeout(context.Background(), wait)
		kind, call = "Acquire", c.a.Acquire
	}
	if wait == 0 && (c.rng.IntN(4) == 0 || c.holdNext(h)) {
		// A caller with a short deadline: a partition outlasts it, and
		// the grant request may land after the call returned.
		cancel()
		ctx, cancel = context.WithTimeout(context.Background(), s.ShortTTL/5)
	}
	defer cancel()
	if wait == 0 {
		c.armLose("TryAcquire")
	}
	op := h.begin(c.id, kind, name, 0, "")
	l, err := call(ctx, name, s.ShortTTL)
	if rec := h.granted(op, l, err); rec != nil {
		c.held[name] = rec
		s.renewLater(c, rec, false, nil)
	} else if c.probe != nil && inDoubt(op) {
		c.probe(op)
	}
}

// holdPanic is the panic of a Hold's work that the nemesis raises and
// recovers.
type holdPanic struct{}

// waitBound bounds the wait of Acquire alone: Hold's renewals and work go on
// without a deadline.
type waitBound struct {
	fence.Acquirer
	wait time.Duration
}

func (w waitBound) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	ctx, cancel := context.WithTimeout(ctx, w.wait)
	defer cancel()
	return w.Acquirer.Acquire(ctx, name, ttl)
}

// errHeldRelease is the outcome recorded for the release inside a Hold that
// returned an error or panicked: Hold does not say whether it landed.
var errHeldRelease = errors.New("fencetest: the release inside Hold may not have landed")

// hold runs fence.Hold on name, waiting up to wait for the grant, with work
// that writes with the lease's token, sometimes pauses past the ttl (Hold
// renews meanwhile), and sometimes panics (recovered here). The lease is
// recorded as renewed until Hold returned, and released by Hold: a Hold
// that keeps renewing after its work ended holds the name for nobody, which
// the stall check and the end-of-run check report.
func (s NemesisSuite) hold(h *history, c *nemClient, name string, wait time.Duration) {
	ttl, b := s.ShortTTL, s.stallBounds()
	op := h.begin(c.id, "Acquire", name, 0, "")
	var rec *leaseRec
	var rop *nemOp
	panicked := false
	err := func() (err error) {
		defer func() {
			if p := recover(); p != nil {
				if _, ok := p.(holdPanic); !ok {
					panic(p)
				}
				panicked = true
			}
		}()
		return fence.Hold(context.Background(), waitBound{c.a, wait}, name, ttl, func(ctx context.Context, l fence.Lease) error {
			if rec = h.granted(op, l, nil); rec == nil {
				return nil
			}
			for range 1 + c.rng.IntN(2) {
				s.write(h, c, name, l.Token())
			}
			if c.rng.IntN(3) == 0 {
				time.Sleep(ttl + time.Duration(c.rng.Int64N(int64(ttl/2)))) // a pause that Hold's renewals cover
				s.write(h, c, name, l.Token())
			}
			rop = h.releasing(c.id, rec) // Hold releases once work ends
			if c.rng.IntN(3) == 0 {
				panic(holdPanic{})
			}
			return nil
		})
	}()
	if rec == nil {
		if !panicked {
			h.granted(op, nil, err)
			if c.probe != nil && inDoubt(op) {
				c.probe(op)
			}
		}
		return
	}
	if err != nil || panicked {
		err = errHeldRelease
	}
	h.heldBy(rec, c.id, b)
	h.end(rop, err)
}

func (s NemesisSuite) renew(h *history, c *nemClient, l *leaseRec) {
	ctx, cancel := s.opCtx()
	defer cancel()
	if l.lapsed {
		l.lapsed = false
		s.write(h, c, l.name, l.token)
	}
	if l.lease.Context().Err() == nil { // a lease that ended sends no Renew
		c.armLose("Renew")
	}
	op := h.begin(c.id, "Renew", l.name, l.token, "")
	err := l.lease.Renew(ctx)
	h.renewed(op, l, err)
	s.renewLater(c, l, true, err)
}

func (s NemesisSuite) release(h *history, c *nemClient, l *leaseRec) {
	ctx, cancel := s.opCtx()
	defer cancel()
	c.armLose("Release")
	op := h.releasing(c.id, l)
	h.end(op, l.lease.Release(ctx))
	delete(c.held, l.name)
	c.old = append(c.old, l)
}

func (s NemesisSuite) write(h *history, c *nemClient, key string, tok fence.Token) {
	if c.w == nil {
		return
	}
	c.writes++
	value := fmt.Sprintf("c%d-w%d-t%d", c.id, c.writes, tok)
	ctx, cancel := s.opCtx()
	defer cancel()
	c.armLose("Write")
	op := h.begin(c.id, "Write", key, tok, value)
	h.end(op, c.w.Write(ctx, key, []byte(value), tok))
}

func (s NemesisSuite) read(h *history, c *nemClient, key string) {
	if c.r == nil {
		return
	}
	ctx, cancel := s.opCtx()
	defer cancel()
	op := h.begin(c.id, "Read", key, 0, "")
	v, tok, err := c.r.Read(ctx, key)
	h.read(op, string(v), tok, err)
}

// checkLive checks that each name is granted to a Direct TryAcquire within
// the ttl, the ExpiryLag and a margin of the clients' end (every lease was
// released, the faults had stopped).
func (s NemesisSuite) checkLive(t *testing.T, fail func(string, ...any), a fence.Acquirer, names []string, ended time.Time) {
	bound := ended.Add(s.ShortTTL + s.ExpiryLag + max(s.ShortTTL, time.Second))
	for _, name := range names {
		for {
			l, err := a.TryAcquire(ctxT(t), name, s.ShortTTL)
			if err == nil {
				_ = l.Release(ctxT(t))
				break
			}
			if !errors.Is(err, fence.ErrHeld) && !errors.Is(err, fence.ErrLost) {
				fail("liveness: a Direct TryAcquire of %q after the run: %v", name, err)
				break
			}
			if time.Now().After(bound) {
				fail("liveness: %q still not granted %v after the clients released everything and the faults had stopped (last: %v)", name, time.Since(ended), err)
				break
			}
			time.Sleep(5 * time.Millisecond) // a poll with a bound
		}
	}
}
