package natsfence_test

import (
	"bytes"
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// longTimeout is a request Timeout far above anything a lost reply should
// cost once the connection that lost it has broken.
const longTimeout = time.Minute

// TestLostReplyEndsAtTheBreak: a request whose reply is lost with its
// connection (faultnet forwards it, then cuts) is answered at the break, not
// after its Timeout: the nats client would wait the whole minute for a reply
// that can no longer come, although it reconnects within milliseconds. The
// write, the grant and the release each land once and are recognised.
func TestLostReplyEndsAtTheBreak(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	bound := longTimeout / 2

	bucket(t, j, writerBucket)
	w, err := natsfence.NewWriter(ctx, j, writerBucket.Bucket, &natsfence.WriterOptions{Timeout: longTimeout})
	if err != nil {
		t.Fatal(err)
	}
	check := newWriter(t, js(t), writerBucket)
	key := fencetest.Name("break")
	if err := w.Write(ctx, key, []byte("v1"), 5); err != nil {
		t.Fatal(err)
	}
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(writerBucket.Bucket))
	start := time.Now()
	err = w.Write(ctx, key, []byte("v2"), 6)
	took := time.Since(start)
	waitLost(t, p, before)
	if err != nil {
		t.Fatalf("a write whose ack was lost with its connection: %v", err)
	}
	if took > bound {
		t.Fatalf("the write whose ack was lost took %v: it waited for its Timeout (%v), not for the break", took, longTimeout)
	}
	if v, tok, err := check.Read(ctx, key); err != nil || string(v) != "v2" || tok != 6 {
		t.Fatalf("Read = %q %d %v, want v2 6", v, tok, err)
	}

	bucket(t, j, lockBucket)
	a, err := natsfence.New(ctx, j, lockBucket.Bucket, &natsfence.Options{Timeout: longTimeout})
	if err != nil {
		t.Fatal(err)
	}
	other := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("break")
	before = p.Stats().LostReplies
	p.LoseReply(createTo(lockBucket.Bucket))
	start = time.Now()
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	took = time.Since(start)
	waitLost(t, p, before)
	if err != nil {
		t.Fatalf("a grant whose answer was lost with its connection: %v", err)
	}
	if took > bound {
		t.Fatalf("the grant whose answer was lost took %v: it waited for its Timeout", took)
	}
	if _, err := other.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("another acquirer while the recognised grant holds: %v, want ErrHeld", err)
	}
	before = p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	start = time.Now()
	err = l.Release(ctx)
	took = time.Since(start)
	waitLost(t, p, before)
	if err != nil {
		t.Fatalf("a release whose answer was lost with its connection: %v", err)
	}
	if took > bound {
		t.Fatalf("the release whose answer was lost took %v: it waited for its Timeout", took)
	}
	l2, err := other.TryAcquire(ctx, name, time.Second)
	if err != nil || l2.Token() <= l.Token() {
		t.Fatalf("after the release: %v, %v (token %d before)", l2, err, l.Token())
	}
	_ = l2.Release(ctx)
}

// TestWaiterAfterABreak: a waiter whose connection breaks while it waits is
// granted promptly when the holder releases while it is away. Its watch
// cannot see that release: the server either delivers the release's marker
// to the connection that just broke (the client's ordered consumer notices
// the gap only at its next idle heartbeat, 5s later, and starts again after
// the last message it saw) or keeps it for the client's return, and the
// marker lives only LimitMarkerTTL (1s). The test makes this certain, not
// likely: the cut lands once the waiter's try has found the name held and it
// waits (a hook), and the waiter's client is kept away until the holder's
// release has been sent and its marker has aged out of the stream. With
// Recheck at a minute, only trying again and watching anew at the break gets
// it the lock in time.
func TestWaiterAfterABreak(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	direct := js(t)
	holderSide := newAcquirer(t, direct, lockBucket, nil)
	bucket(t, j, lockBucket)
	stream, err := direct.Stream(ctx, "KV_"+lockBucket.Bucket)
	if err != nil {
		t.Fatal(err)
	}
	waiter, err := natsfence.New(ctx, j, lockBucket.Bucket, &natsfence.Options{Recheck: longTimeout, MaxWait: 2 * longTimeout})
	if err != nil {
		t.Fatal(err)
	}
	waiting := waitingHook(t)
	for round := 0; round < 3; round++ {
		name := fencetest.Name("breakwait")
		key := natsfence.EncodeKey(name)
		h, err := holderSide.TryAcquire(ctx, name, 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		res := make(chan error, 1)
		var got fence.Lease
		go func() {
			l, err := waiter.Acquire(ctx, name, 30*time.Second)
			got = l
			res <- err
		}()
		waitKey(t, waiting, key, res, "the waiter never waited for the held name")
		// Cut, and keep the waiter's client away (its reconnections cut
		// at their CONNECT) until the release has been sent and its
		// marker has aged out of the stream.
		var away atomic.Bool
		away.Store(true)
		for range 1000 {
			p.DropRequest(func(b []byte) bool { return away.Load() && bytes.HasPrefix(b, []byte("CONNECT ")) })
		}
		back := j.Conn().StatusChanged(nats.CONNECTED)
		cuts := p.Stats().Cuts
		p.CutAll()
		if p.Stats().Cuts == cuts {
			t.Fatalf("round %d: the cut cut no connection", round)
		}
		if err := h.Release(ctx); err != nil {
			t.Fatal(err)
		}
		markerGone(t, stream, "$KV."+lockBucket.Bucket+"."+key)
		j.Conn().RemoveStatusListener(back)
		if _, ok := <-back; ok || j.Conn().IsConnected() {
			t.Fatalf("round %d: the waiter's client was connected again before the release's marker was gone", round)
		}
		away.Store(false)
		start := time.Now()
		select {
		case err := <-res:
			if err != nil {
				t.Fatalf("round %d: the waiter after a break and the holder's release: %v", round, err)
			}
		case <-time.After(longTimeout / 2):
			t.Fatalf("round %d: the waiter was not granted within %v of its return after a break and the release (Recheck %v): its watch missed the release", round, longTimeout/2, longTimeout)
		}
		t.Logf("round %d: granted %v after the client was let back", round, time.Since(start))
		if got.Token() <= h.Token() {
			t.Fatalf("token %d after the holder's %d", got.Token(), h.Token())
		}
		_ = got.Release(ctx)
	}
}

// TestWaiterWhoseWatchWasCut: a waiter whose connection breaks while its
// watch is being made (the consumer's create request dropped with the
// connection) has no watch; its try, after the reconnect, finds the name
// held. The holder's release, once it waits, must still reach it well within
// Recheck: the break before it waited makes it watch anew.
func TestWaiterWhoseWatchWasCut(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	holderSide := newAcquirer(t, js(t), lockBucket, nil)
	bucket(t, j, lockBucket)
	waiter, err := natsfence.New(ctx, j, lockBucket.Bucket, &natsfence.Options{Recheck: longTimeout, MaxWait: 2 * longTimeout})
	if err != nil {
		t.Fatal(err)
	}
	waiting := waitingHook(t)
	name := fencetest.Name("breakwatch")
	key := natsfence.EncodeKey(name)
	h, err := holderSide.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var dropped atomic.Bool
	p.DropRequest(func(b []byte) bool {
		if bytes.Contains(b, []byte("CONSUMER.CREATE")) && bytes.Contains(b, []byte(key)) {
			dropped.Store(true)
			return true
		}
		return false
	})
	res := make(chan error, 1)
	var got fence.Lease
	go func() {
		l, err := waiter.Acquire(ctx, name, 30*time.Second)
		got = l
		res <- err
	}()
	waitKey(t, waiting, key, res, "the waiter never waited for the held name")
	if !dropped.Load() {
		t.Fatal("the waiter waited, but its watch's create request was not dropped with its connection")
	}
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	select {
	case err := <-res:
		if err != nil {
			t.Fatalf("the waiter whose watch was cut, after the holder's release: %v", err)
		}
	case <-time.After(longTimeout / 2):
		t.Fatalf("the waiter whose watch was cut was not granted within %v of the release (Recheck %v)", longTimeout/2, longTimeout)
	}
	t.Logf("granted %v after the release", time.Since(start))
	if got.Token() <= h.Token() {
		t.Fatalf("token %d after the holder's %d", got.Token(), h.Token())
	}
	_ = got.Release(ctx)
}

// waitingHook reports, on the channel it returns, the lock key of each
// waiting Acquire that begins to wait, until t ends.
func waitingHook(t *testing.T) <-chan string {
	ch := make(chan string, 64)
	natsfence.SetWaitingHook(func(key string) {
		select {
		case ch <- key:
		default:
		}
	})
	t.Cleanup(func() { natsfence.SetWaitingHook(nil) })
	return ch
}

// waitKey waits until waiting reports key; it fails with msg after 30s, or
// when the Acquire ends first (res).
func waitKey(t *testing.T, waiting <-chan string, key string, res <-chan error, msg string) {
	t.Helper()
	limit := time.After(30 * time.Second)
	for {
		select {
		case k := <-waiting:
			if k == key {
				return
			}
		case err := <-res:
			t.Fatalf("%s: Acquire ended first: %v", msg, err)
		case <-limit:
			t.Fatal(msg)
		}
	}
}

// markerGone waits until the last message on subj (a release's marker) has
// aged out of stream.
func markerGone(t *testing.T, stream jetstream.Stream, subj string) {
	t.Helper()
	for giveUp := time.Now().Add(30 * time.Second); ; {
		_, err := stream.GetLastMsgForSubject(context.Background(), subj)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return
		}
		if err != nil {
			t.Fatalf("the last message on %s: %v", subj, err)
		}
		if time.Now().After(giveUp) {
			t.Fatalf("the release's marker on %s did not age out within 30s", subj)
		}
		time.Sleep(10 * time.Millisecond) // polling the server, not synchronisation
	}
}
