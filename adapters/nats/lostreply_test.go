package natsfence_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// publishTo matches a client chunk that publishes to a key of bucket (PUB or
// HPUB), and not the reads before it.
func publishTo(bucket string) func([]byte) bool {
	return func(b []byte) bool { return bytes.Contains(b, []byte("PUB $KV."+bucket+".")) }
}

// createTo matches a client chunk that publishes a grant's create to a key of
// bucket: a publish that is not a marker (a grant on a key without one writes
// a marker first).
func createTo(bucket string) func([]byte) bool {
	pub := publishTo(bucket)
	return func(b []byte) bool { return pub(b) && !bytes.Contains(b, []byte("KV-Operation")) }
}

// waitLost waits until p has thrown away a reply, after a call that armed it.
func waitLost(t *testing.T, p *faultnet.Proxy, before int64) {
	t.Helper()
	for giveUp := time.Now().Add(10 * time.Second); p.Pending() != 0 || p.Stats().LostReplies == before; {
		if time.Now().After(giveUp) {
			t.Fatalf("the armed fault never fired (pending %d)", p.Pending())
		}
		time.Sleep(time.Millisecond)
	}
}

// TestWriterLostPublishAck: the suite's lost-reply cases lose the reply of the
// writer's first request, its read. Here the JetStream ack of the publish
// itself is lost (the entry landed): the writer recognises its write id and
// returns nil, the entry holds the value, and a lower token is refused.
func TestWriterLostPublishAck(t *testing.T) {
	j, p := proxied(t)
	w := newWriter(t, j, writerBucket)
	check := newWriter(t, js(t), writerBucket)
	ctx := context.Background()
	for _, del := range []bool{false, true} {
		key := fencetest.Name("lostack")
		if err := w.Write(ctx, key, []byte("v1"), 5); err != nil {
			t.Fatal(err)
		}
		before := p.Stats().LostReplies
		p.LoseReply(publishTo(writerBucket.Bucket))
		var err error
		if del {
			err = w.Delete(ctx, key, 6)
		} else {
			err = w.Write(ctx, key, []byte("v2"), 6)
		}
		waitLost(t, p, before)
		if err != nil {
			t.Fatalf("delete %v: a write whose ack was lost after it landed: %v, want nil (recognised by its write id)", del, err)
		}
		v, tok, err := check.Read(ctx, key)
		if del {
			if !errors.Is(err, fence.ErrNotFound) {
				t.Fatalf("Read after the delete: %q %d %v", v, tok, err)
			}
		} else if err != nil || string(v) != "v2" || tok != 6 {
			t.Fatalf("Read = %q %d %v, want v2 6", v, tok, err)
		}
		if err := check.Write(ctx, key, []byte("old"), 5); !errors.Is(err, fence.ErrStale) {
			t.Fatalf("a lower token after the recognised write: %v", err)
		}
	}
}

// TestWriterDroppedPublish: a publish that never reached the server (the
// connection broke before it) is sent again and lands once.
func TestWriterDroppedPublish(t *testing.T) {
	j, p := proxied(t)
	w := newWriter(t, j, writerBucket)
	ctx := context.Background()
	key := fencetest.Name("dropped")
	if err := w.Write(ctx, key, []byte("v1"), 1); err != nil {
		t.Fatal(err)
	}
	p.DropRequest(publishTo(writerBucket.Bucket))
	if err := w.Write(ctx, key, []byte("v2"), 2); err != nil {
		t.Fatalf("a write whose first publish was dropped: %v", err)
	}
	if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "v2" || tok != 2 {
		t.Fatalf("Read = %q %d %v", v, tok, err)
	}
}

// TestWriterUnknownWhenCutOff: a writer cut off from the server (a partition
// that lasts) returns an error matching fence.ErrUnknown within RetryFor, not a
// hang and not a bare timeout; once healed, the same write settles.
func TestWriterUnknownWhenCutOff(t *testing.T) {
	j, p := proxied(t)
	bucket(t, j, writerBucket)
	w, err := natsfenceWriter(j, 300*time.Millisecond, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := fencetest.Name("cutoff")
	if err := w.Write(ctx, key, []byte("v1"), 1); err != nil {
		t.Fatal(err)
	}
	p.LoseReply(publishTo(writerBucket.Bucket))
	p.Refuse(true) // the reconnect after the lost reply is refused
	start := time.Now()
	err = w.Write(ctx, key, []byte("v2"), 2)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a write cut off after its publish: %v, want ErrUnknown", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("ErrUnknown after %v, RetryFor is 1s", d)
	}
	p.Refuse(false)
	if err := w.Write(ctx, key, []byte("v2"), 2); err != nil {
		t.Fatalf("the same write after the heal: %v", err)
	}
}

// writerWithAckArmed returns a writer of writerBucket behind a new proxy
// (Timeout 5s, RetryFor 20s), a writer on a direct client to check it, the
// proxy, and fencetest.Name(label) written with v5 at token 5; the proxy is
// then armed to lose the next publish's ack, and before is its count of
// lost replies at that moment.
func writerWithAckArmed(t *testing.T, label string) (w, check *natsfence.Writer, p *faultnet.Proxy, key string, before int64) {
	t.Helper()
	j, p := proxied(t)
	bucket(t, j, writerBucket)
	w, err := natsfenceWriter(j, 5*time.Second, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	check = newWriter(t, js(t), writerBucket)
	key = fencetest.Name(label)
	if err := w.Write(context.Background(), key, []byte("v5"), 5); err != nil {
		t.Fatal(err)
	}
	before = p.Stats().LostReplies
	p.LoseReply(publishTo(writerBucket.Bucket))
	return w, check, p, key, before
}

// TestWriterLostAckThenNewerToken: the ack of a write with token 6 is lost,
// and a write with token 7 lands before the writer looks again. The first
// write did land, so the writer must not call it stale (which says nothing
// changed): it returns ErrUnknown, and the key holds 7.
func TestWriterLostAckThenNewerToken(t *testing.T) {
	// RetryFor (20s) outlasts the refused reconnections below.
	w, check, p, key, before := writerWithAckArmed(t, "lostnewer")
	ctx := context.Background()
	// The lost ack closes the writer's connection, and its reconnection is
	// refused until the newer write has landed: the writer cannot look
	// again before it (on a loaded machine it once reconnected and recognised
	// its own write first, a correct nil that this case is not about).
	p.Refuse(true)
	done := make(chan error, 1)
	go func() { done <- w.Write(ctx, key, []byte("v6"), 6) }()
	waitLost(t, p, before)
	if v, tok, err := check.Read(ctx, key); err != nil || tok != 6 {
		t.Fatalf("the write whose ack was lost did not land: %q %d %v", v, tok, err)
	}
	if err := check.Write(ctx, key, []byte("v7"), 7); err != nil {
		t.Fatal(err)
	}
	p.Refuse(false)
	err := <-done
	if !errors.Is(err, fence.ErrUnknown) || errors.Is(err, fence.ErrStale) && !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a landed write with a lost ack, then overwritten by a newer token: %v, want ErrUnknown", err)
	}
	if v, tok, err := check.Read(ctx, key); err != nil || string(v) != "v7" || tok != 7 {
		t.Fatalf("Read = %q %d %v, want v7 7", v, tok, err)
	}
}

// TestGrantLostAck: the ack of the create that grants a lease is lost (the key
// landed): TryAcquire recognises its own entry by its nonce and returns the
// lease, which excludes others, instead of ErrHeld against itself (which would
// leave the name blocked for the ttl).
func TestGrantLostAck(t *testing.T) {
	a, p := proxiedAcquirer(t, nil)
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	warm, err := a.TryAcquire(ctx, fencetest.Name("warm"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Release(ctx)
	name := fencetest.Name("lostgrant")
	before := p.Stats().LostReplies
	p.LoseReply(createTo(lockBucket.Bucket))
	l, err := a.TryAcquire(ctx, name, 20*time.Second)
	waitLost(t, p, before)
	if err != nil {
		t.Fatalf("a grant whose ack was lost after the key landed: %v, want the lease", err)
	}
	if _, err := other.TryAcquire(ctx, name, 5*time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("another acquirer while the recognised lease is held: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l2, err := other.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("after the release: %v", err)
	}
	if l2.Token() <= l.Token() {
		t.Errorf("token %d not above %d", l2.Token(), l.Token())
	}
	_ = l2.Release(ctx)
}

// TestGrantUnknownDoesNotBlockName: a grant whose ack was lost and whose
// retries were cut off returns ErrUnknown. The create had landed, so the name
// is held by an entry nobody owns; once the connection is back, the acquirer
// must clean up its own entry (recognised by its nonce) instead of leaving the
// name blocked for the whole ttl.
func TestGrantUnknownDoesNotBlockName(t *testing.T) {
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 300 * time.Millisecond, RetryFor: 300 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	warm, err := a.TryAcquire(ctx, fencetest.Name("warm"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Release(ctx)
	name := fencetest.Name("unknowngrant")
	p.LoseReply(createTo(lockBucket.Bucket))
	p.Refuse(true)
	_, err = a.TryAcquire(ctx, name, time.Minute)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a grant cut off after its create: %v, want ErrUnknown", err)
	}
	p.Refuse(false)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	l, err := other.Acquire(wctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("the name after an unknown grant of a 1 minute ttl: %v, want it free once the first acquirer could clean up", err)
	}
	_ = l.Release(ctx)
}

// TestReleaseLostAckThenRegranted: the ack of a release is lost (the purge
// landed), and a waiter is granted the name before the releaser can look
// again. The release did land: reporting ErrLost ("it had already expired")
// is a definite wrong outcome; nil or ErrUnknown are honest.
func TestReleaseLostAckThenRegranted(t *testing.T) {
	a, p := proxiedAcquirer(t, nil)
	other := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	ctx := context.Background()
	name := fencetest.Name("lostrelease")
	l, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan fence.Lease, 1)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	go func() {
		l2, err := other.Acquire(wctx, name, 5*time.Second)
		if err != nil {
			t.Errorf("the waiter: %v", err)
		}
		got <- l2
	}()
	// The waiter watches the key before its first try, so it is woken by
	// the release whenever that lands.
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true) // the releaser stays cut off until the waiter is granted
	done := make(chan error, 1)
	go func() { done <- l.Release(ctx) }()
	waitLost(t, p, before)
	l2 := <-got
	p.Refuse(false)
	err = <-done
	if errors.Is(err, fence.ErrLost) {
		t.Fatalf("a release that landed, its ack lost, then the name granted to another: %v, want nil or ErrUnknown, not ErrLost", err)
	}
	if err != nil && !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("release: %v", err)
	}
	if l2 != nil {
		if l2.Token() <= l.Token() {
			t.Errorf("token %d not above %d", l2.Token(), l.Token())
		}
		_ = l2.Release(ctx)
	}
}

// TestWriterLostAckNotReplayed: the ack of a write with token 6 is lost (it
// landed), and a later write with the same token lands before the writer
// looks again. The writer must not publish its entry a second time over the
// later one (a step applied twice, undoing a later write): the key keeps the
// later value, and the first write reports nil or ErrUnknown.
func TestWriterLostAckNotReplayed(t *testing.T) {
	// The retry after the lost ack waits for the 5s attempt timeout, long
	// after the later write below.
	w, check, p, key, before := writerWithAckArmed(t, "replay")
	ctx := context.Background()
	done := make(chan error, 1)
	go func() { done <- w.Write(ctx, key, []byte("first"), 6) }()
	waitLost(t, p, before)
	if v, tok, err := check.Read(ctx, key); err != nil || string(v) != "first" || tok != 6 {
		t.Fatalf("the write whose ack was lost did not land: %q %d %v", v, tok, err)
	}
	if err := check.Write(ctx, key, []byte("later"), 6); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil && !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("the first write: %v, want nil or ErrUnknown", err)
	}
	if v, tok, err := check.Read(ctx, key); err != nil || string(v) != "later" || tok != 6 {
		t.Fatalf("Read = %q %d %v, want the later write (later 6): the first was applied twice", v, tok, err)
	}
}

// TestCancelledAcquireDoesNotBlockName: an Acquire cancelled while its
// create's ack is lost (the create landed, the reconnect refused) returns,
// and once the connection is back the name is free well before the ttl.
func TestCancelledAcquireDoesNotBlockName(t *testing.T) {
	a, p := proxiedAcquirer(t, &natsfence.AcquirerOptions{Timeout: 300 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	warm, err := a.TryAcquire(ctx, fencetest.Name("warm"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Release(ctx)
	name := fencetest.Name("cancelled")
	before := p.Stats().LostReplies
	p.LoseReply(createTo(lockBucket.Bucket))
	p.Refuse(true)
	actx, cancel := context.WithCancel(ctx)
	got := make(chan error, 1)
	go func() {
		l, err := a.Acquire(actx, name, time.Minute)
		if err == nil {
			_ = l.Release(ctx)
		}
		got <- err
	}()
	waitLost(t, p, before)
	cancel()
	if err := <-got; err == nil {
		t.Fatal("a cancelled Acquire returned a lease")
	}
	p.Refuse(false)
	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	l, err := other.Acquire(wctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("the name after a cancelled Acquire of a 1 minute ttl: %v", err)
	}
	_ = l.Release(ctx)
}

// TestWriterUnknownWriteDoesNotLandLater: as
// TestStoreUnknownStepDoesNotLandLater, for a fenced write: reported
// fence.ErrUnknown, read as not landed, it must not land after the
// reconnect (a caller that read the old value and reported the write failed
// would then be wrong).
func TestWriterUnknownWriteDoesNotLandLater(t *testing.T) {
	j, p := proxied(t)
	cfg := jetstream.KeyValueConfig{Bucket: "late_" + strings.TrimPrefix(idemBucket(t).Bucket, "idem_"), History: 1}
	bucket(t, j, cfg)
	w, err := natsfence.NewWriter(context.Background(), j, cfg.Bucket, &natsfence.WriterOptions{Timeout: 200 * time.Millisecond, RetryFor: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	other := newWriter(t, js(t), cfg)
	ctx := context.Background()
	k := fencetest.Name("late")
	if err := w.Write(ctx, k, []byte("v1"), 1); err != nil {
		t.Fatal(err)
	}
	p.Refuse(true)
	defer p.Refuse(false)
	p.DropRequest(publishTo(cfg.Bucket))
	if err := w.Write(ctx, k, []byte("v2"), 2); !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a write cut off from the server: %v, want fence.ErrUnknown", err)
	}
	if p.Pending() != 0 {
		t.Fatal("the first publish was not dropped")
	}
	if v, _, err := other.Read(ctx, k); err != nil || string(v) != "v1" {
		t.Fatalf("after the unknown write: %q, %v, want v1", v, err)
	}
	p.Refuse(false)
	for giveUp := time.Now().Add(10 * time.Second); !j.Conn().IsConnected(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(giveUp) {
			t.Fatal("the client did not reconnect")
		}
	}
	if _, _, err := w.Read(ctx, k); err != nil { // a round trip after the reconnect
		t.Fatal(err)
	}
	if v, _, err := other.Read(ctx, k); err != nil || string(v) != "v1" {
		t.Fatalf("after the reconnect: %q, %v, want still v1 (a write reported unknown and read as not landed must not land later)", v, err)
	}
}

// unavailableAfterStore is a JetStream context whose next publishes that
// match are sent to the real server and stored there, but answered with
// the server's 503 reply (the JetStream system temporarily unavailable): the
// reply a client can get for a proposal that a leader election applies
// after all.
type unavailableAfterStore struct {
	jetstream.JetStream
	match func(*nats.Msg) bool
	left  atomic.Int32 // publishes still to answer so
}

func (u *unavailableAfterStore) PublishMsg(ctx context.Context, m *nats.Msg, opts ...jetstream.PublishOpt) (*jetstream.PubAck, error) {
	ack, err := u.JetStream.PublishMsg(ctx, m, opts...)
	if err == nil && u.match(m) && u.left.Add(-1) >= 0 {
		return nil, fmt.Errorf("nats: %w", &jetstream.APIError{Code: 503, ErrorCode: 10008, Description: "JetStream system temporarily unavailable"})
	}
	return ack, err
}

// isCreate matches a grant's create: an entry with data and no grant
// revision (a renewal carries one, a marker has no data).
func isCreate(m *nats.Msg) bool {
	return len(m.Data) > 0 && m.Header.Get("Fencekit-Grant-Revision") == ""
}

// isRenewal matches a renewal: an entry carrying its grant's revision.
func isRenewal(m *nats.Msg) bool {
	return len(m.Data) > 0 && m.Header.Get("Fencekit-Grant-Revision") != ""
}

// TestCreateAnsweredUnavailableIsRecognised: a grant's create is stored but
// answered 503. The acquirer must count that reply as ambiguous, as a lost
// one: look again, find its own entry and grant the lease. Taken as a
// definite failure it returned a plain error and left its entry holding the
// name for the whole ttl, nobody's lease.
func TestCreateAnsweredUnavailableIsRecognised(t *testing.T) {
	ctx := context.Background()
	u := &unavailableAfterStore{JetStream: js(t), match: isCreate}
	u.left.Store(1)
	a := newAcquirer(t, u, lockBucket, nil)
	other := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("create503")
	const ttl = time.Minute
	l, err := a.TryAcquire(ctx, name, ttl)
	if u.left.Load() >= 1 {
		t.Fatal("no create was answered 503")
	}
	if err != nil {
		t.Fatalf("a grant whose create was stored but answered 503: %v, want the lease (its own entry found on a second look)", err)
	}
	if _, err := other.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("another acquirer while the lease holds: %v, want ErrHeld", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("release: %v", err)
	}
	lb, err := other.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("another acquirer after the release: %v, want a grant", err)
	}
	_ = lb.Release(ctx)
}

// TestRenewalAnsweredUnavailableCountsFromItsSend: a renewal is stored but
// answered 503. Renew must count that reply as ambiguous: look again, find
// its own entry and return nil, with the local deadline counted from that
// renewal's send (the server counts the entry's TTL from its landing). Taken
// as a definite failure it returned a plain error and recorded no unsure
// send, so a later renewal that found the entry counted its deadline from
// its own, later send: past the server's expiry, two holders.
func TestRenewalAnsweredUnavailableCountsFromItsSend(t *testing.T) {
	ctx := context.Background()
	u := &unavailableAfterStore{JetStream: js(t), match: isRenewal}
	a := newAcquirer(t, u, lockBucket, &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("renew503")
	const ttl = 10 * time.Second
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	u.left.Store(1)
	sent := time.Now()
	err = l.Renew(ctx)
	if u.left.Load() >= 1 {
		t.Fatal("no renewal was answered 503")
	}
	if err != nil && !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a renewal stored but answered 503: %v, want nil (its entry found on a second look) or ErrUnknown", err)
	}
	if err == nil {
		if d := l.(interface{ LocalDeadline() time.Time }).LocalDeadline(); d.After(sent.Add(ttl)) {
			t.Fatalf("local deadline %v after the renewal's send + ttl", d.Sub(sent))
		}
	}
	if err := l.Renew(ctx); err != nil {
		t.Fatalf("the next renewal: %v", err)
	}
	if _, err := other.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("another acquirer while the lease holds: %v, want ErrHeld", err)
	}
}

// TestStoreClaimAnsweredUnavailableIsRecognised: an idempotency claim is
// stored but answered 503. Begin must count that reply as ambiguous, as the
// writer does: look again and recognise its claim, not fail with the key
// left claimed by nobody until the lease runs out.
func TestStoreClaimAnsweredUnavailableIsRecognised(t *testing.T) {
	ctx := context.Background()
	u := &unavailableAfterStore{JetStream: js(t), match: func(*nats.Msg) bool { return true }}
	s := newStore(t, u, idemBucket(t))
	u.left.Store(1)
	rec, claimed, err := s.Begin(ctx, fencetest.Name("claim503"), "fp", "me", time.Minute)
	if u.left.Load() >= 1 {
		t.Fatal("no claim was answered 503")
	}
	if err != nil || !claimed || rec.State != idempotency.Claimed {
		t.Fatalf("a claim stored but answered 503: claimed %v, state %v, %v; want its claim recognised", claimed, rec.State, err)
	}
}
