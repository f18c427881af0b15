package natsfence_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

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
