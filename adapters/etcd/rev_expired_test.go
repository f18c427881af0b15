package etcdfence_test

// Review of 123b738 (etcd: a lease gone when the transaction that uses it
// arrives no longer ends Acquire with "requested lease not found": the grant
// and the waiter's join take another lease, within ctx; TryAcquire at most 3
// more). Leases are revoked in a gRPC unary interceptor just before the
// transaction that names them is sent (what etcd sees when their ttl ran out),
// against an embedded etcd, and each test checks a promise through the
// public API.

import (
	"context"
	"errors"
	"fmt"
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

// revKind classifies an acquirer's transactions.
type revKind int

const (
	revOther revKind = iota
	revGrant         // the create of a free name's key: compare on the line (a range), no else
	revJoin          // the create of a waiter's place: it has an else branch
	revMove          // the move of a waiter's key to the lock's lease: compare on the key's lease
)

func revKindOf(txn *pb.TxnRequest) revKind {
	if len(txn.Failure) == 1 {
		return revJoin
	}
	if len(txn.Compare) != 1 || len(txn.Failure) != 0 {
		return revOther
	}
	c := txn.Compare[0]
	switch {
	case c.Target == pb.Compare_CREATE && len(c.RangeEnd) > 0:
		return revGrant
	case c.Target == pb.Compare_LEASE:
		return revMove
	}
	return revOther
}

// revFaults revokes (through another client) the lease named by the put of
// chosen transactions before they are sent, or lets a join land and then
// revokes its lease and reports the answer lost.
type revFaults struct {
	other *clientv3.Client

	mu sync.Mutex
	// revoke decides, for the n-th transaction (from 1) of its kind, whether
	// its put's lease is revoked before it is sent.
	revoke func(kind revKind, n int) bool
	// landThenLose: the first this many joins are sent, then their waiter
	// lease is revoked and the caller gets Unavailable (answer lost).
	landThenLose int
	seen         map[revKind]int
	revoked      map[revKind][]int64
	grants       int      // lease grants sent
	joinKeys     []string // keys of the joins sent
}

func (f *revFaults) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if _, ok := req.(*pb.LeaseGrantRequest); ok {
		f.mu.Lock()
		f.grants++
		f.mu.Unlock()
	}
	txn, ok := req.(*pb.TxnRequest)
	if !ok {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	kind := revKindOf(txn)
	var lease int64
	for _, op := range txn.Success {
		if p := op.GetRequestPut(); p != nil && p.Lease != 0 {
			lease = p.Lease
			if kind == revJoin {
				f.mu.Lock()
				f.joinKeys = append(f.joinKeys, string(p.Key))
				f.mu.Unlock()
			}
		}
	}
	f.mu.Lock()
	if f.seen == nil {
		f.seen, f.revoked = map[revKind]int{}, map[revKind][]int64{}
	}
	f.seen[kind]++
	n := f.seen[kind]
	before := kind != revOther && lease != 0 && f.revoke != nil && f.revoke(kind, n)
	after := !before && kind == revJoin && lease != 0 && f.landThenLose > 0
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

func (f *revFaults) revokedOf(k revKind) []int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]int64(nil), f.revoked[k]...)
}

func (f *revFaults) grantCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.grants
}

func (f *revFaults) keys() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.joinKeys...)
}

// revAcquirer is an acquirer whose client sends through f.
func revAcquirer(t *testing.T, c *etcdtest.Cluster, f *revFaults, o *etcdfence.Options) *etcdfence.Acquirer {
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
	a, err := etcdfence.New(cl, o)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

var revPools = []struct {
	name string
	o    *etcdfence.Options
}{{"Pool", nil}, {"NoPool", &etcdfence.Options{NoPool: true}}}

// revLeaseOfKey is the lock lease a waiter's key is named after.
func revLeaseOfKey(t *testing.T, key string) int64 {
	t.Helper()
	i := strings.LastIndex(key, "/")
	u, err := strconv.ParseUint(key[i+1:], 16, 64)
	if err != nil {
		t.Fatalf("key %q: %v", key, err)
	}
	return int64(u)
}

// revGone waits (polling, up to 5s) until etcd no longer has lease id.
func revGone(t *testing.T, cl *clientv3.Client, id int64, what string) {
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

// revNoGoroutines fails when goroutines of the package still run 5s on.
func revNoGoroutines(t *testing.T) {
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

func revLineKeys(t *testing.T, cl *clientv3.Client, name string) []*struct {
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

type revResult struct {
	l   fence.Lease
	err error
}

func revAcquireAsync(ctx context.Context, a *etcdfence.Acquirer, name string, ttl time.Duration) <-chan revResult {
	ch := make(chan revResult, 1)
	go func() {
		l, err := a.Acquire(ctx, name, ttl)
		ch <- revResult{l, err}
	}()
	return ch
}

// TestRevExpiredJoinEveryLeaseGivesUp: every waiter lease is revoked before
// the create of the waiter's place reaches etcd, until Acquire's context
// ends. Acquire must give up at its deadline with ErrHeld joined with
// DeadlineExceeded, promptly, leaving no key in line, its lock lease
// revoked, and no goroutine; the holder's release then frees the name for
// anyone at once.
func TestRevExpiredJoinEveryLeaseGivesUp(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	ctx := context.Background()
	h, _ := etcdfence.New(cl, nil)
	for _, pc := range revPools {
		t.Run(pc.name, func(t *testing.T) {
			name := fencetest.Name("rev-join-all-" + pc.name)
			held, err := h.TryAcquire(ctx, name, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			f := &revFaults{revoke: func(k revKind, n int) bool { return k == revJoin }}
			w := revAcquirer(t, c, f, pc.o)
			deadline := time.Now().Add(2 * time.Second)
			actx, cancel := context.WithDeadline(ctx, deadline)
			l, err := w.Acquire(actx, name, 10*time.Second)
			returned := time.Now()
			cancel()
			if err == nil {
				t.Fatalf("Acquire granted token %d while the name was held", l.Token())
			}
			joins := len(f.revokedOf(revJoin))
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
			if ks := revLineKeys(t, cl, name); len(ks) != 1 || ks[0].create != int64(held.Token()) {
				t.Errorf("the line after Acquire gave up: %d keys, want only the holder's", len(ks))
			}
			if keys := f.keys(); len(keys) > 0 {
				revGone(t, cl, revLeaseOfKey(t, keys[0]), "the lock lease of the waiter that gave up")
			}
			if err := held.Release(ctx); err != nil {
				t.Fatal(err)
			}
			o, _ := etcdfence.New(c.Client(t), &etcdfence.Options{NoPool: true})
			l2, err := o.TryAcquire(ctx, name, 5*time.Second)
			if err != nil {
				t.Fatalf("TryAcquire after the holder released: %v, want a grant", err)
			}
			_ = l2.Release(ctx)
			revNoGoroutines(t)
		})
	}
}

// TestRevExpiredJoinEveryLeaseCancelled: as JoinEveryLeaseGivesUp, but the
// context is cancelled (after a few failed joins): ErrHeld joined with
// context.Canceled, at once, and the name is free after the release.
func TestRevExpiredJoinEveryLeaseCancelled(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	ctx := context.Background()
	h, _ := etcdfence.New(cl, nil)
	for _, pc := range revPools {
		t.Run(pc.name, func(t *testing.T) {
			name := fencetest.Name("rev-join-cancel-" + pc.name)
			held, err := h.TryAcquire(ctx, name, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			actx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			var cancelled time.Time
			f := &revFaults{revoke: func(k revKind, n int) bool {
				if k == revJoin && n == 5 {
					cancelled = time.Now()
					cancel()
				}
				return k == revJoin
			}}
			w := revAcquirer(t, c, f, pc.o)
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
			if ks := revLineKeys(t, cl, name); len(ks) != 1 {
				t.Errorf("the line after Acquire gave up: %d keys, want only the holder's", len(ks))
			}
			if keys := f.keys(); len(keys) > 0 {
				revGone(t, cl, revLeaseOfKey(t, keys[0]), "the lock lease of the waiter that gave up")
			}
			if err := held.Release(ctx); err != nil {
				t.Fatal(err)
			}
			o, _ := etcdfence.New(c.Client(t), &etcdfence.Options{NoPool: true})
			l2, err := o.TryAcquire(ctx, name, 5*time.Second)
			if err != nil {
				t.Fatalf("TryAcquire after the holder released: %v, want a grant", err)
			}
			_ = l2.Release(ctx)
		})
	}
}

// TestRevExpiredJoinLandedAnswerLostThenRevoked: the first create of the
// waiter's place lands, its answer is lost, and its waiter lease is gone
// when the create is sent again (lease-not-found on the retry). The waiter
// joins on another lease and is granted at the holder's release with a
// larger token on a live lease, holding the only key in line; after its
// release the name is free at once.
func TestRevExpiredJoinLandedAnswerLostThenRevoked(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	ctx := context.Background()
	h, _ := etcdfence.New(cl, nil)
	for _, pc := range revPools {
		t.Run(pc.name, func(t *testing.T) {
			name := fencetest.Name("rev-join-lost-" + pc.name)
			held, err := h.TryAcquire(ctx, name, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			f := &revFaults{landThenLose: 1}
			w := revAcquirer(t, c, f, pc.o)
			actx, cancel := context.WithTimeout(ctx, 15*time.Second)
			defer cancel()
			done := revAcquireAsync(actx, w, name, 10*time.Second)
			// Two places: the holder's and the waiter's on its second lease.
			for end := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				ks := revLineKeys(t, cl, name)
				if len(ks) == 2 && len(f.keys()) >= 2 {
					break
				}
				select {
				case r := <-done:
					t.Fatalf("Acquire returned while the name was held: %v", r.err)
				default:
				}
				if time.Now().After(end) {
					t.Fatalf("the waiter did not join again: line %d keys, joins %v", len(ks), f.keys())
				}
			}
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
			ks := revLineKeys(t, cl, name)
			if len(ks) != 1 || ks[0].create != int64(r.l.Token()) || ks[0].lse != etcdfence.LeaseID(r.l) {
				t.Errorf("the line after the grant: %+v, want one key at the token on the grant's lease %x", ks, etcdfence.LeaseID(r.l))
			}
			if err := r.l.Renew(ctx); err != nil {
				t.Errorf("Renew of the grant: %v", err)
			}
			if err := r.l.Release(ctx); err != nil {
				t.Errorf("Release: %v", err)
			}
			o, _ := etcdfence.New(c.Client(t), &etcdfence.Options{NoPool: true})
			l2, err := o.TryAcquire(ctx, name, 5*time.Second)
			if err != nil {
				t.Fatalf("TryAcquire after the waiter released: %v, want a grant", err)
			}
			_ = l2.Release(ctx)
		})
	}
}

// TestRevExpiredTryAcquireHeldRevokedLease: a TryAcquire whose etcd lease is
// gone when its transaction arrives, for a name another holds, answers
// ErrHeld, never a grant nor another error; once the name is free the same
// acquirer (whose pool may now hold that dead lease) grants a live lease.
func TestRevExpiredTryAcquireHeldRevokedLease(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	ctx := context.Background()
	h, _ := etcdfence.New(cl, nil)
	for _, pc := range revPools {
		t.Run(pc.name, func(t *testing.T) {
			name := fencetest.Name("rev-try-held-" + pc.name)
			held, err := h.TryAcquire(ctx, name, 30*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			var on sync.Mutex
			faulty := true
			f := &revFaults{revoke: func(k revKind, n int) bool {
				on.Lock()
				defer on.Unlock()
				return k == revGrant && faulty
			}}
			a := revAcquirer(t, c, f, pc.o)
			for i := 0; i < 3; i++ {
				l, err := a.TryAcquire(ctx, name, 10*time.Second)
				if err == nil {
					t.Fatalf("TryAcquire %d granted token %d for a held name", i, l.Token())
				}
				if !errors.Is(err, fence.ErrHeld) {
					t.Fatalf("TryAcquire %d of a held name on a revoked lease: %v, want ErrHeld", i, err)
				}
			}
			if n := len(f.revokedOf(revGrant)); n != 3 {
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
}

// TestRevExpiredJoinAndMoveLeasesRevoked: a waiter whose first waiter lease
// is gone when its join arrives and whose lock lease is gone when the move
// arrives (grantToo: the lock lease was gone already when its grant's
// transaction arrived; the name is held, so that transaction fails its
// compare and the waiter queues with a dead lock lease). At
// the holder's release it is granted on a live lease with a larger token
// (Renew succeeds, Inspect sees it), and after its release the name is free
// at once and no lease of its lives on.
func TestRevExpiredJoinAndMoveLeasesRevoked(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	ctx := context.Background()
	h, _ := etcdfence.New(cl, nil)
	for _, pc := range revPools {
		for _, grantToo := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/grantToo=%v", pc.name, grantToo), func(t *testing.T) {
				name := fencetest.Name("rev-move-" + pc.name)
				held, err := h.TryAcquire(ctx, name, 30*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				f := &revFaults{revoke: func(k revKind, n int) bool {
					return n == 1 && (k == revJoin || k == revMove || (grantToo && k == revGrant))
				}}
				w := revAcquirer(t, c, f, pc.o)
				actx, cancel := context.WithTimeout(ctx, 15*time.Second)
				defer cancel()
				done := revAcquireAsync(actx, w, name, 10*time.Second)
				for end := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
					if len(revLineKeys(t, cl, name)) == 2 {
						break
					}
					select {
					case r := <-done:
						t.Fatalf("Acquire returned while the name was held: %v", r.err)
					default:
					}
					if time.Now().After(end) {
						t.Fatal("the waiter did not join")
					}
				}
				if err := held.Release(ctx); err != nil {
					t.Fatal(err)
				}
				r := <-done
				if r.err != nil {
					t.Fatalf("Acquire: %v, want a grant", r.err)
				}
				t.Logf("revoked: grant %x, join %x, move %x", f.revokedOf(revGrant), f.revokedOf(revJoin), f.revokedOf(revMove))
				if (len(f.revokedOf(revGrant)) == 1) != grantToo || len(f.revokedOf(revJoin)) != 1 || len(f.revokedOf(revMove)) != 1 {
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
				if ks := revLineKeys(t, cl, name); len(ks) != 0 {
					t.Errorf("the line after the release: %+v", ks)
				}
				if pc.o != nil {
					revGone(t, cl, id, "the released lease (no pool)")
				}
			})
		}
	}
}

// TestRevExpiredManyWaitersExclusion: on one member and on three, six
// acquirers (three pooled, three not; two on a 3s lock lease, which shares
// the pool's slot with waiter leases) take the name in turn, four times
// each, while some of their leases
// (a grant's, a join's, a move's) are revoked before the transaction that
// names them. No two hold it at once, tokens grow in grant order, every
// grant is live (Renew succeeds), and every Acquire is granted.
func TestRevExpiredManyWaitersExclusion(t *testing.T) {
	for _, members := range []int{1, 3} {
		t.Run(fmt.Sprintf("members=%d", members), func(t *testing.T) { revManyWaiters(t, members) })
	}
}

func revManyWaiters(t *testing.T, members int) {
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
		f := &revFaults{revoke: func(k revKind, n int) bool {
			switch k {
			case revGrant:
				return (n+i)%3 == 0
			case revJoin:
				return (n+i)%2 == 0
			case revMove:
				return (n+i)%3 == 1
			}
			return false
		}}
		o := &etcdfence.Options{NoPool: i%2 == 1}
		a := revAcquirer(t, c, f, o)
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
	if ks := revLineKeys(t, cl, name); len(ks) != 0 {
		t.Errorf("the line after every release: %+v", ks)
	}
}

// TestRevExpiredTryAcquireEveryLeasePooled: with the pool on and a lease
// pooled, every lease's transaction arrives after it is gone. TryAcquire
// gives up after a few leases with an error that is neither ErrHeld nor
// ErrLost (the name is free), no lease of its lives on, and the name is free.
func TestRevExpiredTryAcquireEveryLeasePooled(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	ctx := context.Background()
	name := fencetest.Name("rev-try-all")
	var on sync.Mutex
	faulty := false
	f := &revFaults{revoke: func(k revKind, n int) bool {
		on.Lock()
		defer on.Unlock()
		return faulty && k == revGrant
	}}
	a := revAcquirer(t, c, f, nil)
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := etcdfence.PooledLease(a, 10*time.Second); !ok {
		t.Fatal("no lease pooled after a release")
	}
	on.Lock()
	faulty = true
	on.Unlock()
	l, err = a.TryAcquire(ctx, name, 10*time.Second)
	if err == nil {
		t.Fatalf("TryAcquire granted token %d with every lease revoked", l.Token())
	}
	revoked := f.revokedOf(revGrant)
	t.Logf("TryAcquire: %v (after %d leases)", err, len(revoked))
	if errors.Is(err, fence.ErrHeld) || errors.Is(err, fence.ErrLost) {
		t.Errorf("TryAcquire of a free name: %v, want neither ErrHeld nor ErrLost", err)
	}
	if n := len(revoked); n < 2 || n > 5 {
		t.Errorf("TryAcquire took %d leases, want 2..5", n)
	}
	for _, id := range revoked {
		revGone(t, cl, id, "a revoked grant lease")
	}
	if ks := revLineKeys(t, cl, name); len(ks) != 0 {
		t.Errorf("the line after TryAcquire gave up: %+v", ks)
	}
}
