package wakeup

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
)

type testLease struct{ *leasekit.Base }

func (testLease) Renew(context.Context) error   { return nil }
func (testLease) Release(context.Context) error { return nil }

// TestWithdraw: an offer withdrawn (the offerer found the lock held and
// sent nothing that could grant) leaves the head waiting at its own pace,
// with no attempt of its own at once (as Hand with an empty Handoff would
// make), and the head can be offered again; a lease handed then is what
// AcquireHanded returns.
func TestWithdraw(t *testing.T) {
	var l Line
	var attempts atomic.Int32
	name := "withdraw"
	hour := fence.Backoff{Min: time.Hour, Max: time.Hour, MaxWait: 2 * time.Hour}
	type result struct {
		l   fence.Lease
		err error
	}
	done := make(chan result, 1)
	go func() {
		lease, err := l.AcquireHanded(context.Background(), hour, name, struct{}{}, nil, func(context.Context, any) (fence.Lease, error) {
			attempts.Add(1)
			return nil, fence.ErrHeld
		}, nil)
		done <- result{lease, err}
	}()
	for end := time.Now().Add(10 * time.Second); !l.HeadWaiting(name); {
		if time.Now().After(end) {
			t.Fatal("the head did not make its first attempt within 10s")
		}
		time.Sleep(time.Millisecond) // polling the line's state
	}
	p, req := l.Offer(name)
	if p == nil || req == nil {
		t.Fatal("Offer to a waiting head returned nothing")
	}
	if l.HeadWaiting(name) {
		t.Fatal("HeadWaiting while an offer to the head is in flight")
	}
	l.Withdraw(p)
	if !l.HeadWaiting(name) {
		t.Fatal("the head is not waiting between attempts after Withdraw")
	}
	p2, _ := l.Offer(name)
	if p2 != p {
		t.Fatalf("Offer after Withdraw: %v, want the head's place again", p2)
	}
	want := testLease{leasekit.New(name, 7, time.Minute, 0, time.Now())}
	if !l.Hand(p2, Handoff{Lease: want}) {
		t.Fatal("Hand to a waiting head reported false")
	}
	r := <-done
	if r.err != nil || r.l != fence.Lease(want) {
		t.Fatalf("AcquireHanded: %v, %v; want the handed lease", r.l, r.err)
	}
	if n := attempts.Load(); n != 1 {
		t.Fatalf("the head made %d attempts, want 1 (its first): a withdrawn offer made it try", n)
	}
}

// TestHandedLeaseAlreadyEnded: a lease handed to the head that has ended by
// the time the head takes it (it was taken after an attempt of the head's
// own, past its local deadline) is not returned: it goes to abandon, and
// the head tries at once.
func TestHandedLeaseAlreadyEnded(t *testing.T) {
	var l Line
	var attempts atomic.Int32
	name := "ended"
	hour := fence.Backoff{Min: time.Hour, Max: time.Hour, MaxWait: 2 * time.Hour}
	fresh := testLease{leasekit.New(name, 9, time.Minute, 0, time.Now())}
	var abandoned []Handoff
	done := make(chan fence.Lease, 1)
	go func() {
		lease, err := l.AcquireHanded(context.Background(), hour, name, struct{}{}, nil, func(context.Context, any) (fence.Lease, error) {
			if attempts.Add(1) == 1 {
				return nil, fence.ErrHeld
			}
			return fresh, nil
		}, func(h Handoff) { abandoned = append(abandoned, h) })
		if err != nil {
			t.Error(err)
		}
		done <- lease
	}()
	for end := time.Now().Add(10 * time.Second); !l.HeadWaiting(name); {
		if time.Now().After(end) {
			t.Fatal("the head did not make its first attempt within 10s")
		}
		time.Sleep(time.Millisecond) // polling the line's state
	}
	ended := testLease{leasekit.New(name, 8, time.Minute, 0, time.Now())}
	ended.End(fence.ErrLost)
	p, _ := l.Offer(name)
	if p == nil || !l.Hand(p, Handoff{Lease: ended}) {
		t.Fatal("the offer to the waiting head failed")
	}
	got := <-done
	if got != fence.Lease(fresh) {
		t.Fatalf("AcquireHanded returned %v, want the lease of its own attempt after the ended handoff", got)
	}
	if len(abandoned) != 1 || abandoned[0].Lease != fence.Lease(ended) {
		t.Fatalf("abandon got %v, want the ended lease", abandoned)
	}
}

// TestOfferIdle: OfferIdle passes over a head inside an attempt of its own
// (whose attempt could be granted beside the offerer's grant), and offers
// it once the attempt ended in ErrHeld; Offer offers it during the attempt
// (the releaser holds the lock, so the attempt cannot be granted).
func TestOfferIdle(t *testing.T) {
	var l Line
	name := "idle"
	hour := fence.Backoff{Min: time.Hour, Max: time.Hour, MaxWait: 2 * time.Hour}
	inside, finish := make(chan struct{}), make(chan struct{})
	var attempts atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := l.AcquireHanded(ctx, hour, name, struct{}{}, nil, func(context.Context, any) (fence.Lease, error) {
			if attempts.Add(1) == 1 {
				close(inside)
				<-finish
			}
			return nil, fence.ErrHeld
		}, nil)
		done <- err
	}()
	<-inside
	if p, _ := l.OfferIdle(name); p != nil {
		t.Fatal("OfferIdle offered a head inside an attempt of its own")
	}
	p, _ := l.Offer(name)
	if p == nil {
		t.Fatal("Offer passed over a head inside a young attempt")
	}
	l.Withdraw(p)
	close(finish)
	for end := time.Now().Add(10 * time.Second); !l.HeadWaiting(name); {
		if time.Now().After(end) {
			t.Fatal("the head's attempt did not end within 10s")
		}
		time.Sleep(time.Millisecond) // polling the line's state
	}
	if p, _ := l.OfferIdle(name); p == nil {
		t.Fatal("OfferIdle passed over a head between attempts")
	} else {
		l.Withdraw(p)
	}
	cancel()
	if err := <-done; err == nil {
		t.Fatal("AcquireHanded returned no error after its context ended")
	}
}
