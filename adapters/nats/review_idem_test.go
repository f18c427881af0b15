package natsfence_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/nats-io/nats.go/jetstream"
)

// TestStoreUnknownStepDoesNotLandLater (HAZARDS 3): the arm's first publish
// is dropped and the client cannot reconnect; the arm returns an error
// matching fence.ErrUnknown and a read on another client then shows the key
// still claimed. When the client reconnects later, nothing of that arm may
// land: the caller was told to read the record to know, the read said "not
// armed", and idempotency.Do has by then reported that the effect did not
// run. An arm landing after that leaves an armed key whose effect never ran
// (it ends unknown). The nats client keeps what is published while it
// reconnects and sends it after the reconnect, so the store must not publish
// while disconnected.
func TestStoreUnknownStepDoesNotLandLater(t *testing.T) {
	j, p := proxied(t)
	cfg := idemBucket(t)
	s2 := newStore(t, js(t), cfg)
	s := newStoreOpts(t, j, cfg, &natsfence.StoreOptions{Timeout: 200 * time.Millisecond, RetryFor: time.Second})
	ctx := context.Background()
	k := fencetest.Name("late")
	rec, _, err := s.Begin(ctx, k, "fp", "me", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	p.Refuse(true)
	defer p.Refuse(false)
	p.DropRequest(publishTo(cfg.Bucket))
	_, err = s.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("an arm cut off from the server: %v, want fence.ErrUnknown", err)
	}
	if p.Pending() != 0 {
		t.Fatal("the first publish was not dropped")
	}
	got, err := s2.Get(ctx, k)
	if err != nil || got.State != idempotency.Claimed {
		t.Fatalf("after the unknown arm: %+v, %v, want claimed", got, err)
	}
	// The client reconnects; whatever it kept is sent now.
	p.Refuse(false)
	reconnected := time.Now().Add(10 * time.Second)
	for !j.Conn().IsConnected() {
		if time.Now().After(reconnected) {
			t.Fatal("the client did not reconnect")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := j.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, k); err != nil { // a round trip after the flush
		t.Fatal(err)
	}
	got, err = s2.Get(ctx, k)
	if err != nil || got.State != idempotency.Claimed {
		t.Fatalf("after the reconnect: %+v, %v, want still claimed (an arm reported unknown and read as not landed must not land later)", got, err)
	}
}

// TestStoreDoCutOffOwner (HAZARDS 2 and 6): the owner's client is cut off
// from the server (a partition) while its effect runs. Its effect's context
// must end before another Do, on a client of its own, starts the effect
// again, and that Do must not wait much beyond the owner's lease.
func TestStoreDoCutOffOwner(t *testing.T) {
	j, p := proxied(t)
	cfg := idemBucket(t)
	other := newStore(t, js(t), cfg)
	s := newStoreOpts(t, j, cfg, &natsfence.StoreOptions{Timeout: 300 * time.Millisecond})
	const lease = 2 * time.Second
	k := fencetest.Name("cutowner")
	started := make(chan struct{})
	var ended time.Time
	ownerDone := make(chan error, 1)
	go func() {
		_, err := idempotency.Do(context.Background(), s, k, "fp", func(ctx context.Context, _ string) ([]byte, error) {
			close(started)
			<-ctx.Done()
			ended = time.Now()
			return nil, ctx.Err()
		}, &idempotency.Options{Lease: lease})
		ownerDone <- err
	}()
	<-started
	p.Partition()
	defer p.Heal()
	cut := time.Now()
	var second time.Time
	ctx, cancel := context.WithTimeout(context.Background(), 10*lease)
	defer cancel()
	res, err := idempotency.Do(ctx, other, k, "fp", func(context.Context, string) ([]byte, error) {
		second = time.Now()
		return []byte("second"), nil
	}, &idempotency.Options{Lease: lease, Wait: true, Reconcile: func(context.Context, string) (bool, []byte, error) { return false, nil, nil }})
	if err != nil || string(res.Value) != "second" {
		t.Fatalf("the second Do: %+v, %v", res, err)
	}
	select {
	case err := <-ownerDone:
		t.Logf("the owner's Do: %v", err)
	case <-time.After(10 * lease):
		t.Fatal("the owner's Do did not return")
	}
	if ended.IsZero() || !ended.Before(second) {
		t.Fatalf("the owner's effect context ended at %v, the second effect started at %v: they overlapped", ended, second)
	}
	if wait := second.Sub(cut); wait > lease+2*time.Second {
		t.Fatalf("the second effect started %v after the owner was cut off, with a lease of %v", wait, lease)
	}
	t.Logf("owner's effect cancelled %v after the cut, second effect %v after it", ended.Sub(cut), second.Sub(cut))
}

// TestStoreKeysByteForByte (HAZARDS 4): keys that differ only in case, a
// dot against its escape, a trailing space, wildcards, a 4-byte character or
// its bytes split, and the longest key of bytes that each escape to three,
// each get a record of their own through Do, and each replays its own result.
func TestStoreKeysByteForByte(t *testing.T) {
	s := newStore(t, js(t), idemBucket(t))
	ctx := context.Background()
	long := strings.Repeat(".", natsfence.MaxKeyBytes)
	keys := []string{"a.b", "a=2Eb", "A.b", "a.b ", "a b", "*", ">", "a.*", "a.>", "😀", "\xf0\x9f\x98", "\xf0\x9f\x98\x80 ", "=", "=3D", long, long[1:] + "a"}
	for _, k := range keys {
		r, err := idempotency.Do(ctx, s, k, "fp", func(context.Context, string) ([]byte, error) { return []byte(k), nil }, nil)
		if err != nil || r.Replayed || string(r.Value) != k {
			t.Fatalf("Do(%q): %+v, %v, want its own first run", k, r, err)
		}
	}
	for _, k := range keys {
		r, err := idempotency.Do(ctx, s, k, "fp", func(context.Context, string) ([]byte, error) {
			t.Errorf("Do(%q) ran again", k)
			return nil, nil
		}, nil)
		if err != nil || !r.Replayed || string(r.Value) != k {
			t.Errorf("Do(%q) again: %+v, %v, want its own result replayed", k, r, err)
		}
	}
}

// TestStorePurgeSkipsForeignEntries (HAZARDS 4): an entry the store did not
// write (an operator's kv put, or a lock of an Acquirer on the same bucket)
// is left alone by Purge, which still removes the released records around it
// instead of failing on it, now and at every later Purge.
func TestStorePurgeSkipsForeignEntries(t *testing.T) {
	j := js(t)
	cfg := idemBucket(t)
	s := newStore(t, j, cfg)
	kv := bucket(t, j, cfg)
	ctx := context.Background()
	for _, k := range []string{"a", "z"} {
		rec, _, err := s.Begin(ctx, k, "fp", "me", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Released, Fence: rec.Fence, Owner: "me"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := kv.Put(ctx, "m", []byte("an operator's value")); err != nil {
		t.Fatal(err)
	}
	n, err := s.Purge(ctx)
	if err != nil || n != 2 {
		t.Fatalf("Purge = %d, %v, want the 2 released records removed", n, err)
	}
	if e, err := kv.Get(ctx, "m"); err != nil || string(e.Value()) != "an operator's value" {
		t.Fatalf("the foreign entry: %v, %v", e, err)
	}
}

// TestWriterUnknownWriteDoesNotLandLater (HAZARDS 3): as
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

// TestTimeoutTooShortRefused (HAZARDS 8): a Timeout no request can meet (2,
// meant as seconds, is 2ns) is refused at construction with fence.ErrInvalid
// naming Timeout, instead of making every step fail at use after RetryFor.
func TestTimeoutTooShortRefused(t *testing.T) {
	j := js(t)
	cfg := idemBucket(t)
	bucket(t, j, cfg)
	ctx := context.Background()
	if s, err := natsfence.NewStore(ctx, j, cfg.Bucket, &natsfence.StoreOptions{Timeout: 2, RetryFor: 200 * time.Millisecond}); err == nil {
		_, _, berr := s.Begin(ctx, fencetest.Name("k"), "fp", "me", time.Minute)
		t.Errorf("NewStore with Timeout 2ns accepted; a Begin then: %v", berr)
	} else if ie := (*fence.InvalidError)(nil); !errors.As(err, &ie) || ie.Arg != "Timeout" {
		t.Errorf("NewStore with Timeout 2ns: %v, want fence.ErrInvalid naming Timeout", err)
	}
	if _, err := natsfence.NewWriter(ctx, j, cfg.Bucket, &natsfence.WriterOptions{Timeout: 2}); err == nil {
		t.Error("NewWriter with Timeout 2ns accepted")
	}
	if _, err := natsfence.NewStore(ctx, j, cfg.Bucket, &natsfence.StoreOptions{Timeout: natsfence.MinTimeout}); err != nil {
		t.Errorf("NewStore with Timeout MinTimeout: %v", err)
	}
}

// TestDiscardOldBucketRefused (HAZARDS 1): a bucket whose stream drops its
// oldest messages when it reaches a message or byte limit (discard old, as
// an operator can set with nats stream edit) removes records, fences and
// leases as a TTL does: a completed key's record goes, and its effect runs
// again. NewStore, NewWriter and New refuse such a bucket as they refuse a
// TTL.
func TestDiscardOldBucketRefused(t *testing.T) {
	j := js(t)
	ctx := context.Background()
	name := "discard_" + strings.TrimPrefix(idemBucket(t).Bucket, "idem_")
	if _, err := j.CreateStream(ctx, jetstream.StreamConfig{
		Name: "KV_" + name, Subjects: []string{"$KV." + name + ".>"}, MaxMsgsPerSubject: 1,
		AllowRollup: true, DenyDelete: true, AllowDirect: true, Discard: jetstream.DiscardOld, MaxMsgs: 2,
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = j.DeleteStream(context.Background(), "KV_"+name) })
	s, err := natsfence.NewStore(ctx, j, name, nil)
	if err == nil {
		// What it would do: the third key's record pushes the first out.
		runs := 0
		for _, k := range []string{"a", "b", "c", "a"} {
			if _, err := idempotency.Do(ctx, s, k, "fp", func(context.Context, string) ([]byte, error) {
				if k == "a" {
					runs++
				}
				return nil, nil
			}, &idempotency.Options{Retention: idempotency.Forever}); err != nil {
				t.Fatal(err)
			}
		}
		t.Errorf("NewStore accepted a discard-old bucket with MaxMsgs 2; key a's effect then ran %d times", runs)
	} else if ie := (*fence.InvalidError)(nil); !errors.As(err, &ie) || ie.Arg != "bucket" {
		t.Errorf("NewStore: %v, want fence.ErrInvalid naming the bucket", err)
	}
	if _, err := natsfence.NewWriter(ctx, j, name, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("NewWriter: %v, want fence.ErrInvalid", err)
	}
	if _, err := natsfence.New(ctx, j, name, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("New: %v, want fence.ErrInvalid", err)
	}
}
