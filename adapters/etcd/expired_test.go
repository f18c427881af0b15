package etcdfence_test

// A lease that etcd no longer has when the transaction that uses it arrives:
// on a loaded 3-member cluster a fresh lease's ttl ran out between its grant
// and the create of its key, and Acquire returned etcd's "requested lease not
// found" (CI on 0a0c859, TestAcquirerConformanceThreeMembers/MutualExclusion).
// The tests revoke the lease in a gRPC interceptor just before the
// transaction is sent, which is what etcd sees when the ttl ran out.

import (
	"context"
	"errors"
	"net/url"
	"sync"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/etcdtest"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
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
	a, err := etcdfence.New(cl, &etcdfence.Options{NoPool: true})
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
		b, _ := etcdfence.New(c.Client(t), nil)
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
	c := etcdtest.Start(t, 1)
	ctx := context.Background()
	cl := c.Client(t)
	h, _ := etcdfence.New(cl, nil)
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
