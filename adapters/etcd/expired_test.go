package etcdfence_test

// A lease that etcd no longer has when the transaction that uses it arrives:
// on a loaded 3-member cluster a fresh lease's ttl ran out between its grant
// and the create of its key, and Acquire returned etcd's "requested lease not
// found" (TestAcquirerConformanceThreeMembers/MutualExclusion). The grant and
// the waiter's join now take another lease, within ctx (TryAcquire at most 3
// more). The tests revoke the lease in a gRPC interceptor just before the
// transaction that names it is sent, which is what etcd sees when the ttl ran
// out, and each checks a promise through the public API.

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/etcdtest"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// expirer revokes, before a transaction is sent, the lease of its put when
// match picks it, at most times times.
type expirer struct {
	mu      sync.Mutex
	other   *clientv3.Client
	match   func(*pb.TxnRequest) bool
	times   int
	revoked []int64
}

func (e *expirer) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if txn, ok := req.(*pb.TxnRequest); ok {
		e.mu.Lock()
		var lease int64
		if e.times > 0 && e.match(txn) {
			for _, op := range txn.Success {
				if p := op.GetRequestPut(); p != nil && p.Lease != 0 {
					lease = p.Lease
				}
			}
		}
		if lease != 0 {
			e.times--
			e.revoked = append(e.revoked, lease)
		}
		e.mu.Unlock()
		if lease != 0 {
			if _, err := e.other.Revoke(ctx, clientv3.LeaseID(lease)); err != nil {
				return err
			}
		}
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

func (e *expirer) count() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.revoked)
}

// expiringAcquirer is an acquirer (lease pool off, so every grant is fresh)
// whose client sends its transactions through e.
func expiringAcquirer(t *testing.T, c *etcdtest.Cluster, e *expirer) *etcdfence.Acquirer {
	t.Helper()
	cl, err := clientv3.New(clientv3.Config{Endpoints: c.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(e.intercept)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	a, err := etcdfence.NewAcquirer(cl, &etcdfence.AcquirerOptions{NoPool: true})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// grantTxn picks the transaction of a grant of a free name: its put is
// conditional on the line being empty, with no else branch.
func grantTxn(txn *pb.TxnRequest) bool { return len(txn.Failure) == 0 && len(txn.Compare) == 1 }

// joinTxn picks the create of a waiter's place in line: it answers with the
// key otherwise.
func joinTxn(txn *pb.TxnRequest) bool { return len(txn.Failure) == 1 }

// TestFreshLeaseExpiredBeforeGrant: the lease of a free name's grant is gone
// when its transaction arrives. TryAcquire and Acquire take another lease and
// return a live grant; a TryAcquire whose every lease expires gives up after
// a few, with an error that says so and no lease.
func TestFreshLeaseExpiredBeforeGrant(t *testing.T) {
	c := etcdtest.Start(t, 1)
	ctx := context.Background()
	for _, op := range []string{"TryAcquire", "Acquire"} {
		t.Run(op, func(t *testing.T) {
			e := &expirer{other: c.Client(t), match: grantTxn, times: 1}
			a := expiringAcquirer(t, c, e)
			name := fencetest.Name("expired-" + op)
			get := a.TryAcquire
			if op == "Acquire" {
				get = a.Acquire
			}
			actx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			l, err := get(actx, name, 10*time.Second)
			if err != nil {
				t.Fatalf("%s after its first lease expired: %v, want a grant", op, err)
			}
			if e.count() != 1 {
				t.Fatalf("%d leases revoked before their transaction, want 1", e.count())
			}
			if got := etcdfence.LeaseID(l); got == e.revoked[0] {
				t.Fatalf("the grant is on the revoked lease %x", got)
			}
			if err := l.Context().Err(); err != nil {
				t.Fatalf("the grant's context: %v", err)
			}
			if err := l.Renew(ctx); err != nil {
				t.Fatalf("Renew of the grant: %v", err)
			}
			if err := l.Release(ctx); err != nil {
				t.Fatalf("Release: %v", err)
			}
		})
	}
	t.Run("TryAcquireEveryLease", func(t *testing.T) {
		e := &expirer{other: c.Client(t), match: grantTxn, times: 100}
		a := expiringAcquirer(t, c, e)
		name := fencetest.Name("expired-all")
		l, err := a.TryAcquire(ctx, name, 10*time.Second)
		if err == nil {
			t.Fatalf("TryAcquire granted token %d with every lease revoked", l.Token())
		}
		t.Logf("TryAcquire: %v (after %d leases)", err, e.count())
		if errors.Is(err, fence.ErrHeld) || errors.Is(err, fence.ErrLost) {
			t.Fatalf("TryAcquire of a free name: %v, want neither ErrHeld nor ErrLost", err)
		}
		if n := e.count(); n < 2 || n > 5 {
			t.Fatalf("TryAcquire took %d leases, want a few (more than 1, at most 5)", n)
		}
		b, _ := etcdfence.NewAcquirer(c.Client(t), nil)
		l, err = b.TryAcquire(ctx, name, 10*time.Second)
		if err != nil {
			t.Fatalf("the name after TryAcquire gave up: %v, want it free", err)
		}
		_ = l.Release(ctx)
	})
}

// TestWaiterLeaseExpiredBeforeJoin: a waiter's lease is gone when the create
// of its place in line arrives. Acquire joins on another lease and is
// granted when the holder releases, with a larger token.
func TestWaiterLeaseExpiredBeforeJoin(t *testing.T) {
	ctx := context.Background()
	c, cl, h := oneMember(t)
	name := fencetest.Name("expired-join")
	pfx := "/fencekit/locks/" + url.PathEscape(name) + "/"
	held, err := h.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	e := &expirer{other: c.Client(t), match: joinTxn, times: 1}
	w := expiringAcquirer(t, c, e)
	type result struct {
		l   fence.Lease
		err error
	}
	done := make(chan result, 1)
	actx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	go func() {
		l, err := w.Acquire(actx, name, 10*time.Second)
		done <- result{l, err}
	}()
	// The waiter is in line (on its second waiter lease) once the name has
	// two keys.
	for {
		resp, err := cl.Get(ctx, pfx, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			t.Fatal(err)
		}
		if resp.Count >= 2 {
			break
		}
		select {
		case r := <-done:
			t.Fatalf("Acquire returned while the name was held: %v", r.err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	if e.count() != 1 {
		t.Fatalf("%d waiter leases revoked before their create, want 1", e.count())
	}
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("Acquire after its first waiter lease expired: %v, want a grant", r.err)
	}
	defer r.l.Release(ctx)
	if r.l.Token() <= held.Token() {
		t.Fatalf("token %d not above the earlier holder's %d", r.l.Token(), held.Token())
	}
	if err := r.l.Context().Err(); err != nil {
		t.Fatalf("the grant's context: %v", err)
	}
}

// txnKind classifies an acquirer's transactions.
type txnKind int

const (
	txnOther txnKind = iota
	txnGrant         // the create of a free name's key: compare on the line (a range), no else
	txnJoin          // the create of a waiter's place: it has an else branch
	txnMove          // the move of a waiter's key to the lock's lease: compare on the key's lease
)

func txnKindOf(txn *pb.TxnRequest) txnKind {
	if len(txn.Failure) == 1 {
		return txnJoin
	}
	if len(txn.Compare) != 1 || len(txn.Failure) != 0 {
		return txnOther
	}
	c := txn.Compare[0]
	switch {
	case c.Target == pb.Compare_CREATE && len(c.RangeEnd) > 0:
		return txnGrant
	case c.Target == pb.Compare_LEASE:
		return txnMove
	}
	return txnOther
}

// leaseRevoker revokes (through another client) the lease named by the put of
// chosen transactions before they are sent, or lets a join land and then
// revokes its lease and reports the answer lost.
type leaseRevoker struct {
	other *clientv3.Client

	mu sync.Mutex
	// revoke decides, for the n-th transaction (from 1) of its kind, whether
	// its put's lease is revoked before it is sent.
	revoke func(kind txnKind, n int) bool
	// landThenLose: the first this many joins are sent, then their waiter
	// lease is revoked and the caller gets Unavailable (answer lost).
	landThenLose int
	seen         map[txnKind]int
	revoked      map[txnKind][]int64
	grants       int      // lease grants sent
	joinKeys     []string // keys of the joins sent
}

func (f *leaseRevoker) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if _, ok := req.(*pb.LeaseGrantRequest); ok {
		f.mu.Lock()
		f.grants++
		f.mu.Unlock()
	}
	txn, ok := req.(*pb.TxnRequest)
	if !ok {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	kind := txnKindOf(txn)
	var lease int64
	for _, op := range txn.Success {
		if p := op.GetRequestPut(); p != nil && p.Lease != 0 {
			lease = p.Lease
			if kind == txnJoin {
				f.mu.Lock()
				f.joinKeys = append(f.joinKeys, string(p.Key))
				f.mu.Unlock()
			}
		}
	}
	f.mu.Lock()
	if f.seen == nil {
		f.seen, f.revoked = map[txnKind]int{}, map[txnKind][]int64{}
	}
	f.seen[kind]++
	n := f.seen[kind]
	before := kind != txnOther && lease != 0 && f.revoke != nil && f.revoke(kind, n)
	after := !before && kind == txnJoin && lease != 0 && f.landThenLose > 0
	if after {
		f.landThenLose--
	}
	if before || after {
		f.revoked[kind] = append(f.revoked[kind], lease)
	}
	f.mu.Unlock()
	if before {
		if _, err := f.other.Revoke(ctx, clientv3.LeaseID(lease)); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return err
		}
	}
	err := invoker(ctx, method, req, reply, cc, opts...)
	if after && err == nil {
		if _, err := f.other.Revoke(ctx, clientv3.LeaseID(lease)); err != nil {
			return err
		}
		return status.Error(codes.Unavailable, "rev: the join's answer was lost (injected)")
	}
	return err
}

func (f *leaseRevoker) revokedOf(k txnKind) []int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]int64(nil), f.revoked[k]...)
}

func (f *leaseRevoker) grantCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.grants
}

func (f *leaseRevoker) keys() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.joinKeys...)
}

// revokingAcquirer is an acquirer whose client sends through f.
func revokingAcquirer(t *testing.T, c *etcdtest.Cluster, f *leaseRevoker, o *etcdfence.AcquirerOptions) *etcdfence.Acquirer {
	t.Helper()
	if f.other == nil {
		f.other = c.Client(t)
	}
	cl, err := clientv3.New(clientv3.Config{Endpoints: c.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(f.intercept)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	a, err := etcdfence.NewAcquirer(cl, o)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

var poolCases = []struct {
	name string
	o    *etcdfence.AcquirerOptions
}{{"Pool", nil}, {"NoPool", &etcdfence.AcquirerOptions{NoPool: true}}}

// heldEachPoolCase starts a one-member cluster and runs body as a subtest
// for each of poolCases (o its options), with fencetest.Name(prefix+its
// name) held for 30s by an acquirer on cl.
func heldEachPoolCase(t *testing.T, prefix string, body func(t *testing.T, c *etcdtest.Cluster, cl *clientv3.Client, o *etcdfence.AcquirerOptions, name string, held fence.Lease)) {
	c, cl, h := oneMember(t)
	for _, pc := range poolCases {
		t.Run(pc.name, func(t *testing.T) {
			name := fencetest.Name(prefix + pc.name)
			held, err := h.TryAcquire(context.Background(), name, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			body(t, c, cl, pc.o, name, held)
		})
	}
}

// grantedToAnother fails t unless an acquirer without a pool, on a client
// of its own, is granted name at once; after says after what.
func grantedToAnother(t *testing.T, c *etcdtest.Cluster, name, after string) {
	t.Helper()
	ctx := context.Background()
	o, _ := etcdfence.NewAcquirer(c.Client(t), &etcdfence.AcquirerOptions{NoPool: true})
	l2, err := o.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("TryAcquire after %s: %v, want a grant", after, err)
	}
	_ = l2.Release(ctx)
}

// gaveUpLeavingNothing checks what a waiter that gave up on name, held by
// held, leaves: one key in line (with holderKey, the holder's create
// revision), the lock lease of the waiter's first join (f) gone soon, and
// after held's release the name granted to another acquirer at once.
func gaveUpLeavingNothing(t *testing.T, c *etcdtest.Cluster, cl *clientv3.Client, f *leaseRevoker, name string, held fence.Lease, holderKey bool) {
	t.Helper()
	if ks := lineKeys(t, cl, name); len(ks) != 1 || (holderKey && ks[0].create != int64(held.Token())) {
		t.Errorf("the line after Acquire gave up: %d keys, want only the holder's", len(ks))
	}
	if keys := f.keys(); len(keys) > 0 {
		leaseGoneSoon(t, cl, leaseOfKey(t, keys[0]), "the lock lease of the waiter that gave up")
	}
	if err := held.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	grantedToAnother(t, c, name, "the holder released")
}

// waitJoined polls (every 10ms, for 10s) until joined reports the waiter
// in line, failing t with the message joined returns when it never does,
// or when the waiter's Acquire (done) returns first.
func waitJoined(t *testing.T, done <-chan ctxAcquired, joined func() (bool, string)) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		ok, msg := joined()
		if ok {
			return
		}
		select {
		case r := <-done:
			t.Fatalf("Acquire returned while the name was held: %v", r.err)
		default:
		}
		if time.Now().After(end) {
			t.Fatal(msg)
		}
	}
}

// leaseOfKey is the lock lease a waiter's key is named after.
func leaseOfKey(t *testing.T, key string) int64 {
	t.Helper()
	i := strings.LastIndex(key, "/")
	u, err := strconv.ParseUint(key[i+1:], 16, 64)
	if err != nil {
		t.Fatalf("key %q: %v", key, err)
	}
	return int64(u)
}

// leaseGoneSoon waits (polling, up to 5s) until etcd no longer has lease id.
func leaseGoneSoon(t *testing.T, cl *clientv3.Client, id int64, what string) {
	t.Helper()
	end := time.Now().Add(5 * time.Second)
	for {
		r, err := cl.TimeToLive(context.Background(), clientv3.LeaseID(id))
		if err == nil && r.TTL == -1 {
			return
		}
		if time.Now().After(end) {
			t.Errorf("%s (lease %x) still on etcd 5s later: ttl %v, %v", what, id, r, err)
			return
		}
		time.Sleep(50 * time.Millisecond) // a poll
	}
}

// noGoroutinesLeft fails when goroutines of the package still run 5s on.
func noGoroutinesLeft(t *testing.T) {
	t.Helper()
	var left []string
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		left = nil
		for _, g := range etcdfenceGoroutines() {
			if strings.Contains(g, "adapters/etcd.revokeLease") || strings.Contains(g, "adapters/etcd.(*Acquirer)") {
				left = append(left, g)
			}
		}
		if len(left) == 0 || time.Now().After(end) {
			break
		}
	}
	if len(left) > 0 {
		t.Errorf("%d goroutines of etcdfence still run 5s later:\n%s", len(left), strings.Join(left, "\n\n"))
	}
}

func lineKeys(t *testing.T, cl *clientv3.Client, name string) []*struct {
	key         string
	create, lse int64
} {
	t.Helper()
	resp, err := cl.Get(context.Background(), linePrefix(name), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var out []*struct {
		key         string
		create, lse int64
	}
	for _, kv := range resp.Kvs {
		out = append(out, &struct {
			key         string
			create, lse int64
		}{string(kv.Key), kv.CreateRevision, kv.Lease})
	}
	return out
}

type ctxAcquired struct {
	l   fence.Lease
	err error
}

func acquireAsyncCtx(ctx context.Context, a *etcdfence.Acquirer, name string, ttl time.Duration) <-chan ctxAcquired {
	ch := make(chan ctxAcquired, 1)
	go func() {
		l, err := a.Acquire(ctx, name, ttl)
		ch <- ctxAcquired{l, err}
	}()
	return ch
}

// TestExpiredLeaseJoinEveryLeaseGivesUp: every waiter lease is revoked before
// the create of the waiter's place reaches etcd, until Acquire's context
// ends. Acquire must give up at its deadline with ErrHeld joined with
// DeadlineExceeded, promptly, leaving no key in line, its lock lease
// revoked, and no goroutine; the holder's release then frees the name for
// anyone at once.
func TestExpiredLeaseJoinEveryLeaseGivesUp(t *testing.T) {
	ctx := context.Background()
	heldEachPoolCase(t, "rev-join-all-", func(t *testing.T, c *etcdtest.Cluster, cl *clientv3.Client, o *etcdfence.AcquirerOptions, name string, held fence.Lease) {
		f := &leaseRevoker{revoke: func(k txnKind, n int) bool { return k == txnJoin }}
		w := revokingAcquirer(t, c, f, o)
		deadline := time.Now().Add(2 * time.Second)
		actx, cancel := context.WithDeadline(ctx, deadline)
		l, err := w.Acquire(actx, name, 10*time.Second)
		returned := time.Now()
		cancel()
		if err == nil {
			t.Fatalf("Acquire granted token %d while the name was held", l.Token())
		}
		joins := len(f.revokedOf(txnJoin))
		t.Logf("Acquire: %v, %v after its deadline; %d joins on revoked waiter leases, %d lease grants in 2s", err, returned.Sub(deadline), joins, f.grantCount())
		if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Acquire gave up with %v, want ErrHeld joined with DeadlineExceeded", err)
		}
		if late := returned.Sub(deadline); late > time.Second {
			t.Errorf("Acquire returned %v after its deadline", late)
		}
		if joins < 2 {
			t.Errorf("only %d joins were tried", joins)
		}
		// The joins are spaced (retryDelay: 10ms doubling to 500ms,
		// about 8 in 2s); without the pause 150-200 were sent.
		if joins > 20 {
			t.Errorf("%d joins in 2s: the retries of a join whose waiter lease expired are not spaced", joins)
		}
		gaveUpLeavingNothing(t, c, cl, f, name, held, true)
		noGoroutinesLeft(t)
	})
}

// TestExpiredLeaseJoinEveryLeaseCancelled: as JoinEveryLeaseGivesUp, but the
// context is cancelled (after a few failed joins): ErrHeld joined with
// context.Canceled, at once, and the name is free after the release.
func TestExpiredLeaseJoinEveryLeaseCancelled(t *testing.T) {
	ctx := context.Background()
	heldEachPoolCase(t, "rev-join-cancel-", func(t *testing.T, c *etcdtest.Cluster, cl *clientv3.Client, o *etcdfence.AcquirerOptions, name string, held fence.Lease) {
		actx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		var cancelled time.Time
		f := &leaseRevoker{revoke: func(k txnKind, n int) bool {
			if k == txnJoin && n == 5 {
				cancelled = time.Now()
				cancel()
			}
			return k == txnJoin
		}}
		w := revokingAcquirer(t, c, f, o)
		l, err := w.Acquire(actx, name, 10*time.Second)
		returned := time.Now()
		if err == nil {
			t.Fatalf("Acquire granted token %d while the name was held", l.Token())
		}
		t.Logf("Acquire: %v, %v after the cancel", err, returned.Sub(cancelled))
		if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) {
			t.Errorf("Acquire gave up with %v, want ErrHeld joined with Canceled", err)
		}
		if d := returned.Sub(cancelled); cancelled.IsZero() || d > time.Second {
			t.Errorf("Acquire returned %v after the cancel", d)
		}
		gaveUpLeavingNothing(t, c, cl, f, name, held, false)
	})
}

// TestExpiredLeaseJoinLandedAnswerLostThenRevoked: the first create of the
// waiter's place lands, its answer is lost, and its waiter lease is gone
// when the create is sent again (lease-not-found on the retry). The waiter
// joins on another lease and is granted at the holder's release with a
// larger token on a live lease, holding the only key in line; after its
// release the name is free at once.
func TestExpiredLeaseJoinLandedAnswerLostThenRevoked(t *testing.T) {
	ctx := context.Background()
	heldEachPoolCase(t, "rev-join-lost-", func(t *testing.T, c *etcdtest.Cluster, cl *clientv3.Client, o *etcdfence.AcquirerOptions, name string, held fence.Lease) {
		f := &leaseRevoker{landThenLose: 1}
		w := revokingAcquirer(t, c, f, o)
		actx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		done := acquireAsyncCtx(actx, w, name, 10*time.Second)
		// Two places: the holder's and the waiter's on its second lease.
		waitJoined(t, done, func() (bool, string) {
			ks := lineKeys(t, cl, name)
			return len(ks) == 2 && len(f.keys()) >= 2, fmt.Sprintf("the waiter did not join again: line %d keys, joins %v", len(ks), f.keys())
		})
		if err := held.Release(ctx); err != nil {
			t.Fatal(err)
		}
		r := <-done
		if r.err != nil {
			t.Fatalf("Acquire after its join's lease was lost: %v, want a grant", r.err)
		}
		if r.l.Token() <= held.Token() {
			t.Errorf("token %d not above the earlier holder's %d", r.l.Token(), held.Token())
		}
		ks := lineKeys(t, cl, name)
		if len(ks) != 1 || ks[0].create != int64(r.l.Token()) || ks[0].lse != etcdfence.LeaseID(r.l) {
			t.Errorf("the line after the grant: %+v, want one key at the token on the grant's lease %x", ks, etcdfence.LeaseID(r.l))
		}
		if err := r.l.Renew(ctx); err != nil {
			t.Errorf("Renew of the grant: %v", err)
		}
		if err := r.l.Release(ctx); err != nil {
			t.Errorf("Release: %v", err)
		}
		grantedToAnother(t, c, name, "the waiter released")
	})
}

// TestExpiredLeaseTryAcquireHeldRevokedLease: a TryAcquire whose etcd lease is
// gone when its transaction arrives, for a name another holds, answers
// ErrHeld, never a grant nor another error; once the name is free the same
// acquirer (whose pool may now hold that dead lease) grants a live lease.
func TestExpiredLeaseTryAcquireHeldRevokedLease(t *testing.T) {
	ctx := context.Background()
	heldEachPoolCase(t, "rev-try-held-", func(t *testing.T, c *etcdtest.Cluster, cl *clientv3.Client, o *etcdfence.AcquirerOptions, name string, held fence.Lease) {
		var on sync.Mutex
		faulty := true
		f := &leaseRevoker{revoke: func(k txnKind, n int) bool {
			on.Lock()
			defer on.Unlock()
			return k == txnGrant && faulty
		}}
		a := revokingAcquirer(t, c, f, o)
		for i := 0; i < 3; i++ {
			l, err := a.TryAcquire(ctx, name, 10*time.Second)
			if err == nil {
				t.Fatalf("TryAcquire %d granted token %d for a held name", i, l.Token())
			}
			if !errors.Is(err, fence.ErrHeld) {
				t.Fatalf("TryAcquire %d of a held name on a revoked lease: %v, want ErrHeld", i, err)
			}
		}
		if n := len(f.revokedOf(txnGrant)); n != 3 {
			t.Fatalf("%d leases revoked, want 3", n)
		}
		if err := held.Release(ctx); err != nil {
			t.Fatal(err)
		}
		on.Lock()
		faulty = false
		on.Unlock()
		l, err := a.TryAcquire(ctx, name, 10*time.Second)
		if err != nil {
			t.Fatalf("TryAcquire of the free name: %v, want a grant", err)
		}
		if err := l.Renew(ctx); err != nil {
			t.Errorf("Renew: %v", err)
		}
		if err := l.Release(ctx); err != nil {
			t.Errorf("Release: %v", err)
		}
	})
}

// TestExpiredLeaseJoinAndMoveLeasesRevoked: a waiter whose first waiter lease
// is gone when its join arrives and whose lock lease is gone when the move
// arrives (grantToo: the lock lease was gone already when its grant's
// transaction arrived; the name is held, so that transaction fails its
// compare and the waiter queues with a dead lock lease). At
// the holder's release it is granted on a live lease with a larger token
// (Renew succeeds, Inspect sees it), and after its release the name is free
// at once and no lease of its lives on.
func TestExpiredLeaseJoinAndMoveLeasesRevoked(t *testing.T) {
	ctx := context.Background()
	c, cl, h := oneMember(t)
	for _, pc := range poolCases {
		for _, grantToo := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/grantToo=%v", pc.name, grantToo), func(t *testing.T) {
				name := fencetest.Name("rev-move-" + pc.name)
				held, err := h.TryAcquire(ctx, name, 30*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				f := &leaseRevoker{revoke: func(k txnKind, n int) bool {
					return n == 1 && (k == txnJoin || k == txnMove || (grantToo && k == txnGrant))
				}}
				w := revokingAcquirer(t, c, f, pc.o)
				actx, cancel := context.WithTimeout(ctx, 15*time.Second)
				defer cancel()
				done := acquireAsyncCtx(actx, w, name, 10*time.Second)
				waitJoined(t, done, func() (bool, string) {
					return len(lineKeys(t, cl, name)) == 2, "the waiter did not join"
				})
				if err := held.Release(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-done
				if r.err != nil {
					t.Fatalf("Acquire: %v, want a grant", r.err)
				}
				t.Logf("revoked: grant %x, join %x, move %x", f.revokedOf(txnGrant), f.revokedOf(txnJoin), f.revokedOf(txnMove))
				if (len(f.revokedOf(txnGrant)) == 1) != grantToo || len(f.revokedOf(txnJoin)) != 1 || len(f.revokedOf(txnMove)) != 1 {
					t.Fatalf("the faults did not all fire")
				}
				if r.l.Token() <= held.Token() {
					t.Errorf("token %d not above %d", r.l.Token(), held.Token())
				}
				if err := r.l.Context().Err(); err != nil {
					t.Errorf("the grant's context: %v", err)
				}
				if err := r.l.Renew(ctx); err != nil {
					t.Errorf("Renew: %v", err)
				}
				info, err := w.Inspect(ctx, name)
				if err != nil || !info.Held || info.Token != r.l.Token() || info.TimeLeft <= 0 {
					t.Errorf("Inspect after the grant: %+v, %v", info, err)
				}
				id := etcdfence.LeaseID(r.l)
				if err := r.l.Release(ctx); err != nil {
					t.Errorf("Release: %v", err)
				}
				if ks := lineKeys(t, cl, name); len(ks) != 0 {
					t.Errorf("the line after the release: %+v", ks)
				}
				if pc.o != nil {
					leaseGoneSoon(t, cl, id, "the released lease (no pool)")
				}
			})
		}
	}
}

// TestExpiredLeaseManyWaitersExclusion: on one member and on three, six
// acquirers (three pooled, three not; two on a 3s lock lease, which shares
// the pool's slot with waiter leases) take the name in turn, four times
// each, while some of their leases
// (a grant's, a join's, a move's) are revoked before the transaction that
// names them. No two hold it at once, tokens grow in grant order, every
// grant is live (Renew succeeds), and every Acquire is granted.
func TestExpiredLeaseManyWaitersExclusion(t *testing.T) {
	for _, members := range []int{1, 3} {
		t.Run(fmt.Sprintf("members=%d", members), func(t *testing.T) { expiredLeaseManyWaiters(t, members) })
	}
}

func expiredLeaseManyWaiters(t *testing.T, members int) {
	c := etcdtest.Start(t, members)
	cl := c.Client(t)
	ctx := context.Background()
	name := fencetest.Name("rev-many")
	const workers, rounds = 6, 4
	var (
		mu     sync.Mutex
		inside int
		last   fence.Token
		order  []fence.Token
	)
	errs := make(chan error, workers*rounds*2)
	var wg sync.WaitGroup
	for i := 0; i < workers; i++ {
		i := i
		f := &leaseRevoker{revoke: func(k txnKind, n int) bool {
			switch k {
			case txnGrant:
				return (n+i)%3 == 0
			case txnJoin:
				return (n+i)%2 == 0
			case txnMove:
				return (n+i)%3 == 1
			}
			return false
		}}
		o := &etcdfence.AcquirerOptions{NoPool: i%2 == 1}
		a := revokingAcquirer(t, c, f, o)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := 0; r < rounds; r++ {
				actx, cancel := context.WithTimeout(ctx, 40*time.Second)
				// A 3s lock lease shares the pool's slot with waiter leases.
				ttl := 5 * time.Second
				if i%3 == 0 {
					ttl = etcdfence.WaiterTTL
				}
				l, err := a.Acquire(actx, name, ttl)
				cancel()
				if err != nil {
					errs <- fmt.Errorf("worker %d round %d: Acquire: %w", i, r, err)
					return
				}
				mu.Lock()
				inside++
				if inside != 1 {
					errs <- fmt.Errorf("worker %d: %d holders at once (token %d)", i, inside, l.Token())
				}
				if l.Token() <= last {
					errs <- fmt.Errorf("worker %d: token %d after %d", i, l.Token(), last)
				}
				last = l.Token()
				order = append(order, l.Token())
				mu.Unlock()
				if err := l.Context().Err(); err != nil {
					errs <- fmt.Errorf("worker %d: a grant whose context is done: %v", i, context.Cause(l.Context()))
				}
				if err := l.Renew(ctx); err != nil {
					errs <- fmt.Errorf("worker %d: Renew of a fresh grant: %w", i, err)
				}
				mu.Lock()
				inside--
				mu.Unlock()
				if err := l.Release(ctx); err != nil {
					errs <- fmt.Errorf("worker %d: Release: %w", i, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d grants, tokens %v", len(order), order)
	if len(order) != workers*rounds {
		t.Errorf("%d grants, want %d", len(order), workers*rounds)
	}
	if ks := lineKeys(t, cl, name); len(ks) != 0 {
		t.Errorf("the line after every release: %+v", ks)
	}
}

// TestExpiredLeaseTryAcquireEveryLeasePooled: with the pool on and a lease
// pooled, every lease's transaction arrives after it is gone. TryAcquire
// gives up after a few leases with an error that is neither ErrHeld nor
// ErrLost (the name is free), no lease of its lives on, and the name is free.
func TestExpiredLeaseTryAcquireEveryLeasePooled(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	ctx := context.Background()
	name := fencetest.Name("rev-try-all")
	var on sync.Mutex
	faulty := false
	f := &leaseRevoker{revoke: func(k txnKind, n int) bool {
		on.Lock()
		defer on.Unlock()
		return faulty && k == txnGrant
	}}
	a := revokingAcquirer(t, c, f, nil)
	pooledAfterRelease(t, a, name, 10*time.Second)
	on.Lock()
	faulty = true
	on.Unlock()
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err == nil {
		t.Fatalf("TryAcquire granted token %d with every lease revoked", l.Token())
	}
	revoked := f.revokedOf(txnGrant)
	t.Logf("TryAcquire: %v (after %d leases)", err, len(revoked))
	if errors.Is(err, fence.ErrHeld) || errors.Is(err, fence.ErrLost) {
		t.Errorf("TryAcquire of a free name: %v, want neither ErrHeld nor ErrLost", err)
	}
	if n := len(revoked); n < 2 || n > 5 {
		t.Errorf("TryAcquire took %d leases, want 2..5", n)
	}
	for _, id := range revoked {
		leaseGoneSoon(t, cl, id, "a revoked grant lease")
	}
	if ks := lineKeys(t, cl, name); len(ks) != 0 {
		t.Errorf("the line after TryAcquire gave up: %+v", ks)
	}
}

// TestRenewLostAfterKeyDeletedAndRegrantedFromThePool: A
// holds the name; an operator deletes A's key and B, granted by the same
// acquirer on an etcd lease from its pool, takes the name. A's next Renew
// returns ErrLost and ends A's context; the revoke of A's etcd lease must
// not touch B's: B renews, still holds the name, and A's Release neither
// frees B's name nor reports success.
func TestRenewLostAfterKeyDeletedAndRegrantedFromThePool(t *testing.T) {
	_, cl, a := oneMember(t)
	ctx := context.Background()
	name := fencetest.Name("key-deleted-pool")
	const ttl = 30 * time.Second
	// One lease of this ttl in the pool, for B.
	pooled, _ := pooledAfterRelease(t, a, fencetest.Name("key-deleted-other"), ttl)

	la, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if etcdfence.LeaseID(la) == pooled {
		// A took the pooled lease; pool another for B.
		pooled, _ = pooledAfterRelease(t, a, fencetest.Name("key-deleted-other2"), ttl)
	}
	if _, err := cl.Delete(ctx, "/fencekit/locks/", clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	lb, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after the key was deleted: %v", err)
	}
	defer lb.Release(ctx)
	if etcdfence.LeaseID(lb) != pooled {
		t.Logf("B on lease %x, pooled was %x", etcdfence.LeaseID(lb), pooled)
	}
	if lb.Token() <= la.Token() {
		t.Fatalf("B's token %d not above A's %d", lb.Token(), la.Token())
	}
	if err := la.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's Renew after its key was deleted and B granted: %v, want ErrLost", err)
	}
	if la.Context().Err() == nil {
		t.Fatal("A's context is live after its Renew returned ErrLost, while B holds the name")
	}
	if err := la.Release(ctx); err == nil {
		t.Fatal("A's Release after its key was deleted: nil, want an error (ErrLost)")
	}
	waitLeaseGone(t, cl, etcdfence.LeaseID(la), 10*time.Second)
	if !leaseAlive(t, cl, etcdfence.LeaseID(lb)) {
		t.Fatal("B's etcd lease is gone after A's lost Renew")
	}
	if err := lb.Renew(ctx); err != nil {
		t.Fatalf("B's Renew after A's lost Renew and Release: %v", err)
	}
	if lb.Context().Err() != nil {
		t.Fatal("B's context ended")
	}
	if _, err := a.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("a third grant while B holds: %v, want ErrHeld", err)
	}
}

// TestRenewLostAfterOperatorRevokedTheLease: an operator revokes
// A's etcd lease (etcdctl lease revoke) while A holds the name. The name is
// free at once (B is granted); A's next Renew returns ErrLost and ends its
// context, and B keeps the name through A's Release.
func TestRenewLostAfterOperatorRevokedTheLease(t *testing.T) {
	c, cl, a := oneMember(t)
	b, _ := etcdfence.NewAcquirer(c.Client(t), nil)
	ctx := context.Background()
	name := fencetest.Name("operator-revoke")
	const ttl = 30 * time.Second
	la, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Revoke(ctx, clientv3.LeaseID(etcdfence.LeaseID(la))); err != nil {
		t.Fatal(err)
	}
	lb, err := b.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after A's lease was revoked: %v", err)
	}
	defer lb.Release(ctx)
	if err := la.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's Renew after its etcd lease was revoked: %v, want ErrLost", err)
	}
	if la.Context().Err() == nil {
		t.Fatal("A's context is live after its Renew returned ErrLost")
	}
	if err := la.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's Release: %v, want ErrLost", err)
	}
	if err := lb.Renew(ctx); err != nil {
		t.Fatalf("B's Renew: %v", err)
	}
	if _, err := a.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("a third grant while B holds: %v, want ErrHeld", err)
	}
}

// waitLeaseGone waits until etcd no longer has lease id.
func waitLeaseGone(t *testing.T, cl *clientv3.Client, id int64, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for leaseAlive(t, cl, id) {
		if time.Now().After(deadline) {
			t.Fatalf("etcd lease %x still alive after %v", id, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
