// Package etcdfence grants fenced leases from etcd, a consensus store: grants are
// linearizable, and the token is the revision at which the holder's lock key was
// created, which the whole cluster agrees on and which only grows, across
// leader changes and the loss of a minority of members.
//
// Each Acquire creates an etcd lease with the ttl (whole seconds; etcd may round
// it up to its minimum) and a key under prefix/name/ attached to it. The holder
// is the key with the lowest create revision; waiters queue in creation order
// and each watches the key just before its own, as
// go.etcd.io/etcd/client/v3/concurrency.Mutex does, so a release wakes exactly
// the next waiter and nobody polls. A waiting Acquire keeps its own etcd lease
// alive while it waits.
//
// Once granted, the lease lives as long as it is renewed: Renew sends one
// keep-alive, and fence.Hold renews every ttl/3. A holder that stops renewing
// (paused, partitioned from the cluster's majority) loses the lease when etcd's
// leader expires it, and its next write is refused by the fence.
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
)

// Options configures an Acquirer. A nil *Options means the defaults.
type Options struct {
	// Prefix is the key prefix of every lock. Default: "/fencekit/locks/".
	Prefix string
	// Drift is taken off each lease's local deadline. Default: 1% of the ttl plus 2ms.
	Drift time.Duration
	// MaxWait bounds Acquire's wait when ctx has no deadline. Default: 30s.
	MaxWait time.Duration
	// Owner is stored as the lock key's value, for operators. Default: host name and process id.
	Owner string
}

// Acquirer grants leases from etcd. It is safe for concurrent use.
type Acquirer struct {
	c *clientv3.Client
	o Options
}

var _ fence.Acquirer = (*Acquirer)(nil)

// New returns an Acquirer on c.
func New(c *clientv3.Client, opts *Options) (*Acquirer, error) {
	if c == nil {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "client", Reason: "nil"}
	}
	var o Options
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
	return &Acquirer{c: c, o: o}, nil
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

func check(ctx context.Context, name string, ttl time.Duration) error {
	if err := fence.CheckContext("acquire", ctx); err != nil {
		return err
	}
	if err := checkName("acquire", name); err != nil {
		return err
	}
	return fence.CheckTTL("acquire", ttl, MinTTL, MaxTTL)
}

// checkName refuses an empty name or one over MaxNameBytes; any bytes are
// allowed, since the name is escaped into the key.
func checkName(op, name string) error {
	if err := fence.CheckName(op, name); err != nil {
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
// fence.ErrHeld at once. Two round trips: the etcd lease, then one transaction
// that creates the key and reads the queue's head.
func (a *Acquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := check(ctx, name, ttl); err != nil {
		return nil, err
	}
	return a.acquire(ctx, name, ttl, false)
}

// Acquire waits in line for the lease on name. It gives up at ctx's deadline,
// or after MaxWait when ctx has none, with an error matching fence.ErrHeld and
// the context error; its place in line is given up then.
func (a *Acquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := check(ctx, name, ttl); err != nil {
		return nil, err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, a.o.MaxWait,
			fmt.Errorf("etcdfence: gave up after the maximum wait %v: %w", a.o.MaxWait, context.DeadlineExceeded))
		defer cancel()
	}
	return a.acquire(ctx, name, ttl, true)
}

func seconds(ttl time.Duration) int64 { return fence.CeilDiv(ttl, time.Second) }

func (a *Acquirer) acquire(ctx context.Context, name string, ttl time.Duration, wait bool) (fence.Lease, error) {
	pfx := a.lockPrefix(name)
	sent := time.Now()
	lg, err := a.c.Grant(ctx, seconds(ttl))
	if err != nil {
		return nil, a.fail(ctx, "acquire", name, err)
	}
	id := lg.ID
	giveUp := func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		_, _ = a.c.Revoke(rctx, id)
		cancel()
	}
	key := fmt.Sprintf("%s%016x", pfx, int64(id))
	txn, err := a.c.Txn(ctx).
		Then(clientv3.OpPut(key, a.o.Owner, clientv3.WithLease(id)),
			clientv3.OpGet(pfx, clientv3.WithFirstCreate()...)).
		Commit()
	if err != nil {
		giveUp()
		return nil, a.fail(ctx, "acquire", name, err)
	}
	rev := txn.Header.Revision // the create revision of our key: the token
	head := txn.Responses[1].GetResponseRange().Kvs
	if len(head) > 0 && head[0].CreateRevision != rev {
		if !wait {
			giveUp()
			return nil, fence.ErrHeld
		}
		if sent, err = a.waitTurn(ctx, pfx, id, rev, ttl, sent); err != nil {
			giveUp()
			return nil, a.fail(ctx, "acquire", name, err)
		}
	}
	tok := fence.Token(rev)
	if !tok.Valid() {
		giveUp()
		return nil, fmt.Errorf("etcdfence: acquire %q: revision %d: %w", name, rev, fence.ErrTokensExhausted)
	}
	return &lease{Base: leasekit.New(name, tok, ttl, a.o.Drift, sent), a: a, id: id}, nil
}

// fail wraps err; an ending ctx turns it into ErrHeld joined with the cause.
func (a *Acquirer) fail(ctx context.Context, op, name string, err error) error {
	if errors.Is(err, fence.ErrHeld) {
		return err
	}
	if ctx.Err() != nil {
		return errors.Join(fence.ErrHeld, context.Cause(ctx))
	}
	return fmt.Errorf("etcdfence: %s %q: %w", op, name, err)
}

// waitTurn keeps lease id alive and waits until no key in pfx was created before
// rev. It returns the send time of the last confirmed keep-alive, from which the
// granted lease's local deadline counts.
func (a *Acquirer) waitTurn(ctx context.Context, pfx string, id clientv3.LeaseID, rev int64, ttl time.Duration, sent time.Time) (time.Time, error) {
	var (
		mu        sync.Mutex
		confirmed = sent
		aliveErr  error
	)
	kctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() {
		t := time.NewTicker(ttl / 3)
		defer t.Stop()
		for {
			select {
			case <-kctx.Done():
				return
			case <-t.C:
			}
			s := time.Now()
			_, err := a.c.KeepAliveOnce(kctx, id)
			mu.Lock()
			if err == nil {
				confirmed = s
			} else if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				aliveErr = fmt.Errorf("its etcd lease expired while it waited: %w", fence.ErrLost)
			}
			mu.Unlock()
			if aliveErr != nil {
				stop()
				return
			}
		}
	}()
	for {
		// The key just before ours in line.
		resp, err := a.c.Get(kctx, pfx, append(clientv3.WithLastCreate(), clientv3.WithMaxCreateRev(rev-1))...)
		if err != nil {
			mu.Lock()
			defer mu.Unlock()
			return time.Time{}, errors.Join(err, aliveErr)
		}
		if len(resp.Kvs) == 0 {
			break
		}
		if err := a.waitDelete(kctx, string(resp.Kvs[0].Key), resp.Header.Revision); err != nil {
			mu.Lock()
			defer mu.Unlock()
			return time.Time{}, errors.Join(err, aliveErr)
		}
	}
	stop()
	mu.Lock()
	defer mu.Unlock()
	if aliveErr != nil {
		return time.Time{}, aliveErr
	}
	// Our turn: renew once more, so the lease's local deadline is fresh.
	s := time.Now()
	if _, err := a.c.KeepAliveOnce(ctx, id); err != nil {
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return time.Time{}, fmt.Errorf("its etcd lease expired while it waited: %w", fence.ErrLost)
		}
		return confirmed, nil // the last confirmed keep-alive still bounds it
	}
	return s, nil
}

// waitDelete waits until key is deleted (at or after revision rev+1).
func (a *Acquirer) waitDelete(ctx context.Context, key string, rev int64) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wch := a.c.Watch(clientv3.WithRequireLeader(wctx), key, clientv3.WithRev(rev+1))
	for wr := range wch {
		if err := wr.Err(); err != nil {
			return err
		}
		for _, ev := range wr.Events {
			if ev.Type == mvccpb.DELETE {
				return nil
			}
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return errors.New("watch closed") // the caller looks again
}

type lease struct {
	*leasekit.Base
	a  *Acquirer
	id clientv3.LeaseID
}

// Renew sends one keep-alive for the etcd lease. A lease etcd no longer has
// returns fence.ErrLost.
func (l *lease) Renew(ctx context.Context) error {
	if err := fence.CheckContext("renew", ctx); err != nil {
		return err
	}
	sent := time.Now()
	resp, err := l.a.c.KeepAliveOnce(ctx, l.id)
	if errors.Is(err, rpctypes.ErrLeaseNotFound) || (err == nil && resp.TTL <= 0) {
		l.End(fence.ErrLost)
		return l.lost()
	}
	if err != nil {
		return fmt.Errorf("etcdfence: renew %q: %w", l.Name(), err)
	}
	if !l.Extend(sent) {
		return l.lost()
	}
	return nil
}

// Release revokes the etcd lease, which deletes the lock key and wakes the next
// waiter. A lease etcd no longer has returns fence.ErrLost.
func (l *lease) Release(ctx context.Context) error {
	if err := fence.CheckContext("release", ctx); err != nil {
		return err
	}
	_, err := l.a.c.Revoke(ctx, l.id)
	l.End(context.Canceled)
	if errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return l.lost()
	}
	if err != nil {
		return fmt.Errorf("etcdfence: release %q: %w", l.Name(), err)
	}
	return nil
}

func (l *lease) lost() error {
	return fmt.Errorf("etcdfence: lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}

var _ fence.Inspector = (*Acquirer)(nil)

// Inspect reports name's holder (the oldest key in its queue), time left on its
// etcd lease, and as Counter the cluster's current revision: every later
// grant's token (a create revision) is larger. etcd has no counter to bump.
func (a *Acquirer) Inspect(ctx context.Context, name string) (fence.LockInfo, error) {
	if err := fence.CheckContext("inspect", ctx); err != nil {
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
