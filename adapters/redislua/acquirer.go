package redislua

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/redis/go-redis/v9"
)

// ErrNotReplicated is returned by an acquirer with WaitReplicas set when a grant
// did not reach that many replicas in time. The grant was released; it is safe to
// try again.
var ErrNotReplicated = errors.New("redislua: grant not acknowledged by enough replicas")

// AcquirerOptions configures an Acquirer. A nil *AcquirerOptions means the defaults.
type AcquirerOptions struct {
	// Prefix starts every key, and may not contain braces. Default: "fence:".
	Prefix string
	// Backoff paces Acquire's polls while the lease is held. A waiter in line
	// polls every Max/2 to Max (and at least every ttl/4), which keeps its
	// place; a place outlives its last poll by five times Max, at least 1s.
	// With DisableNotify, polls follow Backoff.Delay. Its MaxWait bounds a
	// wait whose ctx has no deadline. Default: Min 20ms, Max 200ms, since a release grants the lease to the
	// first waiter in line at once and polling only covers a lost message or
	// an expired holder; with DisableNotify, the zero fence.Backoff (Min 1ms,
	// Max 100ms).
	Backoff fence.Backoff
	// Drift is taken off each lease's local deadline. Default: 1% of the ttl plus 2ms.
	Drift time.Duration
	// CounterTokens turns the clock floor off: tokens come from the counter
	// alone (1, 2, 3, ...). A counter that is lost (FLUSHALL, DEL, eviction
	// under maxmemory, a failover that lost it) then restarts at 1, below
	// tokens already handed out, and a paused holder's write beats the new
	// holder's. Use it only where that cannot happen. Default: false: every
	// token is at least Redis's clock (TIME) in microseconds, and one more
	// than the counter; see the package documentation for the clock
	// assumption.
	CounterTokens bool
	// TokenFloor is the default now, and setting it changes nothing; it may
	// not be combined with CounterTokens.
	//
	// Deprecated: the clock floor is on unless CounterTokens is set.
	TokenFloor bool
	// WaitReplicas, when positive, runs WAIT for that many replicas after each
	// grant and refuses a grant they did not acknowledge within WaitTimeout
	// (ErrNotReplicated). Not available on Redis Cluster clients. Default: 0.
	WaitReplicas int
	// WaitTimeout bounds the WAIT. It must be shorter than the client's
	// ReadTimeout, since the WAIT is pipelined with the grant. Default: 100ms.
	WaitTimeout time.Duration
	// DisableNotify turns off the line: waiters do not queue and are not told
	// of grants by pub/sub; they only poll, and the first to find the lock free
	// takes it (no order). Default: false.
	DisableNotify bool
	// HeadSpin, when positive, lets the waiter that is next in line keep its
	// goroutine running (checking for its grant and yielding) instead of
	// parking it, so that the grant finds it awake: the script that grants
	// the lock to the waiter before it tells it that it is next (one more
	// message; only a script run by an acquirer with HeadSpin does, so give
	// every acquirer of a name the same setting). It spins for up to twice the time the name's recent waiters
	// of this acquirer took from that notice to their grant, never longer
	// than HeadSpin, and not at all while that time is above HeadSpin; then
	// it parks as before. At most one waiter per lock name spins at a time,
	// across all processes (the one next in line), and none while nobody
	// waits; a spinning waiter whose ctx ends stops at once and gives up.
	// Default: 0, no spinning (see docs/redis-line.md for what it gained
	// and cost on a 2-vCPU machine).
	HeadSpin time.Duration
}

// Acquirer grants leases from Redis. Every operation on a lock is one script
// (scripts/lock.lua) over the name's lock key, token counter and line of
// waiters, which share one Cluster slot: a grant checks the lock, advances the
// counter and sets the lock with the ttl (expiry on Redis's clock); a waiter
// that finds the lock held joins the line in the same script; a release grants
// the lock to the first live waiter, in any process, and publishes the grant on
// that waiter's acquirer channel. It is safe for concurrent use.
type Acquirer struct {
	c      Client
	o      AcquirerOptions
	id     string        // names this acquirer's line entries and grant channel
	grants *grants       // nil with DisableNotify: waiters poll and do not queue
	poll   time.Duration // a waiter in line polls every poll/2 to poll
	life   time.Duration // how long a place in line outlives its last poll
	// lineLife is how long the line outlives the last poll of any waiter.
	lineLife time.Duration
	// heard is "1" when PUBLISH's receiver count tells whether an acquirer
	// listens (not on Cluster, where it counts one node's subscribers).
	heard string
	// spin learns, per name, how long a waiter told it is next waited for
	// its grant (HeadSpin).
	spin spinTimes
}

// notifiedBackoff is the default pacing of waiters that are woken by
// notifications: polling is only the fallback.
var notifiedBackoff = fence.Backoff{Min: 20 * time.Millisecond, Max: 200 * time.Millisecond}

// NewAcquirer returns an Acquirer on c. It returns an error matching fence.ErrInvalid
// for a nil client, a *redis.Ring (it routes the grant channel and the lock key
// to different shards), a prefix with braces, negative options, TokenFloor with
// CounterTokens, or WaitReplicas on a Cluster client.
func NewAcquirer(c Client, opts *AcquirerOptions) (*Acquirer, error) {
	if err := checkClient("new acquirer", c); err != nil {
		return nil, err
	}
	var o AcquirerOptions
	if opts != nil {
		o = *opts
	}
	if o.Prefix == "" {
		o.Prefix = DefaultPrefix
	}
	if err := checkPrefix("new acquirer", o.Prefix); err != nil {
		return nil, err
	}
	if o.Drift < 0 || o.WaitReplicas < 0 || o.WaitTimeout < 0 || o.HeadSpin < 0 {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "options", Reason: "Drift, WaitReplicas, WaitTimeout and HeadSpin may not be negative"}
	}
	if o.HeadSpin > maxHeadSpin {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "HeadSpin", Reason: fmt.Sprintf("%v is above %v: a waiter would burn a CPU that long", o.HeadSpin, maxHeadSpin)}
	}
	if err := leasekit.CheckBackoff("new acquirer", o.Backoff); err != nil {
		return nil, err
	}
	if o.TokenFloor && o.CounterTokens {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "CounterTokens", Reason: "contradicts TokenFloor"}
	}
	if err := checkNotRing("new acquirer", c); err != nil {
		return nil, err
	}
	if o.WaitTimeout == 0 {
		o.WaitTimeout = 100 * time.Millisecond
	}
	if o.Backoff == (fence.Backoff{}) && !o.DisableNotify {
		o.Backoff = notifiedBackoff
	}
	if _, ok := c.(*redis.ClusterClient); ok && o.WaitReplicas > 0 {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "WaitReplicas", Reason: "WAIT cannot be routed with the grant on a Cluster client"}
	}
	if rc, ok := c.(*redis.Client); ok && o.WaitReplicas > 0 {
		if rt := rc.Options().ReadTimeout; rt > 0 && rt <= o.WaitTimeout {
			return nil, &fence.InvalidError{Op: "new acquirer", Arg: "WaitTimeout",
				Reason: fmt.Sprintf("%v is not below the client's ReadTimeout %v", o.WaitTimeout, rt)}
		}
	}
	a := &Acquirer{c: c, o: o, id: newNonce(), heard: "1", lineLife: time.Hour}
	if _, ok := c.(*redis.ClusterClient); ok {
		a.heard = "0"
	}
	// A line entry lives five polls, and at least a second, without a refresh.
	a.poll = o.Backoff.WithDefaults().Max
	// Five polls saturate rather than overflow: Backoff.Max may be as large
	// as math.MaxInt64, and a wrapped product made a place live 1s.
	a.life = max(time.Second, min(a.poll, math.MaxInt64/5)*5)
	if !o.DisableNotify {
		a.grants = newGrants(c, a.grantChannel()+a.id)
	}
	return a, nil
}

func newNonce() string {
	var b [12]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// minTTL is the shortest lease: PX takes whole milliseconds.
const minTTL = time.Millisecond

func checkLease(ctx context.Context, name string, ttl, drift time.Duration) error {
	if err := checkTagged(ctx, "acquire", "name", name); err != nil {
		return err
	}
	if err := leasekit.CheckTTL("acquire", ttl, minTTL, MaxTTL); err != nil {
		return err
	}
	// A ttl that the drift eats whole would make a lease that is lost
	// before it is handed out, while Redis holds the name for the ttl.
	if drift <= 0 {
		drift = leasekit.DefaultDrift(ttl)
	}
	if ttl <= drift {
		return &fence.InvalidError{Op: "acquire", Arg: "ttl", Reason: fmt.Sprintf("%v is not longer than the drift %v taken off the local deadline", ttl, drift)}
	}
	return nil
}

// ttlMs rounds ttl up to whole milliseconds, without overflowing.
func ttlMs(ttl time.Duration) int64 { return leasekit.CeilDiv(ttl, time.Millisecond) }

// TryAcquire grants the lease on name for ttl, or returns fence.ErrHeld at once.
// ttl must be at least 1ms and longer than Drift (by default 1% of the ttl
// plus 2ms, so at least about 2.03ms), else fence.ErrInvalid; name may not
// contain braces. A try whose reply was
// lost is sent again with the same nonce (up to 3 times), which adopts a
// grant it made; if every reply is lost, the grant is undone by a script that
// releases it if it was made, and the error says "not granted"; only when
// that cannot reach Redis either does the error match fence.ErrUnknown.
func (a *Acquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := checkLease(ctx, name, ttl, a.o.Drift); err != nil {
		return nil, err
	}
	l, err := a.grant(ctx, name, ttl)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// grantChannel is the prefix of the acquirers' grant channels.
func (a *Acquirer) grantChannel() string { return a.o.Prefix + "grant:" }

// lineKeys returns the keys of name's lock script: lock, counter and line,
// all with the hash tag {name} (the waiters' entry keys too).
func lineKeys(prefix, name string) []string {
	lock, counter := lockKeys(prefix, name)
	return []string{lock, counter, strings.TrimSuffix(lock, ":lock") + ":line"}
}

// lockReply is the lock script's answer.
type lockReply struct {
	code   int64
	number uint64
	// A grant the script made to the first waiter in line, if any.
	handed                 bool
	nonce, stamp, acquirer string
	token                  uint64
	replicas               int64 // WAIT's count, -1 when not asked
}

// lockOp runs one operation of the lock script. With WaitReplicas, "try" and
// "wait" are pipelined with WAIT, so that WAIT covers any grant they made.
func (a *Acquirer) lockOp(ctx context.Context, name, op, me string, ttl time.Duration, stamp string) (lockReply, error) {
	floor := "1"
	if a.o.CounterTokens {
		floor = "0"
	}
	keys := lineKeys(a.o.Prefix, name)
	spins := "0"
	if a.o.HeadSpin > 0 {
		spins = "1"
	}
	args := []any{op, me, ttlMs(ttl), floor, a.id, stamp, a.life.Milliseconds(), name, a.grantChannel(), a.heard, a.lineLife.Milliseconds(), spins}
	var (
		res      any
		replicas int64 = -1
		err      error
	)
	if op == "release" {
		// A release sent again after it ran finds the lock gone and would
		// report the lease lost: send it once.
		res, err = runOnce(ctx, a.c, lockScript, keys, args...)
	} else {
		// A "try" or "wait" sent again finds its own grant and adopts it; a
		// "leave" sent again finds nothing to do: go-redis may resend them.
		// The call's results are read only once it returned: after
		// errNoReply it goes on in the background and must not share them.
		var (
			got     any
			gotReps int64
		)
		// A reply that says the script did not run is no answer: it is sent
		// again within ctx.
		err = retryNotRun(ctx, func() error {
			return bounded(ctx, func() (err error) {
				got, gotReps, err = a.run(ctx, lockScript, keys, args, op == "try" || op == "wait")
				return err
			})
		})
		if !errors.Is(err, errNoReply) {
			res, replicas = got, gotReps
		}
	}
	r := lockReply{replicas: replicas}
	if err != nil {
		return r, scriptError(ambiguous(err))
	}
	arr, ok := res.([]any)
	if !ok || (len(arr) != 2 && len(arr) != 6) {
		return r, fmt.Errorf("unexpected script reply %v", res)
	}
	if r.code, r.number, err = parsePair(arr[:2]); err != nil {
		return r, err
	}
	if len(arr) == 6 {
		r.handed = true
		r.nonce, _ = arr[2].(string)
		r.stamp, _ = arr[4].(string)
		r.acquirer, _ = arr[5].(string)
		tok, _ := arr[3].(string)
		if r.token, err = strconv.ParseUint(tok, 10, 64); err != nil {
			return r, fmt.Errorf("unexpected token %q in script reply", arr[3])
		}
	}
	return r, nil
}

// handOver passes a grant the script made to a waiter of this acquirer
// straight to it: the script published nothing for it. sent is when the
// request that made the grant was sent.
func (a *Acquirer) handOver(r lockReply, sent time.Time) {
	if !r.handed || r.acquirer != a.id || a.grants == nil {
		return
	}
	a.grants.deliver(r.nonce, grantMsg{token: r.token, sent: later(a.grants.sentAt(r.stamp), sent)})
}

func later(x, y time.Time) time.Time {
	if y.After(x) {
		return y
	}
	return x
}

// maxAmbiguous is how many times a grant whose reply was lost is asked for
// again (with the same nonce) before it is given up.
const maxAmbiguous = 3

// grant runs a "try" for a new grant (nonce) on name. A try whose reply was
// lost may have granted: it is sent again with the same nonce, which finds
// that grant and adopts it, and when that fails too the grant is undone
// (released, if it was made), so that no orphan lease blocks the name.
func (a *Acquirer) grant(ctx context.Context, name string, ttl time.Duration) (*lease, error) {
	nonce := newNonce()
	sent := time.Now()
	r, err := a.lockOp(ctx, name, "try", nonce, ttl, "0")
	lost := errors.Is(err, fence.ErrUnknown)
	for i := 0; i < maxAmbiguous && errors.Is(err, fence.ErrUnknown) && ctx.Err() == nil; i++ {
		r, err = a.lockOp(ctx, name, "try", nonce, ttl, "0")
	}
	if err != nil && lost && !errors.Is(err, fence.ErrUnknown) && notRun(err) {
		// A try that was not run again says nothing of the lost one before it.
		err = fmt.Errorf("%w (applied or not), then: %w", fence.ErrUnknown, err)
	}
	if err != nil {
		return nil, a.giveUp(ctx, name, nonce, ttl, err)
	}
	a.handOver(r, sent)
	if r.code != 1 {
		return nil, fence.ErrHeld
	}
	return a.granted(ctx, name, ttl, nonce, r.number, sent, r.replicas)
}

// granted makes the lease of a grant to nonce; with WaitReplicas it refuses
// (and releases) one too few replicas acknowledged.
func (a *Acquirer) granted(ctx context.Context, name string, ttl time.Duration, nonce string, tok uint64, sent time.Time, replicas int64) (*lease, error) {
	lock, _ := lockKeys(a.o.Prefix, name)
	l := &lease{Base: leasekit.New(name, fence.Token(tok), ttl, a.o.Drift, sent), a: a, lock: lock,
		value: nonce + ":" + strconv.FormatUint(tok, 10)}
	if a.o.WaitReplicas > 0 && replicas < int64(a.o.WaitReplicas) {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		_ = l.release(rctx)
		cancel()
		return nil, fmt.Errorf("redislua: acquire %q: %d of %d replicas acknowledged token %d within %v: %w",
			name, replicas, a.o.WaitReplicas, tok, a.o.WaitTimeout, ErrNotReplicated)
	}
	return l, nil
}

// run runs a script. When wait is set and the acquirer has WaitReplicas, it
// sends the script and WAIT in one pipeline on one connection, so that WAIT
// covers the script's writes, and returns WAIT's count; otherwise the count
// is -1.
func (a *Acquirer) run(ctx context.Context, s *redis.Script, keys []string, args []any, wait bool) (any, int64, error) {
	if !wait || a.o.WaitReplicas == 0 {
		res, err := s.Run(ctx, a.c, keys, args...).Result()
		return res, -1, err
	}
	run := func() ([]redis.Cmder, error) {
		return a.c.Pipelined(ctx, func(p redis.Pipeliner) error {
			s.EvalSha(ctx, p, keys, args...)
			p.Do(ctx, "WAIT", a.o.WaitReplicas, a.o.WaitTimeout.Milliseconds())
			return nil
		})
	}
	cmds, err := run()
	if err != nil && redis.HasErrorPrefix(cmds[0].Err(), "NOSCRIPT") {
		if err := s.Load(ctx, a.c).Err(); err != nil {
			return nil, 0, err
		}
		cmds, err = run()
	}
	if err != nil {
		if e := cmds[0].Err(); e != nil {
			return nil, 0, e
		}
		return nil, 0, err
	}
	res, _ := cmds[0].(*redis.Cmd).Result()
	n, err := cmds[1].(*redis.Cmd).Int64()
	if err != nil {
		return nil, 0, fmt.Errorf("WAIT: %w", err)
	}
	return res, n, nil
}

// Acquire waits until the lease on name is granted. A waiter that finds the
// lease held joins the name's line in Redis (in the same script), and a
// release anywhere grants the lease to the first live waiter in line, in
// arrival order across processes, and tells it by pub/sub: the waiter holds the
// lease without another request. Meanwhile it polls, paced by Backoff, which
// keeps its place (and the line) alive and finds a lock freed by expiry. With
// DisableNotify it does not queue and only polls. See fence.Acquirer.
//
// The arrival order holds with these exceptions:
//   - A waiter whose acquirer does not listen when the lock is freed (its
//     pub/sub connection is reconnecting) misses that grant, which goes to
//     the next waiter; it keeps its place at the head of the line for the
//     next one. (This is what skips a waiter whose process died at once.)
//   - A waiter that cannot poll for longer than its place lives (five polls,
//     at least 1s: see Backoff) loses its place and joins again at the end.
//   - The line itself expires an hour after the last poll of any waiter (so
//     only when every waiter stopped polling); a waiter whose line expired
//     joins the new one at the end.
//   - The line needs the Redis user's ACL to allow the channels
//     Prefix+"grant:*" (new Redis 7 users have none). When Redis refuses the
//     subscription (NOPERM), the waiter does not queue and polls, paced by
//     Backoff, as with DisableNotify (no order); a wait that ends says so in
//     its error. A release by such a user cannot tell a waiter in line of
//     another user, which finds its grant at its next poll.
//
// A network error while waiting (a lost reply, a failed dial) does not end
// the wait: the next poll, with the same nonce, adopts a grant a lost request
// made. When the wait ends without a lease (ctx), the waiter leaves the line
// in a script that also releases such a grant; if Redis cannot be reached for
// that either, the error also matches fence.ErrUnknown, and the leave is
// sent again in the background for as long as the waiter's place in line can
// still be granted (the longer of the ttl and the place's life, plus a
// second): a grant a held request makes when it lands, or a release makes to
// the departed waiter meanwhile, is released once Redis runs the leave.
func (a *Acquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (_ fence.Lease, err error) {
	if err := checkLease(ctx, name, ttl, a.o.Drift); err != nil {
		return nil, err
	}
	try := func(ctx context.Context) (fence.Lease, error) {
		l, err := a.grant(ctx, name, ttl)
		return lOrNil(l), err
	}
	// poll is try for a wait that polls: a try that Redis did not run
	// (ErrNotRun, with too little time left for another send) is a poll
	// that found the name held, and a wait that runs out after one says so.
	var notRun error
	poll := func(ctx context.Context) (fence.Lease, error) {
		l, err := try(ctx)
		notRun = nil
		if errors.Is(err, ErrNotRun) && !errors.Is(err, fence.ErrUnknown) {
			notRun = err
			return nil, errors.Join(fence.ErrHeld, err)
		}
		return l, err
	}
	ranOut := func(err error) error {
		if notRun != nil && errors.Is(err, fence.ErrHeld) && !errors.Is(err, ErrNotRun) {
			return errors.Join(err, notRun)
		}
		return err
	}
	if a.grants == nil {
		l, err := leasekit.Acquire(ctx, a.o.Backoff, nil, poll)
		return l, ranOut(err)
	}
	nonce := newNonce()
	w, sub := a.grants.join(nonce)
	ch := w.grant
	defer a.grants.leave(nonce)
	if _, ok := ctx.Deadline(); !ok {
		maxWait := a.o.Backoff.WithDefaults().MaxWait
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, maxWait,
			fmt.Errorf("redislua: gave up after the maximum wait %v: %w", maxWait, context.DeadlineExceeded))
		defer cancel()
	}
	tried := false
	select {
	case <-sub.ready:
	default:
		// Not yet listening for grants: try once meanwhile, then wait for the
		// subscription, since a grant published before it would be missed.
		tried = true
		if l, err := try(ctx); err == nil || !errors.Is(err, fence.ErrHeld) {
			if errors.Is(err, ErrNotRun) || (err != nil && ctx.Err() != nil) {
				// Redis did not run the try before ctx ended, or ctx ended
				// with it in flight: a wait that ran out (the error says
				// whether a grant it may have made is released).
				return nil, errors.Join(fence.ErrHeld, err)
			}
			return l, err
		}
		select {
		case <-sub.ready:
		case <-ctx.Done():
			if reply := sub.notRunReply(); reply != nil {
				// Redis refused the SUBSCRIBE unrun until ctx ended: a wait
				// that ran out while Redis did not run its step.
				return nil, errors.Join(fence.ErrHeld, notRunError(ctx, reply))
			}
			return nil, errors.Join(fence.ErrHeld, context.Cause(ctx))
		}
	}
	if sub.err != nil {
		// Redis refused the subscription: a waiter in line would never hear
		// its grant, so this one polls, as with DisableNotify.
		wait := leasekit.Acquire
		if tried {
			wait = leasekit.Retry
		}
		l, err := wait(ctx, a.o.Backoff, nil, poll)
		if err != nil && errors.Is(err, fence.ErrHeld) {
			err = errors.Join(err, fmt.Errorf("waited by polling, not in line: %w", sub.err))
		}
		return l, ranOut(err)
	}
	// inLine: a request of this waiter may have queued it (or been granted);
	// ran: Redis may have run one (not every request was refused unrun).
	inLine, ran := false, false
	defer func() {
		if inLine && !a.leaveLine(ctx, name, nonce, ttl) && ran && err != nil && !errors.Is(err, fence.ErrUnknown) {
			err = fmt.Errorf("%w: leaving the line got no answer (it is sent again in the background while this waiter's place in line may be granted, releasing a grant to this waiter if one lands): %w", fence.ErrUnknown, err)
		}
	}()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	// toldNext is when this waiter heard it is next in line (HeadSpin); it
	// outlives a poll round, since the grant may come rounds later.
	var toldNext time.Time
	for {
		sent := time.Now()
		inLine = true
		r, err := a.lockOp(ctx, name, "wait", nonce, ttl, a.grants.stamp(sent, a.o.HeadSpin > 0))
		ran = ran || !errors.Is(err, ErrNotRun) || errors.Is(err, fence.ErrUnknown)
		switch {
		case err != nil && (ctx.Err() != nil || errors.Is(err, ErrNotRun)):
			// ErrNotRun before ctx ended: too little time was left for
			// another send. Either way the wait ran out.
			if errors.Is(err, ErrNotRun) {
				return nil, errors.Join(fence.ErrHeld, err)
			}
			return nil, errors.Join(fence.ErrHeld, context.Cause(ctx))
		case errors.Is(err, fence.ErrUnknown) || notSent(err):
			// A network error: the next "wait" (same nonce) adopts a grant a
			// lost one made, and giving up leaves the line and releases it.
			r = lockReply{}
		case err != nil:
			inLine = inLine && !errors.Is(err, fence.ErrUnknown) // giveUp leaves
			return nil, a.giveUp(ctx, name, nonce, ttl, err)
		}
		a.handOver(r, sent)
		if r.code == 1 {
			inLine = false
			if !toldNext.IsZero() {
				a.spin.learn(name, time.Since(toldNext))
			}
			l, err := a.granted(ctx, name, ttl, nonce, r.number, sent, r.replicas)
			return lOrNil(l), err
		}
		// In line, a release grants the lease and says so: polls only keep the
		// place, find a holder that expired, and cover a lost message, so they
		// come every half to whole Backoff.Max, and at least every ttl/4 so
		// that a grant's stamp is recent.
		delay := a.poll/2 + rand.N(a.poll/2+1)
		timer.Reset(min(delay, max(ttl/4, time.Millisecond)))
	park:
		for {
			var m grantMsg
			select {
			case m = <-ch:
			case <-w.next:
				toldNext = time.Now()
				var ok bool
				if m, ok = a.spinFor(ctx, name, ch); !ok {
					if ctx.Err() != nil {
						return nil, errors.Join(fence.ErrHeld, context.Cause(ctx))
					}
					continue
				}
			case <-timer.C:
				break park
			case <-ctx.Done():
				return nil, errors.Join(fence.ErrHeld, context.Cause(ctx))
			}
			if !toldNext.IsZero() {
				a.spin.learn(name, time.Since(toldNext))
				toldNext = time.Time{}
			}
			l, err := a.take(ctx, name, ttl, nonce, m)
			if l != nil || err != nil {
				inLine = l == nil
				return lOrNil(l), err
			}
			// Lost before it was taken: queue again.
			break
		}
	}
}

// spinObserver, set by tests, sees each waiter start (1) and stop (-1) spinning.
var spinObserver func(a *Acquirer, delta int)

// maxHeadSpin bounds AcquirerOptions.HeadSpin.
const maxHeadSpin = 100 * time.Millisecond

// spinFor spins a waiter that was told it is next in line (HeadSpin): it
// checks ch and yields its goroutine until its grant arrives, the budget
// the name's recent waits give is spent, or ctx ends.
func (a *Acquirer) spinFor(ctx context.Context, name string, ch chan grantMsg) (grantMsg, bool) {
	budget := a.spin.budget(name, a.o.HeadSpin)
	if budget <= 0 || !a.spin.start(name) {
		return grantMsg{}, false
	}
	defer a.spin.stop(name)
	if spinObserver != nil {
		spinObserver(a, 1)
		defer spinObserver(a, -1)
	}
	for end := time.Now().Add(budget); ; {
		// ctx first: a grant that reaches a waiter whose ctx ended is not
		// taken (the leave releases it).
		if ctx.Err() != nil {
			return grantMsg{}, false
		}
		select {
		case m := <-ch:
			return m, true
		default:
		}
		if !time.Now().Before(end) {
			return grantMsg{}, false
		}
		runtime.Gosched()
	}
}

// spinTimes keeps, per lock name, a moving average of the time from a
// waiter's "next in line" notice to its grant, and which names have a waiter
// of this acquirer spinning: one at most. (The waiter told it is next while
// the one before it has not yet taken its grant does not spin when that one
// is of the same acquirer.)
type spinTimes struct {
	mu       sync.Mutex
	m        map[string]time.Duration
	spinning map[string]bool
}

// start claims name's spin for one waiter; false when another has it.
func (s *spinTimes) start(name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.spinning[name] {
		return false
	}
	if s.spinning == nil {
		s.spinning = map[string]bool{}
	}
	s.spinning[name] = true
	return true
}

func (s *spinTimes) stop(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.spinning, name)
}

// maxSpinNames bounds the names spinTimes remembers; past it, it forgets all.
const maxSpinNames = 4096

func (s *spinTimes) learn(name string, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil || len(s.m) >= maxSpinNames {
		s.m = map[string]time.Duration{}
	}
	if old, ok := s.m[name]; ok {
		d = old + (d-old)/4
	}
	s.m[name] = d
}

// budget is how long a waiter of name that is next in line spins: twice the
// average wait from the notice to the grant, at most max, and nothing when
// that average is above max (the spin would not reach the grant). A name not
// seen yet spins for max.
func (s *spinTimes) budget(name string, max time.Duration) time.Duration {
	if max <= 0 {
		return 0
	}
	s.mu.Lock()
	avg, ok := s.m[name]
	s.mu.Unlock()
	switch {
	case !ok:
		return max
	case avg > max:
		return 0
	}
	return min(max, 2*avg)
}

// take turns a grant made by another request into this waiter's lease. Its
// local deadline counts from m.sent, which is before the grant; when that
// leaves less than half the ttl, or WaitReplicas needs a WAIT after the grant,
// the lease is renewed first (one request). nil, nil: the grant was lost
// before it could be confirmed.
func (a *Acquirer) take(ctx context.Context, name string, ttl time.Duration, nonce string, m grantMsg) (*lease, error) {
	drift := a.o.Drift
	if drift == 0 {
		drift = leasekit.DefaultDrift(ttl)
	}
	if a.o.WaitReplicas == 0 && time.Until(m.sent.Add(ttl-drift)) >= ttl/2 {
		return a.granted(ctx, name, ttl, nonce, m.token, m.sent, -1)
	}
	lock, _ := lockKeys(a.o.Prefix, name)
	value := nonce + ":" + strconv.FormatUint(m.token, 10)
	keys, args := []string{lock}, []any{value, ttlMs(ttl)}
	sent := time.Now()
	var (
		res      any
		replicas int64
	)
	err := retryNotRun(ctx, func() error {
		return bounded(ctx, func() (err error) {
			res, replicas, err = a.run(ctx, renewScript, keys, args, true)
			return err
		})
	})
	if err != nil {
		return nil, fmt.Errorf("redislua: acquire %q: confirming a grant: %w", name, err)
	}
	if n, _ := res.(int64); n != 1 {
		return nil, nil
	}
	return a.granted(ctx, name, ttl, nonce, m.token, sent, replicas)
}

// giveUp ends an acquire that failed with err. When the last request's reply
// was lost (it may have granted), it leaves the line, which releases such a
// grant: once Redis answered that, the outcome is known and the error no
// longer matches fence.ErrUnknown; otherwise it does, and the leave goes on
// in the background (leaveLine).
func (a *Acquirer) giveUp(ctx context.Context, name, nonce string, ttl time.Duration, err error) error {
	// A request go-redis sent again after a network error and that Redis then
	// did not run may hide a first one that ran: leave, as for a lost reply.
	if (errors.Is(err, fence.ErrUnknown) || notRun(err)) && a.leaveLine(ctx, name, nonce, ttl) {
		if errors.Is(err, ErrNotRun) && !errors.Is(err, fence.ErrUnknown) {
			// Redis ran neither the try nor anything before it: not
			// granted, and whether the name is held is not known.
			return fmt.Errorf("redislua: acquire %q: not granted: %w", name, err)
		}
		if cerr := ctx.Err(); cerr != nil {
			// The context ended while a request was in flight: not
			// granted, as any wait that ran out (fence.ErrHeld and the
			// context's error).
			return fmt.Errorf("redislua: acquire %q: not granted (a grant whose reply was lost, if any, is released; %v): %w", name, err, errors.Join(fence.ErrHeld, cerr))
		}
		return fmt.Errorf("redislua: acquire %q: not granted (a grant whose reply was lost, if any, is released): %v", name, err)
	}
	return fmt.Errorf("redislua: acquire %q: %w", name, err)
}

// leaveLine takes a waiter that gives up out of the line, and marks its
// nonce gone for ttl, so that a request of it still on its way cannot grant
// it the lock when it lands; if a grant to it
// raced with that (or was made by a request whose reply was lost), the same
// script releases the grant (to the next waiter). It reports whether Redis
// answered within a second. When it did not (a partition, or Redis refusing
// it unrun while another client's script runs), the leave is sent again in
// the background until Redis answers, for as long as the waiter's place in
// line can still be granted: the longer of the ttl and the place's life
// (AcquirerOptions.Backoff: five polls, at least 1s), plus a second. A
// grant that lands meanwhile is released when the leave runs; one that this
// acquirer hears of (it still listens for other waiters) sends the leave at
// once, and after a reply that said it did not run the leave goes again
// within notRunDelay.Max. A place that a poll held on its way for longer
// than that renews is not covered.
func (a *Acquirer) leaveLine(ctx context.Context, name, nonce string, ttl time.Duration) bool {
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	done, unrun := a.leave(lctx, name, nonce, ttl)
	if done {
		return true
	}
	var (
		kick     <-chan struct{}
		departed = func() {}
	)
	if a.grants != nil {
		kick, departed = a.grants.depart(nonce)
	}
	go func() {
		defer departed()
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), leaveWindow(ttl, a.life))
		defer cancel()
		sendLater(bctx, kick, unrun, func(ctx context.Context) (bool, bool) { return a.leave(ctx, name, nonce, ttl) })
	}()
	return false
}

// leaveWindow is how long a leave that Redis did not answer is sent again:
// until the waiter's place, which lives life after its last poll, can no
// longer be granted, and at least the ttl (a request held on its way is
// refused by the gone mark the leave sets), plus a second; it saturates.
func leaveWindow(ttl, life time.Duration) time.Duration {
	w := max(ttl, life)
	if w > math.MaxInt64-time.Second {
		return math.MaxInt64
	}
	return w + time.Second
}

// leaveDelay spaces the leaves and releases sent again in the background
// after one got no answer.
var leaveDelay = fence.Backoff{Min: 100 * time.Millisecond, Max: 2 * time.Second}

// sendLater sends step again until it is settled or ctx ends, each send
// within a second; unrun says whether Redis refused the last send without
// running it. After a send that got no answer it waits leaveDelay
// (growing); after one that Redis refused without running it (BUSY,
// LOADING: Redis answers, and will run it soon) only notRunDelay, so that
// the step runs soon after Redis can run it. A signal on kick (nil: none)
// sends it at once.
func sendLater(ctx context.Context, kick <-chan struct{}, unrun bool, step func(ctx context.Context) (settled, unrun bool)) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	unanswered, refused := 0, 0
	for {
		var d time.Duration
		if unrun {
			d = notRunDelay.Delay(refused)
			refused++
		} else {
			d = leaveDelay.Delay(unanswered)
			unanswered++
			refused = 0
		}
		timer.Reset(d)
		select {
		case <-timer.C:
		case <-kick:
		case <-ctx.Done():
			return
		}
		actx, cancel := context.WithTimeout(ctx, time.Second)
		var settled bool
		settled, unrun = step(actx)
		cancel()
		if settled {
			return
		}
	}
}

// leave sends one "leave" and reports whether it is settled (Redis
// answered, or the client is closed and nothing more can be sent), and
// whether Redis refused it without running it.
func (a *Acquirer) leave(ctx context.Context, name, nonce string, ttl time.Duration) (settled, unrun bool) {
	sent := time.Now()
	r, err := a.lockOp(ctx, name, "leave", nonce, ttl, "0")
	if err == nil {
		a.handOver(r, sent)
	}
	return settledSend(err), notRun(err)
}

// settledSend reports whether a step sent in the background that ended with
// err needs no further send.
func settledSend(err error) bool {
	return err == nil || errors.Is(err, redis.ErrClosed) || !(errors.Is(err, fence.ErrUnknown) || notSent(err) || notRun(err))
}

// lOrNil keeps a nil *lease from becoming a non-nil fence.Lease.
func lOrNil(l *lease) fence.Lease {
	if l == nil {
		return nil
	}
	return l
}

// parsePair reads a script's {flag, number} reply.
func parsePair(res any) (int64, uint64, error) {
	arr, ok := res.([]any)
	if !ok || len(arr) != 2 {
		return 0, 0, fmt.Errorf("unexpected script reply %v", res)
	}
	flag, _ := arr[0].(int64)
	var n uint64
	switch v := arr[1].(type) {
	case int64:
		if v < 0 { // PTTL of a key without expiry (-1)
			v = 0
		}
		n = uint64(v)
	case string:
		var err error
		if n, err = strconv.ParseUint(v, 10, 64); err != nil {
			return 0, 0, fmt.Errorf("unexpected number %q in script reply", v)
		}
	default:
		return 0, 0, fmt.Errorf("unexpected script reply %v", res)
	}
	return flag, n, nil
}

// scriptError turns the scripts' own error replies into package errors.
func scriptError(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "fencekit: token counter") && strings.Contains(msg, "exhausted"):
		return fmt.Errorf("%w (%s)", fence.ErrTokensExhausted, msg)
	case strings.Contains(msg, "fencekit: "):
		return &CorruptError{Msg: msg[strings.Index(msg, "fencekit: "):], Err: err}
	}
	return err
}

// CorruptError reports a key this package uses that holds something it did not
// write (for example a token counter that is not a number): someone else wrote it.
type CorruptError struct {
	// Msg is the script's description of the key and what it holds.
	Msg string
	// Err is the error the script returned, as go-redis reported it.
	Err error
}

// Error says which key holds what.
func (e *CorruptError) Error() string { return "redislua: " + strings.TrimPrefix(e.Msg, "fencekit: ") }

// Unwrap returns the server's error reply.
func (e *CorruptError) Unwrap() error { return e.Err }

// lease is one grant from an Acquirer.
type lease struct {
	*leasekit.Base
	a     *Acquirer
	lock  string
	value string // nonce:token, unique to this grant even if a counter is lost
}

// Renew extends the lease by its ttl on Redis's clock if this grant still
// holds it. It returns fence.ErrLost, and extends nothing, when the grant is
// gone or the lease's context has already ended (released, or past its local
// deadline: a renewal that Redis applies after that is given back at once, so
// the lock is not held for a ttl by a holder that stopped). A renewal whose
// reply was lost returns an error matching fence.ErrUnknown, and the local
// deadline does not move.
func (l *lease) Renew(ctx context.Context) error {
	if err := leasekit.CheckContext("renew", ctx); err != nil {
		return err
	}
	if l.Context().Err() != nil {
		return l.lost()
	}
	sent := time.Now()
	// Sent again by go-redis after a network error, a renewal only extends
	// this grant again.
	var n int64
	err := retryNotRun(ctx, func() error {
		return bounded(ctx, func() (err error) {
			n, err = renewScript.Run(ctx, l.a.c, []string{l.lock}, l.value, ttlMs(l.TTL())).Int64()
			return err
		})
	})
	if err != nil {
		return fmt.Errorf("redislua: renew %q: %w", l.Name(), ambiguous(err))
	}
	if n == 0 {
		l.End(fence.ErrLost)
		return l.lost()
	}
	if !l.Extend(sent) {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		_ = l.release(rctx)
		return l.lost()
	}
	return nil
}

// Release gives the lease up if this grant still holds it: one script deletes
// the lock, or grants it at once to the first live waiter in line (in any
// process) and tells that waiter. It returns fence.ErrLost when the grant had
// already expired. The script is sent once; when its reply is lost it is sent
// again, and when that finds the lock free the error matches
// fence.ErrUnknown (released by the first, or expired before it); when no
// reply comes at all the error matches fence.ErrUnknown and the lock, if
// still held, expires after its ttl.
//
// The release also marks the grant's nonce gone on Redis for the ttl (one
// small key), so that a request of this grant still on its way (one that
// timed out and was sent again, by go-redis or by TryAcquire) is refused
// when it lands, instead of locking the name for a ttl on behalf of a lease
// that is gone; a waiter that gives up is marked the same way. A request
// that lands more than a ttl late is not covered.
func (l *lease) Release(ctx context.Context) error {
	if err := leasekit.CheckContext("release", ctx); err != nil {
		return err
	}
	return l.release(ctx)
}

func (l *lease) release(ctx context.Context) error {
	defer l.End(context.Canceled)
	sent := time.Now()
	r, err := l.a.lockOp(ctx, l.Name(), "release", l.value, l.TTL(), "0")
	if errors.Is(err, fence.ErrUnknown) && ctx.Err() == nil {
		// The lost send may have released: send it again to find out.
		if r, err = l.a.lockOp(ctx, l.Name(), "release", l.value, l.TTL(), "0"); err == nil && r.code == 0 {
			return fmt.Errorf("redislua: release %q: the lock is free, released by a request whose reply was lost or expired before it: %w", l.Name(), fence.ErrUnknown)
		}
		if notRun(err) {
			err = fmt.Errorf("%w (released or not), then: %w", fence.ErrUnknown, err)
		}
	}
	if notRun(err) {
		// Redis has not run it yet: the lock stays held until it does, so
		// the release goes on in the background.
		go l.a.releaseLater(context.WithoutCancel(ctx), l.Name(), l.value, l.TTL())
		return fmt.Errorf("redislua: release %q (sent again in the background until Redis runs it, for up to the ttl): %w", l.Name(), err)
	}
	if err != nil {
		return fmt.Errorf("redislua: release %q: %w", l.Name(), err)
	}
	l.a.handOver(r, sent)
	if r.code == 0 {
		return l.lost()
	}
	return nil
}

// releaseLater sends a release that Redis did not run again (sendLater)
// until Redis runs it or ttl has passed (plus a second): the lock expires by
// then.
func (a *Acquirer) releaseLater(ctx context.Context, name, value string, ttl time.Duration) {
	bctx, cancel := context.WithTimeout(ctx, ttl+time.Second)
	defer cancel()
	sendLater(bctx, nil, true, func(ctx context.Context) (bool, bool) {
		sent := time.Now()
		r, err := a.lockOp(ctx, name, "release", value, ttl, "0")
		if err == nil {
			a.handOver(r, sent)
		}
		return settledSend(err), notRun(err)
	})
}

func (l *lease) lost() error {
	return fmt.Errorf("redislua: lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}
