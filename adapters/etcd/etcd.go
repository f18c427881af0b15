package etcdfence

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// AcquirerOptions configures an Acquirer. A nil *AcquirerOptions means the
// defaults.
type AcquirerOptions struct {
	// Prefix is the key prefix of every lock. Default: "/fencekit/locks/".
	Prefix string
	// Drift is taken off each lease's local deadline. Default: 1% of the ttl
	// plus 2ms. A TryAcquire or Acquire whose ttl is not longer than a Drift
	// set here returns an error matching fence.ErrInvalid naming the ttl.
	Drift time.Duration
	// MaxWait bounds Acquire's wait when ctx has no deadline. Default: 30s.
	MaxWait time.Duration
	// Owner is stored as the lock key's value, for operators. Default: host name and process id.
	Owner string
	// NoPool turns off the lease pool: every grant then waits for an etcd
	// lease granted on the spot, and its lease's local deadline counts from
	// that grant. Default: false (the pool is on; see Acquirer).
	NoPool bool
}

// Acquirer grants leases from etcd. It is safe for concurrent use.
//
// Unless AcquirerOptions.NoPool is set, a Release deletes the lock key and keeps its
// etcd lease, which then holds no key, in the acquirer's pool, and the next
// grant of the same ttl (in whole seconds) puts its key on that lease: a
// grant and its release are two Raft writes (the grant's transaction and the
// delete) instead of three (a lease grant, the transaction, a revoke). A
// waiter's lease, once its key moved onto the lock's lease, is pooled for
// the next waiter the same way. Each grant still has an etcd lease to itself
// while it holds it: only its own renewals keep it alive, so a holder that
// stops renewing loses the lock at its ttl and a dead holder's lock frees
// itself at its ttl. A lease is pooled again only when no request of the
// grant that used it can still reach etcd (the delete was confirmed, no
// Renew was under way, every renewal was answered); otherwise it is revoked.
//
// A pooled lease's etcd clock counts from its last confirmed grant or
// keep-alive, and so does the local deadline of the grant that takes it: a
// grant from the pool may hold up to a tenth of its ttl (at most 10s) less
// than one granted on the spot (its Context ends that much earlier unless it
// is renewed). A lease pooled for longer than that is revoked in the
// background, never used; one released past half that time is refreshed by
// one keep-alive first. The pool holds one lease for each of up to 8 ttls.
// Close revokes the pooled leases; without Close they expire at their ttl,
// holding no key.
type Acquirer struct {
	c    *clientv3.Client
	o    AcquirerOptions
	pool *pool // nil with NoPool
}

var _ fence.Acquirer = (*Acquirer)(nil)

// NewAcquirer returns an Acquirer on c.
func NewAcquirer(c *clientv3.Client, opts *AcquirerOptions) (*Acquirer, error) {
	if c == nil {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "client", Reason: "nil"}
	}
	var o AcquirerOptions
	if opts != nil {
		o = *opts
	}
	if o.Prefix == "" {
		o.Prefix = "/fencekit/locks/"
	}
	if !strings.HasSuffix(o.Prefix, "/") {
		o.Prefix += "/"
	}
	if o.Drift < 0 || o.MaxWait < 0 {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "options", Reason: "Drift and MaxWait may not be negative"}
	}
	if o.MaxWait == 0 {
		o.MaxWait = fence.DefaultMaxWait
	}
	if o.Owner == "" {
		host, _ := os.Hostname()
		o.Owner = fmt.Sprintf("%s/%d", host, os.Getpid())
	}
	a := &Acquirer{c: c, o: o}
	if !o.NoPool {
		a.pool = newPool(c)
	}
	return a, nil
}

// Close revokes the leases the acquirer holds in its pool, after waiting for
// the pool's keep-alives under way (each gives up within a twentieth of its
// ttl, at most 5s), and stops pooling. It waits for etcd's answers until ctx ends and returns the
// first error; a pooled lease whose revoke failed holds no key and expires
// at its ttl. It does not release granted leases, and the acquirer still
// grants afterwards, each grant waiting for an etcd lease of its own. Close
// may be called more than once.
func (a *Acquirer) Close(ctx context.Context) error {
	if err := leasekit.CheckContext("close", ctx); err != nil {
		return err
	}
	if a.pool == nil {
		return nil
	}
	if err := a.pool.close(ctx); err != nil {
		return fmt.Errorf("etcdfence: close: revoking a pooled lease: %w", err)
	}
	return nil
}

// MinTTL is the shortest lease: etcd counts lease time in whole seconds.
const MinTTL = time.Second

// MaxTTL is the longest lease: etcd refuses a lease over 9,000,000,000 seconds
// (about 285 years). The ttl is rounded up to whole seconds, so MaxTTL plus
// anything is refused.
const MaxTTL = 9_000_000_000 * time.Second

// MaxNameBytes is the longest lock name, in bytes. A name is escaped into the
// key (up to three bytes for one), and etcd bounds the size of a request.
const MaxNameBytes = 4096

func (a *Acquirer) check(ctx context.Context, name string, ttl time.Duration) error {
	if err := leasekit.CheckContext("acquire", ctx); err != nil {
		return err
	}
	if err := checkName("acquire", name); err != nil {
		return err
	}
	if d := a.o.Drift; d > 0 && ttl > 0 && ttl <= d {
		// The local deadline would be past before the grant is made.
		return &fence.InvalidError{Op: "acquire", Arg: "ttl", Reason: fmt.Sprintf("%v is not longer than the acquirer's Drift %v: the lease would be lost at once", ttl, d)}
	}
	return leasekit.CheckTTL("acquire", ttl, MinTTL, MaxTTL)
}

// checkName refuses an empty name or one over MaxNameBytes; any bytes are
// allowed, since the name is escaped into the key.
func checkName(op, name string) error {
	if err := leasekit.CheckName(op, name); err != nil {
		return err
	}
	if len(name) > MaxNameBytes {
		return &fence.InvalidError{Op: op, Arg: "name", Reason: fmt.Sprintf("%d bytes, over this backend's limit of %d", len(name), MaxNameBytes)}
	}
	return nil
}

// lockPrefix is the directory of name's queue; the name is escaped so that one
// name's directory is never inside another's.
func (a *Acquirer) lockPrefix(name string) string {
	return a.o.Prefix + url.PathEscape(name) + "/"
}

// TryAcquire grants the lease on name for ttl (at least 1s), or returns
// fence.ErrHeld at once. One round trip with an etcd lease from the pool,
// two without: the etcd lease, then one transaction that creates the key if
// the line is empty. A transaction whose answer was
// lost is recognised by reading the key (the lease is returned), or reported
// as not granted, its etcd lease being revoked. A key found only after the
// lease's local deadline passed (the reads were tried again through a cut) is
// given back the same way, with an error: never a lease already lost.
func (a *Acquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check(ctx, name, ttl); err != nil {
		return nil, err
	}
	return a.acquire(ctx, name, ttl, false)
}

// Acquire waits in line for the lease on name. It gives up at ctx's deadline,
// or after MaxWait when ctx has none, with an error matching fence.ErrHeld and
// the context error; its place in line is given up then. A step that fails
// for the network's sake (a cut connection, no leader for now: gRPC's
// Unavailable) is tried again within ctx: a step whose answer was lost is
// recognised by its own key (named after its own etcd lease), so one Acquire
// never holds two places in line, and an attempt that cannot tell revokes its
// leases before the next begins. A waiter cut off from etcd for WaiterTTL
// loses its place (its waiter lease expires) and joins the line again at its
// end: Acquire returns ErrHeld only with the context's error. A lease it returns was confirmed by etcd after its turn came: never one
// already lost.
func (a *Acquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check(ctx, name, ttl); err != nil {
		return nil, err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, a.o.MaxWait,
			fmt.Errorf("etcdfence: gave up after the maximum wait %v: %w", a.o.MaxWait, context.DeadlineExceeded))
		defer cancel()
	}
	for attempt := 0; ; attempt++ {
		l, err := a.acquire(ctx, name, ttl, true)
		if err == nil || !(transient(err) || errors.Is(err, errPlaceExpired)) {
			return l, err
		}
		if retryDelay.Sleep(ctx, attempt) != nil {
			return nil, a.fail(ctx, "acquire", name, err)
		}
	}
}

// maxExpired bounds how many fresh etcd leases a TryAcquire takes when each
// expires before the transaction that uses it reaches etcd.
const maxExpired = 3

// retryDelay spaces the tries of a step that failed for the network's sake.
var retryDelay = fence.Backoff{Min: 10 * time.Millisecond, Max: 500 * time.Millisecond}

// errLate is a grant confirmed only after its local deadline: its etcd lease
// is being revoked and it holds nothing. It matches fence.ErrLost (what
// TryAcquire returns), and is transient, so Acquire tries again.
var errLate = fmt.Errorf("%w (confirmed after its local deadline)", fence.ErrLost)

// errPlaceExpired ends a wait whose key left the line because its waiter
// lease expired (keep-alives lost for WaiterTTL): Acquire joins the line
// again at its end, within its context.
var errPlaceExpired = fmt.Errorf("its place in line expired while it waited: %w", fence.ErrHeld)

// transient reports whether err is the network's (gRPC's Unavailable: a cut
// connection, a member without a leader for now): the step did not, or may
// not, have happened, and may be tried again once its outcome is settled.
func transient(err error) bool {
	if errors.Is(err, errLate) {
		return true
	}
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return ee.Code() == codes.Unavailable
	}
	s, ok := status.FromError(err)
	return ok && s.Code() == codes.Unavailable
}

// retrying runs step until it returns nil or an error that is not transient,
// spacing the tries, or until ctx ends (then the step's last error). Only
// for steps that are safe to repeat: reads, and writes that recognise their
// own earlier landing.
// freshLease grants a lock lease of ttl for a waiter whose turn came, again
// after a transient error (a grant whose answer was lost leaves a lease no
// key is on: it expires at its ttl and holds nothing), and returns it with
// the send time of the grant that was answered.
func (a *Acquirer) freshLease(ctx context.Context, ttl time.Duration) (clientv3.LeaseID, time.Time, error) {
	var (
		lg   *clientv3.LeaseGrantResponse
		sent time.Time
	)
	err := retrying(ctx, func() (err error) {
		sent = time.Now()
		lg, err = a.c.Grant(ctx, seconds(ttl))
		return err
	})
	if err != nil {
		return 0, time.Time{}, err
	}
	return lg.ID, sent, nil
}

func retrying(ctx context.Context, step func() error) error {
	for attempt := 0; ; attempt++ {
		err := step()
		if err == nil || !transient(err) || ctx.Err() != nil {
			return err
		}
		if retryDelay.Sleep(ctx, attempt) != nil {
			return err
		}
	}
}

func seconds(ttl time.Duration) int64 { return leasekit.CeilDiv(ttl, time.Second) }

// WaiterTTL is the etcd lease of a key waiting in line: a waiter that dies (or
// is cut off from the cluster) leaves the line within about this long, whatever
// the lock's ttl, and the next waiter moves up. A waiter renews it every third
// of it; once at the head of the line, its key moves to a lease with the lock's
// ttl and keeps its create revision, the token.
const WaiterTTL = 3 * time.Second

func (a *Acquirer) acquire(ctx context.Context, name string, ttl time.Duration, wait bool) (fence.Lease, error) {
	pfx := a.lockPrefix(name)
	id, sent, pooled := a.takePooled(ttl)
	for expired := 0; ; {
		if !pooled {
			sent = time.Now()
			lg, err := a.c.Grant(ctx, seconds(ttl))
			if err != nil {
				return nil, a.fail(ctx, "acquire", name, err)
			}
			id = lg.ID
		}
		key := keyOf(pfx, id)
		// The key is created only if the line is empty, in one transaction: a
		// TryAcquire that loses never enters the line, so a loser whose cleanup
		// fails blocks nobody.
		txn, err := a.c.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(pfx).WithPrefix(), "=", 0)).
			Then(clientv3.OpPut(key, a.o.Owner, clientv3.WithLease(id))).
			Commit()
		if isLeaseNotFound(err) && (pooled || wait || expired < maxExpired) {
			// etcd no longer has the lease (a pooled one revoked, or
			// expired sooner than the pool counted; a fresh one whose ttl
			// ran out before the transaction reached etcd, on a cluster
			// slower than the ttl): a put on it fails, so the transaction
			// created nothing. Take a lease on the spot: within ctx for
			// Acquire, at most maxExpired times for TryAcquire.
			if !pooled {
				expired++
				if retryDelay.Sleep(ctx, expired-1) != nil {
					return nil, a.fail(ctx, "acquire", name, err)
				}
			}
			pooled = false
			continue
		}
		if isLeaseNotFound(err) {
			return nil, a.fail(ctx, "acquire", name, fmt.Errorf("%d fresh etcd leases expired before the transaction that uses each reached etcd (the cluster answers slower than the ttl): %w", expired+1, err))
		}
		if err != nil {
			// The answer was lost: the key may have been created. Look.
			rev, ok, gerr := a.created(ctx, key, id)
			if ok {
				return a.granted(name, key, rev, ttl, id, sent, false)
			}
			// A create that lands after the revoke fails, or is deleted by it.
			return nil, a.notGranted(ctx, name, err, gerr, id)
		}
		if txn.Succeeded {
			return a.granted(name, key, txn.Header.Revision, ttl, id, sent, true)
		}
		if !wait {
			// No key uses the lease: pool it (again), or revoke it.
			if a.pool != nil {
				a.pool.put(id, sent, ttl)
			} else {
				a.revoke(id, ttl)
			}
			return nil, fmt.Errorf("etcdfence: acquire %q: %w", name, fence.ErrHeld)
		}
		return a.waitInLine(ctx, name, pfx, ttl, id, sent)
	}
}

// keyOf names the key in line pfx of the grant whose lock lease is id (a
// waiter's key too is named after the lock lease, not its waiter lease):
// one grant holds a lock lease at a time, and its key is gone before the
// lease is pooled again, so no two keys in line share a name, while a
// pooled lease's grants of one name reuse one key (as a Mutex on a session
// does) instead of leaving a deleted key behind for each grant, which
// etcd's index keeps until a compaction and every grant's check of the line
// would scan. The name lets a grant recognise its own key after a lost
// answer.
func keyOf(pfx string, id clientv3.LeaseID) string {
	return fmt.Sprintf("%s%016x", pfx, int64(id))
}

// takePooled returns a pooled etcd lease for ttl and the send time of its
// grant, or ok false (no pool, or nothing pooled).
func (a *Acquirer) takePooled(ttl time.Duration) (clientv3.LeaseID, time.Time, bool) {
	if a.pool == nil {
		return 0, time.Time{}, false
	}
	return a.pool.take(ttl)
}

// created reports whether key exists on lease id (a create whose answer was
// lost), and its create revision; err when it could not look.
func (a *Acquirer) created(ctx context.Context, key string, id clientv3.LeaseID) (int64, bool, error) {
	if err := ctx.Err(); err != nil {
		return 0, false, err
	}
	var resp *clientv3.GetResponse
	err := retrying(ctx, func() (err error) {
		resp, err = a.c.Get(ctx, key)
		return err
	})
	if err != nil {
		return 0, false, err
	}
	if len(resp.Kvs) == 0 || clientv3.LeaseID(resp.Kvs[0].Lease) != id {
		return 0, false, nil
	}
	return resp.Kvs[0].CreateRevision, true, nil
}

// notGranted is the error of a grant whose answer was lost (err) and whose key
// was not found (or could not be looked for: lookErr). Its lease is being
// revoked, so the grant does not hold the name either way: the error says
// so, instead of a bare transport error.
func (a *Acquirer) notGranted(ctx context.Context, name string, err, lookErr error, leases ...clientv3.LeaseID) error {
	for _, l := range leases {
		a.revoke(l, time.Minute)
	}
	if ctx.Err() != nil {
		return errors.Join(fence.ErrHeld, context.Cause(ctx))
	}
	if lookErr != nil {
		err = fmt.Errorf("%w, and looking for its key: %w", err, lookErr)
	}
	return fmt.Errorf("etcdfence: acquire %q: not granted (its answer was lost: %w; its etcd lease is revoked, so a late create cannot hold the name)", name, err)
}

// granted is the lease whose key was created at revision rev, on etcd lease
// id whose clock counts from a request sent at sent (its grant, or its last
// confirmed keep-alive). clean reports that every request of this grant that
// named the lease was answered (none may land later), so that the lease may
// be pooled again at the release.
func (a *Acquirer) granted(name, key string, rev int64, ttl time.Duration, id clientv3.LeaseID, sent time.Time, clean bool) (fence.Lease, error) {
	tok := fence.Token(rev)
	if !tok.Valid() {
		a.revoke(id, ttl)
		return nil, fmt.Errorf("etcdfence: acquire %q: revision %d: %w", name, rev, fence.ErrTokensExhausted)
	}
	l := &lease{Base: leasekit.New(name, tok, ttl, a.o.Drift, sent), a: a, id: id, key: key, sent: sent, dirty: !clean}
	if l.Context().Err() != nil {
		// Retries (lookups after a lost answer, a move sent again) took
		// so long that the local deadline passed: give the key back, in
		// the background so that a cluster still unreachable does not
		// hold the caller, rather than return a lease already lost.
		a.revoke(id, ttl)
		return nil, fmt.Errorf("etcdfence: acquire %q: granted past its local deadline (its etcd lease is revoked): %w", name, errLate)
	}
	return l, nil
}

// revoke revokes etcd lease id in the background, trying again until it is
// gone, or for the lease's ttl (at most a minute), or until the client is
// closed: a key on it leaves the line, in whatever order a late request and
// the revoke reach etcd (a create on a revoked lease fails). A lease whose
// revoke fails for longer expires at its ttl.
func (a *Acquirer) revoke(id clientv3.LeaseID, ttl time.Duration) { revokeLease(a.c, id, ttl) }

// revokeLease is Acquirer.revoke on client c.
func revokeLease(c *clientv3.Client, id clientv3.LeaseID, ttl time.Duration) {
	go func() {
		ctx, cancel := context.WithTimeout(c.Ctx(), min(ttl, time.Minute)+time.Second)
		defer cancel()
		for attempt := 0; ; attempt++ {
			_, err := c.Revoke(ctx, id)
			if err == nil || isLeaseNotFound(err) || ctx.Err() != nil || errors.Is(err, context.Canceled) {
				return
			}
			if (fence.Backoff{Min: 50 * time.Millisecond, Max: time.Second}).Sleep(ctx, attempt) != nil {
				return
			}
		}
	}()
}

// isLeaseNotFound reports whether etcd answered that it has no such lease.
func isLeaseNotFound(err error) bool { return errors.Is(err, rpctypes.ErrLeaseNotFound) }

// waitInLine queues a key for name on a short etcd lease (WaiterTTL), waits
// until it heads the line, then moves it to lease id, which has the lock's ttl
// (granted by a request sent at sent) and is kept alive meanwhile; no key is on
// it until then, so a waiter that dies leaves nothing that blocks the line.
func (a *Acquirer) waitInLine(ctx context.Context, name, pfx string, ttl time.Duration, id clientv3.LeaseID, sent time.Time) (fence.Lease, error) {
	giveUp := func(err error, leases ...clientv3.LeaseID) error {
		for _, l := range leases {
			a.revoke(l, ttl)
		}
		return a.fail(ctx, "acquire", name, err)
	}
	// The waiter's lease: from the pool (a lease an earlier waiter's key
	// moved off), or granted now.
	w, wSent, wPooled := a.takePooled(WaiterTTL)
	var (
		key  string
		rev  int64 // the create revision of our key: the token
		once bool  // the create was sent once: no copy of it may land later
		// fresh waiter leases that expired before their create arrived
		wExpired int
	)
	for {
		if !wPooled {
			wSent = time.Now()
			wl, err := a.c.Grant(ctx, seconds(WaiterTTL))
			if err != nil {
				return nil, giveUp(err, id)
			}
			w = wl.ID
		}
		key = keyOf(pfx, id)
		var err error
		rev, once, err = a.joinLine(ctx, key, w)
		if isLeaseNotFound(err) {
			// etcd no longer has the waiter lease (a pooled one revoked or
			// expired; a fresh one whose WaiterTTL ran out before the
			// create reached etcd): the create failed, or landed and left
			// with the lease. Join on a new one, within ctx.
			if !wPooled {
				wExpired++
				if retryDelay.Sleep(ctx, wExpired-1) != nil {
					return nil, giveUp(err, id)
				}
			}
			wPooled = false
			continue
		}
		if err != nil {
			return nil, giveUp(err, id, w)
		}
		break
	}
	turn, err := a.waitTurn(ctx, pfx, w, rev, id, ttl, sent, wSent)
	if err != nil {
		return nil, giveUp(err, id, w)
	}
	// A copy of the key's create that may land later names the key after
	// id: id is not pooled again either.
	sent, clean := turn.sent, turn.clean && once
	if time.Since(sent) > ttl/2 {
		// The lock's lease was not confirmed lately (keep-alives lost):
		// take a fresh one rather than a short local deadline.
		a.revoke(id, ttl)
		var err error
		if id, sent, err = a.freshLease(ctx, ttl); err != nil {
			return nil, giveUp(err, w)
		}
		clean = true
	}
	// Our turn: move the key to the lock's lease, if it is still on the
	// waiter's lease (it did not expire meanwhile). One round trip. The move
	// is conditional, so it is safe to send again when its answer was lost
	// and the key is found still on the waiter's lease, still heading the
	// line: it was not applied (etcd cancels a request whose connection
	// closed), and the waiter keeps its turn.
	for attempt := 0; ; attempt++ {
		txn, err := a.c.Txn(ctx).
			If(clientv3.Compare(clientv3.LeaseValue(key), "=", int64(w))).
			Then(clientv3.OpPut(key, a.o.Owner, clientv3.WithLease(id))).
			Commit()
		if err == nil && txn.Succeeded {
			// No key uses the waiter's lease now: pool it for the next
			// waiter when no request that named it (its key's create, its
			// keep-alives) may land later.
			if a.pool != nil && once && turn.wClean {
				a.pool.put(w, turn.wSent, WaiterTTL)
			} else {
				a.revoke(w, WaiterTTL)
			}
			return a.granted(name, key, rev, ttl, id, sent, clean)
		}
		if isLeaseNotFound(err) {
			// etcd no longer has the lock's lease (a pooled lease revoked
			// behind the pool, or one that expired while its keep-alives
			// were lost): the put failed, nothing moved. Move the key onto a
			// lease granted now.
			var gerr error
			if id, sent, gerr = a.freshLease(ctx, ttl); gerr != nil {
				return nil, giveUp(gerr, w)
			}
			clean = true
			continue
		}
		if err == nil {
			err = errPlaceExpired
		}
		// Where is the key? One read: on the lock's lease (moved: an
		// earlier move, or this one with its answer lost, landed), still on
		// the waiter's (not moved), or gone.
		lease, gerr := a.keyLease(ctx, key, rev)
		switch {
		case lease == id:
			a.revoke(w, WaiterTTL)
			return a.granted(name, key, rev, ttl, id, sent, false) // moved; the answer was lost
		case txn != nil:
			return nil, giveUp(err, id, w)
		case gerr == nil && lease == w && retryDelay.Sleep(ctx, attempt) == nil:
			continue // not moved: still ours to move, within ctx
		}
		return nil, a.notGranted(ctx, name, err, gerr, id, w)
	}
}

// joinLine creates key, a waiter's place in line, on waiter lease w and
// returns its create revision, and whether it was sent once only. The create
// is conditional on the key not existing, and answers with the key
// otherwise, so it is sent again after an answer lost to the network: a
// create that landed is recognised (no other request names the key), never
// made twice. A create sent more than once may still land after the key is
// gone, on w, if w lives: such a w is never pooled.
func (a *Acquirer) joinLine(ctx context.Context, key string, w clientv3.LeaseID) (int64, bool, error) {
	var (
		rev   int64
		sends int
	)
	err := retrying(ctx, func() error {
		sends++
		txn, err := a.c.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, a.o.Owner, clientv3.WithLease(w))).
			Else(clientv3.OpGet(key)).
			Commit()
		switch {
		case err != nil:
			return err
		case txn.Succeeded:
			rev = txn.Header.Revision
			return nil
		}
		kvs := txn.Responses[0].GetResponseRange().Kvs
		if len(kvs) != 1 || clientv3.LeaseID(kvs[0].Lease) != w {
			return fmt.Errorf("its key %q is on another lease", key)
		}
		rev = kvs[0].CreateRevision // an earlier send landed
		return nil
	})
	return rev, sends == 1, err
}

// keyLease is the lease of key if it exists with create revision rev (0 when
// it does not), or err when it could not look.
func (a *Acquirer) keyLease(ctx context.Context, key string, rev int64) (clientv3.LeaseID, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	var resp *clientv3.GetResponse
	err := retrying(ctx, func() (err error) {
		resp, err = a.c.Get(ctx, key)
		return err
	})
	if err != nil {
		return 0, err
	}
	if len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != rev {
		return 0, nil
	}
	return clientv3.LeaseID(resp.Kvs[0].Lease), nil
}

// fail wraps err; an ending ctx turns it into ErrHeld joined with the cause.
func (a *Acquirer) fail(ctx context.Context, op, name string, err error) error {
	if ctx.Err() != nil {
		return errors.Join(fence.ErrHeld, context.Cause(ctx))
	}
	return fmt.Errorf("etcdfence: %s %q: %w", op, name, err)
}

// errLookAgain: a watch ended without the event; read the line again.
var errLookAgain = errors.New("etcdfence: watch closed")

// turn is how a wait in line ended: the send times of the last confirmed
// grant or keep-alive of the lock's lease (sent) and of the waiter's
// (wSent), and whether every keep-alive of each that the wait sent was
// answered (clean, wClean: none may land later).
type turn struct {
	sent, wSent   time.Time
	clean, wClean bool
}

// waitTurn keeps waiter lease w and the lock's lease id alive and waits until
// no key in pfx was created before rev. sent and wSent are the send times of
// the grants of id and w. The lease's local deadline counts from the turn's
// sent. A waiter lease that etcd expired (the waiter was cut off for
// WaiterTTL) ends the wait with errPlaceExpired: its place in line is gone.
func (a *Acquirer) waitTurn(ctx context.Context, pfx string, w clientv3.LeaseID, rev int64, id clientv3.LeaseID, ttl time.Duration, sent, wSent time.Time) (turn, error) {
	var (
		mu       sync.Mutex
		aliveErr error
		res      = turn{sent: sent, wSent: wSent, clean: true, wClean: true}
	)
	kctx, stop := context.WithCancel(ctx)
	defer stop()
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTicker(WaiterTTL / 3)
		defer t.Stop()
		for {
			select {
			case <-kctx.Done():
				return
			case <-t.C:
			}
			// A keep-alive that cannot reach etcd gives up at the next
			// tick; the lease then runs out on etcd's clock.
			tctx, cancel := context.WithTimeout(kctx, WaiterTTL/3)
			ws := time.Now()
			_, wAgain, err := keepAliveOnce(tctx, a.c, w)
			mu.Lock()
			if wAgain {
				res.wClean = false // a copy may land later
			}
			switch {
			case err == nil:
				res.wSent = ws
			case !isLeaseNotFound(err):
				res.wClean = false // it may land later
			}
			last := res.sent
			mu.Unlock()
			if err == nil && time.Since(last) >= ttl/3 {
				s := time.Now()
				_, again, kerr := keepAliveOnce(tctx, a.c, id)
				mu.Lock()
				if again {
					res.clean = false // a copy may land later
				}
				switch {
				case kerr == nil:
					res.sent = s
				case !isLeaseNotFound(kerr):
					res.clean = false // it may land later
				}
				mu.Unlock()
			}
			cancel()
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				mu.Lock()
				aliveErr = errPlaceExpired
				mu.Unlock()
				stop()
				return
			}
		}
	}()
	done := func(err error) (turn, error) {
		stop()
		<-exited // no keep-alive under way
		mu.Lock()
		defer mu.Unlock()
		if aliveErr != nil {
			return turn{}, aliveErr
		}
		if err != nil {
			return turn{}, err
		}
		return res, nil
	}
	for attempt := 0; ; attempt++ {
		// The key just before ours in line.
		resp, err := a.c.Get(kctx, pfx, append(clientv3.WithLastCreate(), clientv3.WithMaxCreateRev(rev-1))...)
		if transient(err) {
			err = errLookAgain
		}
		if err == nil && len(resp.Kvs) == 0 {
			return done(nil)
		}
		if err == nil {
			err = a.waitDelete(kctx, string(resp.Kvs[0].Key), resp.Header.Revision)
		}
		if errors.Is(err, errLookAgain) {
			err = (fence.Backoff{Min: 10 * time.Millisecond, Max: 500 * time.Millisecond}).Sleep(kctx, attempt)
		}
		if err != nil {
			return done(err)
		}
	}
}

// waitDelete waits until key is deleted (at or after revision rev+1). A watch
// that ends otherwise (no leader, compaction, a closed stream) returns
// errLookAgain, and the caller reads the line again.
//
// Each watch has a gRPC stream of its own, and when the client's connection
// comes back after a break (a cut) the key is read once; if it is still
// there, the watch starts again from that read on a new stream. The client
// resumes a broken stream only after a backoff of its own (about 75ms
// measured here, for every watch sharing it), and a waiter whose turn came
// meanwhile would sit idle. Under 2% cuts this took the flaky-network
// benchmark (8 x 40) from about 0.5 to 0.8 of its jitter-only throughput.
func (a *Acquirer) waitDelete(ctx context.Context, key string, rev int64) error {
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	reconnected := a.reconnects(rctx)
	for from := rev + 1; ; {
		wctx, cancel := context.WithCancel(rctx)
		// A stream of its own: the client resumes a broken stream only
		// after a backoff, and one shared by every wait would hold them all.
		wctx = metadata.AppendToOutgoingContext(wctx, "fencekit-wait", fmt.Sprintf("%s@%d", key, from))
		wch := a.c.Watch(clientv3.WithRequireLeader(wctx), key, clientv3.WithRev(from))
		again, err := a.watchDelete(ctx, wch, reconnected, key, rev)
		cancel()
		if err != nil || again == 0 {
			return err
		}
		from = again
	}
}

// watchDelete waits on wch for key's deletion (nil). After a reconnection it
// reads key: gone (or created anew) is nil, still there returns the revision
// to watch again from on a new stream.
func (a *Acquirer) watchDelete(ctx context.Context, wch clientv3.WatchChan, reconnected <-chan struct{}, key string, rev int64) (int64, error) {
	for {
		select {
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil {
				if err := ctx.Err(); err != nil {
					return 0, err
				}
				return 0, errLookAgain
			}
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					return 0, nil
				}
			}
		case <-reconnected:
			// A read is retried by the client; one that fails leaves the
			// watch to tell.
			resp, err := a.c.Get(ctx, key)
			switch {
			case err != nil:
			case len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision > rev:
				return 0, nil
			default:
				return resp.Header.Revision + 1, nil
			}
		}
	}
}

// reconnects returns a channel that receives each time the client's
// connection is ready again after it was not, until ctx ends. The state is
// read before it returns, so a break that comes before its goroutine runs
// is seen; a connection that left Ready and was back by the time its state
// was read counts as a break too.
func (a *Acquirer) reconnects(ctx context.Context) <-chan struct{} {
	ch := make(chan struct{}, 1)
	conn := a.c.ActiveConnection()
	if conn == nil {
		return ch
	}
	s := conn.GetState()
	go func() {
		broken := s != connectivity.Ready
		for conn.WaitForStateChange(ctx, s) {
			was := s
			s = conn.GetState()
			if s != connectivity.Ready {
				broken = true
				continue
			}
			if broken || was == connectivity.Ready {
				broken = false
				select {
				case ch <- struct{}{}:
				default:
				}
			}
		}
	}()
	return ch
}

type lease struct {
	*leasekit.Base
	a   *Acquirer
	id  clientv3.LeaseID
	key string

	mu        sync.Mutex
	sent      time.Time // the send time of id's last confirmed grant or keep-alive
	renewing  int       // Renews under way
	dirty     bool      // a request naming id may still land: never pool id again
	releasing bool      // Release was called: no more requests
}

// Renew sends one keep-alive for the etcd lease, then reads the lock key. A
// lease etcd no longer has, or whose key is gone (deleted, so the name may be
// another's), returns fence.ErrLost and ends the lease's context; a read that
// fails returns an error matching fence.ErrUnknown and does not extend the
// local deadline. A lease whose context is done (released, lost, or
// past its local deadline) returns fence.ErrLost without a keep-alive, so a
// late Renew never holds the lock on etcd again; a keep-alive confirmed only
// after the local deadline passed is undone by revoking the etcd lease. A
// keep-alive is safe to repeat: the client sends it again after a lost answer
// until ctx ends, and an error then (matching fence.ErrUnknown) means the
// renewal was not confirmed (the lease still ends at its local deadline). A
// renewal that was not confirmed, or was sent more than once, keeps the etcd
// lease out of the pool: a copy of it may still land later.
func (l *lease) Renew(ctx context.Context) error {
	if err := leasekit.CheckContext("renew", ctx); err != nil {
		return err
	}
	l.mu.Lock()
	if l.releasing {
		l.mu.Unlock()
		return l.lost()
	}
	l.renewing++
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		l.renewing--
		l.mu.Unlock()
	}()
	if l.Context().Err() != nil {
		return l.lost()
	}
	sent := time.Now()
	_, again, err := keepAliveOnce(ctx, l.a.c, l.id)
	if again {
		// A copy sent before a break may still land, after the release:
		// never pool the etcd lease again.
		l.mu.Lock()
		l.dirty = true
		l.mu.Unlock()
	}
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		l.End(fence.ErrLost)
		return l.lost()
	}
	if err != nil {
		// The keep-alive may have reached etcd, or may yet: not confirmed,
		// the lease still ends at its local deadline, and the etcd lease is
		// never pooled again.
		l.mu.Lock()
		l.dirty = true
		l.mu.Unlock()
		return fmt.Errorf("etcdfence: renew %q: %w: %w", l.Name(), fence.ErrUnknown, err)
	}
	// The keep-alive renews the etcd lease, not the lock: the key may have
	// been deleted (by an operator) and the name granted to another.
	held, err := l.holds(ctx)
	if err != nil {
		// The etcd lease was renewed, but whether it still holds the lock
		// is not known: the local deadline is not extended.
		return fmt.Errorf("etcdfence: renew %q: %w: reading its key after the keep-alive: %w", l.Name(), fence.ErrUnknown, err)
	}
	if !held {
		l.End(fence.ErrLost)
		l.mu.Lock()
		l.dirty = true
		l.mu.Unlock()
		l.a.revoke(l.id, l.TTL())
		return fmt.Errorf("etcdfence: renew %q token %d: its key is gone (deleted, or expired): %w", l.Name(), l.Token(), fence.ErrLost)
	}
	if !l.Extend(sent) {
		l.mu.Lock()
		l.dirty = true
		l.mu.Unlock()
		l.a.revoke(l.id, l.TTL())
		return l.lost()
	}
	l.mu.Lock()
	if sent.After(l.sent) {
		l.sent = sent
	}
	l.mu.Unlock()
	return nil
}

// Release ends the grant: it deletes the lock key, which wakes the next
// waiter, and pools the etcd lease for the next grant (see Acquirer); a
// lease that cannot be pooled (the pool is off, a Renew is under way or a
// renewal was not confirmed, the local deadline has passed, the delete's
// answer was lost) is revoked instead, which deletes the key too. It
// returns fence.ErrLost when the lease had ended before (past its local
// deadline, found lost, or released; a second Release sends nothing), and
// when the key was found gone (expired, or deleted by an operator).
//
// The client sends a revoke again after a lost answer; etcd then no longer
// has the lease, and a lease still within its local deadline when that
// answer came cannot have expired on etcd (the deadline comes first), so
// that is our own revoke and Release returns nil; past the local deadline by
// then, the lease may have expired before the revoke landed, and Release
// returns fence.ErrLost. A revoke that cannot be confirmed before ctx ends
// goes on in the background until the lease is gone or its ttl has passed;
// Release then returns an error matching fence.ErrUnknown.
func (l *lease) Release(ctx context.Context) error {
	if err := leasekit.CheckContext("release", ctx); err != nil {
		return err
	}
	l.mu.Lock()
	again := l.releasing
	l.releasing = true
	pool := !again && l.a.pool != nil && l.renewing == 0 && !l.dirty
	sent := l.sent
	l.mu.Unlock()
	if again {
		// Its etcd lease may be another grant's by now: send nothing.
		return l.lost()
	}
	ended := l.Context().Err() != nil // expired, found lost, or released before
	if pool && !ended {
		txn, err := l.a.c.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(l.key), "=", int64(l.Token()))).
			Then(clientv3.OpDelete(l.key)).
			Commit()
		if err == nil {
			l.End(context.Canceled)
			if !txn.Succeeded {
				// The key is gone: expired, or deleted by an operator
				// (the etcd lease may live on: revoke it).
				l.a.revoke(l.id, l.TTL())
				return l.lost()
			}
			l.a.pool.put(l.id, sent, l.TTL())
			return nil
		}
		// The answer was lost: the key may be deleted or not. Revoke the
		// etcd lease, which settles it either way.
	}
	_, err := l.a.c.Revoke(ctx, l.id)
	lapsed := l.Context().Err() != nil // the local deadline passed on the way
	l.End(context.Canceled)
	switch {
	case err == nil:
		if ended {
			return l.lost()
		}
		return nil
	case errors.Is(err, rpctypes.ErrLeaseNotFound):
		if ended || lapsed {
			return l.lost() // etcd may have expired it before the revoke landed
		}
		return nil
	default:
		l.a.revoke(l.id, l.TTL())
		return fmt.Errorf("etcdfence: release %q: %w: %w", l.Name(), fence.ErrUnknown, err)
	}
}

// holds reports whether the lease's key exists with the grant's create
// revision (its token) on the lease's etcd lease: only then does the name
// belong to this grant. The read is linearizable, so it sees a deletion
// made before it was sent.
func (l *lease) holds(ctx context.Context) (bool, error) {
	resp, err := l.a.c.Get(ctx, l.key)
	if err != nil {
		return false, err
	}
	if len(resp.Kvs) != 1 {
		return false, nil
	}
	kv := resp.Kvs[0]
	return kv.CreateRevision == int64(l.Token()) && clientv3.LeaseID(kv.Lease) == l.id, nil
}

func (l *lease) lost() error {
	return fmt.Errorf("etcdfence: lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}

var _ fence.Inspector = (*Acquirer)(nil)

// Inspect reports name's holder (the oldest key in its queue), time left on its
// etcd lease, and as Counter the cluster's current revision: every later
// grant's token (a create revision) is larger. etcd has no counter to bump.
func (a *Acquirer) Inspect(ctx context.Context, name string) (fence.LockInfo, error) {
	if err := leasekit.CheckContext("inspect", ctx); err != nil {
		return fence.LockInfo{}, err
	}
	if err := checkName("inspect", name); err != nil {
		return fence.LockInfo{}, err
	}
	resp, err := a.c.Get(ctx, a.lockPrefix(name), clientv3.WithFirstCreate()...)
	if err != nil {
		return fence.LockInfo{}, fmt.Errorf("etcdfence: inspect %q: %w", name, err)
	}
	info := fence.LockInfo{Name: name, Counter: fence.Token(resp.Header.Revision)}
	if len(resp.Kvs) == 0 {
		return info, nil // free; etcd cannot tell a name never used from a free one
	}
	kv := resp.Kvs[0]
	info.Held, info.Token, info.Owner = true, fence.Token(kv.CreateRevision), string(kv.Value)
	if kv.Lease != 0 {
		if ttl, err := a.c.TimeToLive(ctx, clientv3.LeaseID(kv.Lease)); err == nil && ttl.TTL > 0 {
			info.TimeLeft = time.Duration(ttl.TTL) * time.Second
		}
	}
	return info, nil
}
