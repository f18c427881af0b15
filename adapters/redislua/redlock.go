package redislua

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/redis/go-redis/v9"
)

// ErrNoQuorum is returned by Redlock when too few nodes answered to decide: a
// majority could neither be locked nor be seen to hold the lock.
var ErrNoQuorum = errors.New("redislua: redlock: no majority of nodes answered")

// RedlockOptions configures a Redlock. A nil *RedlockOptions means the defaults.
type RedlockOptions struct {
	// Prefix starts every key, and may not contain braces. Default: "fence:".
	Prefix string
	// Backoff paces Acquire while the lease is held. Default: the zero fence.Backoff.
	Backoff fence.Backoff
	// Drift is the clock-drift allowance taken off the validity. Default: 1% of
	// the ttl plus 2ms.
	Drift time.Duration
	// NodeTimeout bounds each node's reply, so a dead node cannot eat the
	// lease's validity. Default: a quarter of the ttl, at most 200ms.
	NodeTimeout time.Duration
}

// Redlock grants leases on a majority of N independent Redis primaries, with
// fencing tokens.
//
// A grant locks the name on every node it can within NodeTimeout, and succeeds
// when a majority took it and time is left: the lease's validity is ttl minus the
// time the grant took minus Drift, and its local deadline is never later. Each
// node also reports its token counter, or its clock (TIME) in microseconds
// when that is larger; the token is one more than the largest
// reported, and is written to the counter of every node that granted, while that
// node still holds the lock, before the lease is handed out. Any later grant
// needs a majority, which shares at least one node with this one, whose counter
// is already at this token: so tokens grow from grant to grant.
//
// What that relies on, stated plainly:
//   - Nodes do not lose their data. A node that restarts empty (no AOF with fsync)
//     must stay down for at least the longest ttl in use, or the lock on it is
//     forgotten and mutual exclusion can fail. Tokens survive a counter lost on
//     every node (a DEL, FLUSHALL, eviction): a node never reports a counter
//     below its clock in microseconds, so the next token is above every token
//     handed out before, as long as the clock of some node of the next
//     majority is not behind the clock of the node whose reading set the old
//     counter by more than the time since, and the old counter made fewer
//     grants than microseconds passed since (as for the Acquirer's floor).
//   - Clocks on the nodes advance at about the same rate (bounded drift), since
//     each node expires the lock on its own clock. A jumping clock breaks mutual
//     exclusion; the tokens still grow, so fenced writes stay safe.
//   - Mutual exclusion also assumes holders do not pause past their validity,
//     which no lease can promise: fence every write with the token.
//
// A grant's calls to the nodes that had not answered when it returned go on
// in the background, and one may land after the lease's release (or after a
// failed or abandoned grant was undone). Release therefore marks the grant
// released on every node it reaches, for a ttl, and the lock script refuses a
// released grant: whatever order the calls land in, no node stays locked by
// a released grant, unless its lock call lands more than a ttl after the
// release reached that node (a node paused that long).
//
// Under heavy contention the contenders split the nodes' votes and all retry
// (with jittered backoff), so handoffs are slow; a hot lock is better served by
// the single-instance Acquirer or by etcd. Redlock is not a consensus system;
// see package etcdfence for one.
type Redlock struct {
	nodes  []Client
	quorum int
	o      RedlockOptions
}

var _ fence.Acquirer = (*Redlock)(nil)

// NewRedlock returns a Redlock on nodes, independent primaries (not replicas of
// one another). It returns an error matching fence.ErrInvalid for no nodes or bad options.
func NewRedlock(nodes []Client, opts *RedlockOptions) (*Redlock, error) {
	var o RedlockOptions
	if opts != nil {
		o = *opts
	}
	if len(nodes) == 0 {
		return nil, &fence.InvalidError{Op: "new redlock", Arg: "nodes", Reason: "none given"}
	}
	for _, n := range nodes {
		if err := checkClient("new redlock", n); err != nil {
			return nil, err
		}
	}
	if o.Prefix == "" {
		o.Prefix = DefaultPrefix
	}
	if err := checkPrefix("new redlock", o.Prefix); err != nil {
		return nil, err
	}
	if o.Drift < 0 || o.NodeTimeout < 0 {
		return nil, &fence.InvalidError{Op: "new redlock", Arg: "options", Reason: "Drift and NodeTimeout may not be negative"}
	}
	if err := leasekit.CheckBackoff("new redlock", o.Backoff); err != nil {
		return nil, err
	}
	return &Redlock{nodes: nodes, quorum: len(nodes)/2 + 1, o: o}, nil
}

func (r *Redlock) nodeTimeout(ttl time.Duration) time.Duration {
	if r.o.NodeTimeout > 0 {
		return r.o.NodeTimeout
	}
	return min(ttl/4, 200*time.Millisecond)
}

// errNodeTimeout marks a node that did not answer within the node timeout.
var errNodeTimeout = errors.New("no answer within the node timeout")

// onNodes runs f on the given nodes (all when nodes is nil) in parallel and
// returns each node's reply and error. It returns when every node has answered,
// when enough(answers so far) says the outcome is decided, or after timeout: a
// node that has not answered by then counts as failed (errNodeTimeout), whether
// or not its client honours context deadlines (go-redis only does with
// ContextTimeoutEnabled). Calls still running when it returns early go on in
// the background until the timeout cancels them: a late release still frees its
// node. ctx's end ends the wait, and the calls too unless detach is set.
func (r *Redlock) onNodes(ctx context.Context, timeout time.Duration, detach bool, nodes []int, f func(ctx context.Context, i int, c Client) (any, error), enough func(ok, refused, failed int) bool) ([]any, []error) {
	if nodes == nil {
		nodes = make([]int, len(r.nodes))
		for i := range nodes {
			nodes[i] = i
		}
	}
	type reply struct {
		i   int
		res any
		err error
	}
	replies := make(chan reply, len(nodes))
	nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	cancels := ctx // the caller's cancellation still counts, unless detached
	if detach {
		cancels = context.Background()
	}
	stop := context.AfterFunc(cancels, cancel)
	defer stop()
	for _, i := range nodes {
		go func() {
			res, err := f(nctx, i, r.nodes[i])
			replies <- reply{i, res, err}
		}()
	}
	res := make([]any, len(r.nodes))
	errs := make([]error, len(r.nodes))
	for _, i := range nodes {
		errs[i] = errNodeTimeout
	}
	ok, refused, failed := 0, 0, 0
	for n := 0; n < len(nodes); n++ {
		select {
		case rep := <-replies:
			res[rep.i], errs[rep.i] = rep.res, rep.err
			switch {
			case rep.err != nil:
				failed++
			case rep.res == int64(1) || isGrant(rep.res):
				ok++
			default:
				refused++
			}
			if enough != nil && enough(ok, refused, failed) {
				return res, errs
			}
		case <-nctx.Done():
			return res, errs
		case <-ctx.Done():
			return res, errs
		}
	}
	return res, errs
}

// isGrant reports whether a lock script reply is {1, counter}.
func isGrant(res any) bool {
	arr, ok := res.([]any)
	return ok && len(arr) == 2 && arr[0] == int64(1)
}

// TryAcquire grants the lease on name on a majority of nodes. A ttl not
// longer than Drift (by default 1% of the ttl plus 2ms) is fence.ErrInvalid.
// It returns
// fence.ErrHeld when no majority could be locked although enough nodes answered
// (another holder has the lock, or contenders split the votes), and ErrNoQuorum
// (joined with the nodes' errors) when so many nodes failed to answer that no
// majority was possible.
func (r *Redlock) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := checkLease(ctx, name, ttl, r.o.Drift); err != nil {
		return nil, err
	}
	lock, counter := lockKeys(r.o.Prefix, name)
	nonce := newNonce()
	keys := []string{lock, counter, releasedKey(lock, nonce)}
	timeout := r.nodeTimeout(ttl)
	drift := r.o.Drift
	if drift <= 0 {
		drift = leasekit.DefaultDrift(ttl)
	}
	sent := time.Now()
	// Phase 1 ends as soon as a majority granted, or so many refused (or so
	// many failed) that none can. The granted majority's counters are enough to choose the
	// token: the previous grant raised a majority, which overlaps this one.
	res, errs := r.onNodes(ctx, timeout, false, nil, func(ctx context.Context, i int, c Client) (any, error) {
		return redlockLockScript.Run(ctx, c, keys, nodeValue(nonce, i), ttlMs(ttl)).Result()
	}, func(ok, refused, failed int) bool {
		return ok >= r.quorum || refused > len(r.nodes)-r.quorum || failed > len(r.nodes)-r.quorum
	})
	var (
		granted, refused []int
		maxCounter       uint64
		nodeErrs         []error
	)
	for i := range r.nodes {
		if errs[i] != nil {
			nodeErrs = append(nodeErrs, fmt.Errorf("node %d: %w", i, scriptError(errs[i])))
			continue
		}
		flag, n, err := parsePair(res[i])
		if err != nil {
			nodeErrs = append(nodeErrs, fmt.Errorf("node %d: %w", i, err))
			continue
		}
		maxCounter = max(maxCounter, n)
		if flag == 1 {
			granted = append(granted, i)
		} else {
			refused = append(refused, i)
		}
	}
	unlockAll := func() {
		// On every node: one that timed out may hold it anyway. The wait
		// for answers ends with ctx; the releases go on (releaseOn).
		r.releaseOn(ctx, timeout, lock, nonce, ttl)
	}
	if len(granted) < r.quorum {
		unlockAll()
		failed := len(r.nodes) - len(granted) - len(refused)
		if failed <= len(r.nodes)-r.quorum {
			// Enough nodes answered that a majority was possible: some of them
			// hold the lock (another holder, or a split vote). Worth retrying.
			return nil, fence.ErrHeld
		}
		var corrupt *CorruptError
		for _, e := range nodeErrs {
			if errors.As(e, &corrupt) {
				return nil, fmt.Errorf("redislua: redlock acquire %q: %w", name, e)
			}
		}
		return nil, fmt.Errorf("redislua: redlock acquire %q: %d of %d nodes granted, %d refused: %w",
			name, len(granted), len(r.nodes), len(refused), errors.Join(append([]error{ErrNoQuorum}, nodeErrs...)...))
	}
	tok := maxCounter + 1
	if tok > uint64(fence.MaxToken) {
		unlockAll()
		return nil, fmt.Errorf("redislua: redlock acquire %q: %w", name, fence.ErrTokensExhausted)
	}
	tokStr := strconv.FormatUint(tok, 10)
	raised := 0
	rres, rerrs := r.onNodes(ctx, timeout, false, granted, func(ctx context.Context, i int, c Client) (any, error) {
		return redlockRaiseScript.Run(ctx, c, keys[:2], nodeValue(nonce, i), tokStr).Int64()
	}, nil)
	live := granted[:0:0]
	for _, i := range granted {
		if rerrs[i] == nil && rres[i] == int64(1) {
			raised++
			live = append(live, i)
		}
	}
	validity := ttl - time.Since(sent) - drift
	if raised < r.quorum || validity <= 0 {
		unlockAll()
		return nil, fmt.Errorf("redislua: redlock acquire %q: the grant took too long (%d of %d nodes kept it, %v of %v left): %w",
			name, raised, len(r.nodes), validity, ttl, ErrNoQuorum)
	}
	return &redlockLease{Base: leasekit.New(name, fence.Token(tok), ttl, drift, sent), r: r, lock: lock, nonce: nonce, timeout: timeout}, nil
}

// Acquire waits until the lease on name is granted, retrying with jittered
// backoff while it is held, and also while too few nodes answer (a try that
// ends in ErrNoQuorum undid its grant on every node it reached, so trying
// again is safe): a wait outlasts a majority's restart or a slow round. When
// the wait ends (ctx, or the Backoff's MaxWait) the error matches
// fence.ErrHeld and the context's error, as fence.Acquirer says, and also
// ErrNoQuorum, joined with the nodes' errors, when the last try that ran to
// its end found no majority. A corrupt key and fence.ErrTokensExhausted end the wait at once.
func (r *Redlock) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := checkLease(ctx, name, ttl, r.o.Drift); err != nil {
		return nil, err
	}
	var noQuorum error // the last try's, when it found no majority
	l, err := leasekit.Acquire(ctx, r.o.Backoff, nil, func(ctx context.Context) (fence.Lease, error) {
		l, err := r.TryAcquire(ctx, name, ttl)
		if ctx.Err() == nil { // a try that ctx cut short says nothing of the nodes
			noQuorum = nil
			if errors.Is(err, ErrNoQuorum) {
				noQuorum = err
			}
		}
		if errors.Is(err, ErrNoQuorum) {
			return nil, fence.ErrHeld // wait and try again
		}
		return l, err
	})
	if err != nil && noQuorum != nil && errors.Is(err, fence.ErrHeld) {
		err = errors.Join(err, noQuorum)
	}
	return l, err
}

// nodeValue is the lock value of grant nonce on node i: a lock call sent
// again by the client finds its own value and adopts it, and one to another
// node that is the same server (listed twice) does not.
func nodeValue(nonce string, i int) string { return nonce + "." + strconv.Itoa(i) }

// releasedKey is the key that marks the grant nonce of lock released on a
// node; it shares the lock's hash tag.
func releasedKey(lock, nonce string) string {
	return strings.TrimSuffix(lock, ":lock") + ":gone:" + nonce
}

// releaseOn deletes this grant's lock on every node and returns how many still
// had it. It also marks the grant released on every node it reaches, for the
// ttl, so that a lock call of this grant still on its way (sent before the
// release, or resent by the client) is refused where it lands: a release, a
// failed grant and an abandoned one leave no node locked whatever order the
// calls land in, unless a lock call arrives more than a ttl after the release
// reached its node.
//
// It waits for the nodes' answers until ctx ends or timeout passes, whichever
// is first; a node that has not answered by then counts as failed
// (errNodeTimeout). The calls do not end with ctx: each has the timeout of its
// own, and a node whose release got no answer (paused, cut off, restarting:
// a lock call of this grant may be held in its socket, to run when it comes
// back, or one that answered LOADING, BUSY and the like: see
// releaseAnswered) is sent the release again in the background, paced, for
// up to the ttl, until it answers.
func (r *Redlock) releaseOn(ctx context.Context, timeout time.Duration, lock, nonce string, ttl time.Duration) (int, []error) {
	keys := []string{lock, releasedKey(lock, nonce)}
	res, errs := r.onNodes(ctx, timeout, true, nil, func(nctx context.Context, i int, c Client) (any, error) {
		// Sent once: a release sent again after it ran finds the lock gone
		// and would report the grant lost; a lost reply is an error.
		res, err := runOnce(nctx, c, redlockReleaseScript, keys, nodeValue(nonce, i), ttlMs(ttl))
		if !releaseAnswered(err) {
			go releaseLater(context.WithoutCancel(ctx), c, keys, nodeValue(nonce, i), ttl, timeout)
		}
		return res, err
	}, nil)
	n := 0
	for i := range res {
		if errs[i] == nil && res[i] == int64(1) {
			n++
		}
	}
	return n, errs
}

// releaseLater sends a node's release again, paced by leaveDelay, until the
// node answers (whatever the answer) or the ttl has passed.
func releaseLater(ctx context.Context, c Client, keys []string, value string, ttl, timeout time.Duration) {
	bctx, cancel := context.WithTimeout(ctx, ttl+time.Second)
	defer cancel()
	for attempt := 0; ; attempt++ {
		if leaveDelay.Sleep(bctx, attempt) != nil {
			return
		}
		actx, cancel := context.WithTimeout(bctx, max(timeout, time.Second))
		err := redlockReleaseScript.Run(actx, c, keys, value, ttlMs(ttl)).Err()
		cancel()
		if releaseAnswered(err) {
			return
		}
	}
}

// releaseAnswered reports whether a release's outcome on its node is settled:
// the script ran (whatever it answered), or the client is closed and nothing
// more can be sent. A reply that says the node did not run it and may later
// (LOADING its data, BUSY with a script, OOM, a replica or cluster that cannot
// serve writes yet) is not an answer: the lock the release is for may still
// be there, or come back with the node's data.
func releaseAnswered(err error) bool {
	if err == nil || errors.Is(err, redis.ErrClosed) {
		return true
	}
	return isReply(err) && !notRun(err)
}

type redlockLease struct {
	*leasekit.Base
	r       *Redlock
	lock    string
	nonce   string
	timeout time.Duration
}

// Renew extends the lock on every node that still has it; it succeeds when a
// majority does, and the local deadline moves by ttl less drift from before the
// request. Fewer than a majority still holding it is fence.ErrLost; when the
// nodes that did not answer could make up the majority, the error matches
// fence.ErrUnknown and the local deadline does not move. A lease
// whose context has ended (released, or past its local deadline) is not
// renewed (fence.ErrLost), and a renewal the nodes applied after the local
// deadline passed is released at once, so no node holds the lock for another
// ttl for a holder that stopped.
func (l *redlockLease) Renew(ctx context.Context) error {
	if err := leasekit.CheckContext("renew", ctx); err != nil {
		return err
	}
	if l.Context().Err() != nil {
		return l.lost()
	}
	sent := time.Now()
	res, errs := l.r.onNodes(ctx, l.timeout, false, nil, func(ctx context.Context, i int, c Client) (any, error) {
		return renewScript.Run(ctx, c, []string{l.lock}, nodeValue(l.nonce, i), ttlMs(l.TTL())).Int64()
	}, nil)
	ok, gone := 0, 0
	for i := range res {
		switch {
		case errs[i] != nil:
		case res[i] == int64(1):
			ok++
		default:
			gone++
		}
	}
	if ok >= l.r.quorum {
		if !l.Extend(sent) {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.timeout)
			defer cancel()
			l.r.releaseOn(rctx, l.timeout, l.lock, l.nonce, l.TTL())
			return l.lost()
		}
		return nil
	}
	if gone > len(l.r.nodes)-l.r.quorum {
		l.End(fence.ErrLost)
		return l.lost()
	}
	// Here the nodes that did not answer could make up the majority, and
	// they may have extended: the local deadline does not move.
	return fmt.Errorf("redislua: redlock renew %q: %d of %d nodes extended: %w (extended or not): %w",
		l.Name(), ok, len(l.r.nodes), fence.ErrUnknown, errors.Join(append([]error{ErrNoQuorum}, errs...)...))
}

// Release deletes the lock on every node. It returns fence.ErrLost when fewer
// than a majority still had it. The release is sent once to each node; when
// nodes that did not answer (a lost reply, no reply within NodeTimeout) could
// make up the majority, the error matches fence.ErrUnknown.
func (l *redlockLease) Release(ctx context.Context) error {
	if err := leasekit.CheckContext("release", ctx); err != nil {
		return err
	}
	n, errs := l.r.releaseOn(ctx, l.timeout, l.lock, l.nonce, l.TTL())
	l.End(context.Canceled)
	if n >= l.r.quorum {
		return nil
	}
	failed := 0
	for _, e := range errs {
		if e != nil {
			failed++
		}
	}
	if n+failed >= l.r.quorum && failed > 0 {
		return fmt.Errorf("redislua: redlock release %q: %d nodes released, %d did not answer: %w: %w", l.Name(), n, failed, fence.ErrUnknown, errors.Join(errs...))
	}
	return l.lost()
}

func (l *redlockLease) lost() error {
	return fmt.Errorf("redislua: redlock lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}
