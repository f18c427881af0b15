package etcdfence_test

// Rejoining the line: an Acquire whose waiter lease expired while it waited
// joins the line again. Each test drives a waiter behind a fault proxy
// until etcd expires its waiter lease, and checks one promise of Acquire's
// doc comment through the public API against the embedded etcd.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/etcdtest"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

const rejoinOwner = "rejoiner"

// rejoinSetup: a 1-member cluster, a direct acquirer (and its client), an
// acquirer behind a fault proxy whose keys carry rejoinOwner, and a name.
func rejoinSetup(t *testing.T, prefix string) (*etcdfence.Acquirer, *clientv3.Client, *etcdfence.Acquirer, *faultnet.Proxy, string) {
	t.Helper()
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, err := etcdfence.NewAcquirer(cl, &etcdfence.AcquirerOptions{Owner: "direct"})
	if err != nil {
		t.Fatal(err)
	}
	b, p := behindProxy(t, c, &etcdfence.AcquirerOptions{Owner: rejoinOwner})
	return a, cl, b, p, fencetest.Name(prefix)
}

// placesOf watches name's line from now on and reports the most keys owned
// by owner that were in the line at once (one Acquire never holds two
// places).
func placesOf(t *testing.T, cl *clientv3.Client, name, owner string) func() int {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	resp, err := cl.Get(ctx, linePrefix(name), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		live = map[string]bool{}
		most int
	)
	for _, kv := range resp.Kvs {
		if string(kv.Value) == owner {
			live[string(kv.Key)] = true
		}
	}
	most = len(live)
	wch := cl.Watch(ctx, linePrefix(name), clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	go func() {
		for wr := range wch {
			mu.Lock()
			for _, ev := range wr.Events {
				k := string(ev.Kv.Key)
				switch {
				case ev.Type == mvccpb.DELETE:
					delete(live, k)
				case string(ev.Kv.Value) == owner:
					live[k] = true
				}
			}
			most = max(most, len(live))
			mu.Unlock()
		}
	}()
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return most
	}
}

// leaseSet is the set of etcd leases the cluster has now.
func leaseSet(t *testing.T, cl *clientv3.Client) map[clientv3.LeaseID]bool {
	t.Helper()
	resp, err := cl.Leases(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	s := map[clientv3.LeaseID]bool{}
	for _, l := range resp.Leases {
		s[l.ID] = true
	}
	return s
}

// leasesBackTo waits up to within for the cluster's leases to be a subset of
// base (what the rejoiner's Acquire granted is gone), and reports the extra
// leases left with their ttl.
func leasesBackTo(t *testing.T, cl *clientv3.Client, base map[clientv3.LeaseID]bool, within time.Duration) []string {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		var extra []string
		for id := range leaseSet(t, cl) {
			if !base[id] {
				ttl, err := cl.TimeToLive(context.Background(), id, clientv3.WithAttachedKeys())
				if err == nil && ttl.TTL > 0 {
					keys := make([]string, 0, len(ttl.Keys))
					for _, k := range ttl.Keys {
						keys = append(keys, string(k))
					}
					extra = append(extra, fmt.Sprintf("%x (ttl %ds of %ds, keys %v)", int64(id), ttl.TTL, ttl.GrantedTTL, keys))
				}
			}
		}
		if len(extra) == 0 || time.Now().After(deadline) {
			return extra
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// loseThePlace partitions the proxy until etcd expired the rejoiner's waiter
// lease (its key left the line: n keys remain), then heals.
func loseThePlace(t *testing.T, cl *clientv3.Client, p *faultnet.Proxy, name string, n int64) {
	t.Helper()
	p.Partition()
	waitLine(t, cl, name, n)
	p.Heal()
}

// etcdfenceGoroutines lists the goroutines running in package etcdfence.
func etcdfenceGoroutines() []string {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "fencekit/adapters/etcd.") && !strings.Contains(g, "etcdfence_test.") && !strings.Contains(g, "adapters/etcd_test.") {
			out = append(out, g)
		}
	}
	return out
}

// TestRejoinedWaiterQueuesBehindLaterWaiter: the rejoiner's place
// expires while it is cut off, the holder releases, the waiter that was
// behind it is granted; the rejoiner, healed, joins again behind it and is
// granted only after that holder's release, with a larger token, holding
// one place in line at a time.
func TestRejoinedWaiterQueuesBehindLaterWaiter(t *testing.T) {
	a, cl, b, p, name := rejoinSetup(t, "rv-behind")
	ctx := context.Background()
	places := placesOf(t, cl, name, rejoinOwner)
	h, err := a.TryAcquire(ctx, name, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	type stamped struct {
		acquired
		at time.Time
	}
	res := make(chan stamped, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 45*time.Second)
		defer cancel()
		l, err := b.Acquire(wctx, name, 30*time.Second)
		res <- stamped{acquired{l, err}, time.Now()}
	}()
	waitLine(t, cl, name, 2)
	xres := acquireAsync(a, name, 45*time.Second)
	waitLine(t, cl, name, 3)
	p.Partition()
	waitLine(t, cl, name, 2) // the rejoiner's key expired
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	x := <-xres
	if x.err != nil {
		t.Fatalf("the waiter behind the expired place: %v", x.err)
	}
	p.Heal()
	waitLine(t, cl, name, 2) // the rejoiner is back, behind x
	released := time.Now()
	if err := x.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatalf("rejoiner: %v", r.err)
	}
	defer r.l.Release(ctx)
	if r.at.Before(released) {
		t.Errorf("the rejoiner was granted (token %d) at %v, before x (token %d) released at %v", r.l.Token(), r.at, x.l.Token(), released)
	}
	if !(h.Token() < x.l.Token() && x.l.Token() < r.l.Token()) {
		t.Errorf("tokens holder %d, x %d, rejoiner %d: want increasing", h.Token(), x.l.Token(), r.l.Token())
	}
	if err := r.l.Context().Err(); err != nil {
		t.Errorf("the rejoiner's lease is already lost: %v", context.Cause(r.l.Context()))
	}
	if n := places(); n > 1 {
		t.Errorf("the rejoiner held %d places in line at once", n)
	}
}

// TestRejoinGivesUpAtDeadline: the rejoiner's context ends while it
// waits in line again: ErrHeld joined with DeadlineExceeded, on time, and
// nothing of it stays in line or among etcd's leases.
func TestRejoinGivesUpAtDeadline(t *testing.T) {
	a, cl, b, p, name := rejoinSetup(t, "rv-deadline")
	places := placesOf(t, cl, name, rejoinOwner)
	waiterGivesUpAtDeadline(t, a, cl, b, name, 12*time.Second, "rejoiner", "the rejoiner gave up", func() {
		loseThePlace(t, cl, p, name, 1)
		waitLine(t, cl, name, 2) // joined again
	}, func() {})
	if n := places(); n > 1 {
		t.Errorf("the rejoiner held %d places in line at once", n)
	}
}

// TestPlaceExpiredWhileCutOffGivesUpAtDeadline: the place expires and the
// deadline passes while the waiter is still cut off: ErrHeld joined with
// DeadlineExceeded on time; once healed, nothing of it stays (the lock
// lease it kept alive while it waited is revoked, not left for its 30s).
func TestPlaceExpiredWhileCutOffGivesUpAtDeadline(t *testing.T) {
	a, cl, b, p, name := rejoinSetup(t, "rv-cutdeadline")
	waiterGivesUpAtDeadline(t, a, cl, b, name, 8*time.Second, "cut-off waiter", "healing", func() {
		p.Partition()
		waitLine(t, cl, name, 1)
	}, p.Heal)
}

// waiterGivesUpAtDeadline has a hold name for 60s and b wait for it (a 30s
// lease) until wait from now; fault runs once b is in line, and heal once
// its Acquire returned. The Acquire must end with ErrHeld joined with
// DeadlineExceeded within a second of its deadline; 3s after heal none of
// its leases may live on, and only the holder's key be in line. who and
// after name the waiter and the moment in the failure messages.
func waiterGivesUpAtDeadline(t *testing.T, a *etcdfence.Acquirer, cl *clientv3.Client, b *etcdfence.Acquirer, name string, wait time.Duration, who, after string, fault, heal func()) {
	t.Helper()
	ctx := context.Background()
	h, err := a.TryAcquire(ctx, name, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Release(ctx)
	base := leaseSet(t, cl)
	deadline := time.Now().Add(wait)
	type stamped struct {
		acquired
		at time.Time
	}
	res := make(chan stamped, 1)
	go func() {
		wctx, cancel := context.WithDeadline(ctx, deadline)
		defer cancel()
		l, err := b.Acquire(wctx, name, 30*time.Second)
		res <- stamped{acquired{l, err}, time.Now()}
	}()
	waitLine(t, cl, name, 2)
	fault()
	r := <-res
	heal()
	if r.err == nil {
		r.l.Release(ctx)
		t.Fatalf("granted (token %d) while the holder %d holds", r.l.Token(), h.Token())
	}
	if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.DeadlineExceeded) {
		t.Errorf("%s at its deadline: %v, want ErrHeld joined with DeadlineExceeded", who, r.err)
	}
	if late := r.at.Sub(deadline); late > time.Second {
		t.Errorf("Acquire returned %v after its deadline", late)
	}
	if extra := leasesBackTo(t, cl, base, 3*time.Second); len(extra) > 0 {
		t.Errorf("3s after %s, its leases live on: %v", after, extra)
	}
	waitLine(t, cl, name, 1)
}

// TestRejoinTwice: the place expires twice; the waiter joins again
// each time, holds one place at a time, and is granted at the release with a
// live lease and a larger token; once it returned and released, no goroutine
// of the package is left and no lease of it lives on.
func TestRejoinTwice(t *testing.T) {
	a, cl, b, p, name := rejoinSetup(t, "rv-twice")
	ctx := context.Background()
	places := placesOf(t, cl, name, rejoinOwner)
	h, err := a.TryAcquire(ctx, name, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	base := leaseSet(t, cl)
	res := acquireAsync(b, name, 45*time.Second)
	waitLine(t, cl, name, 2)
	loseThePlace(t, cl, p, name, 1)
	waitLine(t, cl, name, 2)
	loseThePlace(t, cl, p, name, 1)
	waitLine(t, cl, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatalf("after two expiries: %v", r.err)
	}
	if r.l.Token() <= h.Token() {
		t.Errorf("token %d after the holder's %d", r.l.Token(), h.Token())
	}
	if err := r.l.Context().Err(); err != nil {
		t.Errorf("the lease returned is already lost: %v", context.Cause(r.l.Context()))
	}
	if err := r.l.Release(ctx); err != nil {
		t.Errorf("release: %v", err)
	}
	if err := b.Close(ctx); err != nil {
		t.Errorf("close: %v", err)
	}
	if n := places(); n > 1 {
		t.Errorf("the rejoiner held %d places in line at once", n)
	}
	if extra := leasesBackTo(t, cl, base, 3*time.Second); len(extra) > 0 {
		t.Errorf("after the rejoiner released and closed, leases live on: %v", extra)
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		gs := etcdfenceGoroutines()
		if len(gs) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("%d goroutines of etcdfence left 3s after the rejoiner returned and released:\n%s", len(gs), strings.Join(gs, "\n\n"))
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
}
