package natsfence_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
	"github.com/nats-io/nats.go/jetstream"
)

// idemBucket is the bucket of t's store: one per test, so Purge lists few
// keys, and the same for New and Faulty within a test.
func idemBucket(t testing.TB) jetstream.KeyValueConfig {
	h := sha256.Sum256([]byte(t.Name()))
	return natsfence.LockBucket("idem_" + hex.EncodeToString(h[:8]))
}

func newStore(t testing.TB, j jetstream.JetStream, cfg jetstream.KeyValueConfig) *natsfence.IdempotencyStore {
	t.Helper()
	return newStoreOpts(t, j, cfg, nil)
}

// faultyOpts is for stores behind a proxy: a request on a connection the
// proxy cut waits for its Timeout, so the cases with many cuts use a short one.
var faultyOpts = &natsfence.IdempotencyOptions{Timeout: 500 * time.Millisecond}

func newStoreOpts(t testing.TB, j jetstream.JetStream, cfg jetstream.KeyValueConfig, o *natsfence.IdempotencyOptions) *natsfence.IdempotencyStore {
	t.Helper()
	bucket(t, j, cfg)
	s, err := natsfence.NewIdempotencyStore(context.Background(), j, cfg.Bucket, o)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestStoreConformance(t *testing.T) {
	idempotencytest.Suite{
		New:     func(t *testing.T) idempotency.Store { return newStore(t, js(t), idemBucket(t)) },
		BadKeys: []string{strings.Repeat("k", natsfence.MaxKeyBytes+1)},
		Faulty: func(t *testing.T) (idempotency.Store, *faultnet.Proxy) {
			j, p := proxied(t)
			return newStoreOpts(t, j, idemBucket(t), faultyOpts), p
		},
	}.Run(t)
}

// TestStoreWithoutMarkers: on a bucket without limit markers (a plain KV
// bucket) the store works too; Purge's markers then stay.
func TestStoreWithoutMarkers(t *testing.T) {
	cfg := jetstream.KeyValueConfig{Bucket: "idem_plain", History: 1}
	s := newStore(t, js(t), cfg)
	ctx := context.Background()
	k := fencetest.Name("plain")
	r, err := idempotency.Do(ctx, s, k, "fp", func(context.Context, string) ([]byte, error) { return []byte("v"), nil },
		&idempotency.Options{Retention: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond)
	if n, err := s.Purge(ctx); err != nil || n < 1 {
		t.Fatalf("Purge: %d, %v, want the record removed", n, err)
	}
	if _, err := s.Get(ctx, k); !errors.Is(err, fence.ErrNotFound) {
		t.Fatalf("Get after Purge: %v", err)
	}
	rec, created, err := s.Begin(ctx, k, "fp", "me", time.Minute)
	if err != nil || !created || rec.Fence <= r.Fence {
		t.Fatalf("claim after Purge: %+v, created %v, %v, want a fence above %d", rec, created, err, r.Fence)
	}
}

// TestStoreFenceAfterStateDeleted: a key's record removed by
// hand (kv del, kv purge) or with its whole bucket (deleted and made again,
// which restarts the stream's revisions at 1) is claimed again above every
// fence it had, including fences raised by takeovers.
func TestStoreFenceAfterStateDeleted(t *testing.T) {
	ctx := context.Background()
	j := js(t)
	cfg := natsfence.LockBucket("idem_deleted")
	for _, how := range []string{"kv del", "kv purge", "bucket re-created"} {
		s := newStore(t, j, cfg)
		k := fencetest.Name("deleted")
		a, _, err := s.Begin(ctx, k, "fp", "A", time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		// Ten takeovers raise the fence by ten, each one message.
		f := a.Fence
		for i := range 10 {
			if _, err := s.Update(ctx, k, idempotency.Claimed, f, idempotency.Change{State: idempotency.Claimed, Fence: f + 1, Owner: "B", Lease: time.Minute}); err != nil {
				t.Fatalf("takeover %d: %v", i, err)
			}
			f++
		}
		kv, err := j.KeyValue(ctx, cfg.Bucket)
		if err != nil {
			t.Fatal(err)
		}
		switch how {
		case "kv del":
			err = kv.Delete(ctx, natsfence.EncodeKey(k))
		case "kv purge":
			err = kv.Purge(ctx, natsfence.EncodeKey(k))
		default:
			if err = j.DeleteKeyValue(ctx, cfg.Bucket); err == nil {
				_, err = j.CreateKeyValue(ctx, cfg)
			}
		}
		if err != nil {
			t.Fatalf("%s: %v", how, err)
		}
		if _, err := s.Get(ctx, k); !errors.Is(err, fence.ErrNotFound) {
			t.Fatalf("after %s the record is still there: %v", how, err)
		}
		c, created, err := s.Begin(ctx, k, "fp", "C", time.Minute)
		if err != nil || !created {
			t.Fatalf("claim after %s: created %v, %v", how, created, err)
		}
		if c.Fence <= f {
			t.Fatalf("after %s the key restarted at fence %d, not above %d", how, c.Fence, f)
		}
		// The old owner's change is refused.
		if _, err := s.Update(ctx, k, idempotency.Claimed, f, idempotency.Change{State: idempotency.Released, Fence: f, Owner: "B"}); !errors.Is(err, fence.ErrStale) {
			t.Fatalf("the old owner's release after %s: %v, want ErrStale", how, err)
		}
	}
}

// TestStoreLostPublishAck: the suite loses the reply of a step's
// first request (a read). Here the JetStream ack of the step's publish is
// lost after the server stored it: Begin and every Update recognise their
// write and return it, and the record holds it once.
func TestStoreLostPublishAck(t *testing.T) {
	j, p := proxied(t)
	cfg := idemBucket(t)
	s := newStoreOpts(t, j, cfg, faultyOpts)
	direct := newStore(t, js(t), cfg)
	ctx := context.Background()
	k := fencetest.Name("lostack")
	lose := func() int64 {
		before := p.Stats().LostReplies
		p.LoseReply(publishTo(cfg.Bucket))
		return before
	}
	before := lose()
	rec, created, err := s.Begin(ctx, k, "fp", "me", time.Minute)
	waitLost(t, p, before)
	if err != nil || !created || rec.Owner != "me" || rec.Fence == 0 {
		t.Fatalf("Begin whose ack was lost: %+v, created %v, %v, want its claim recognised", rec, created, err)
	}
	if got, err := direct.Get(ctx, k); err != nil || got.Fence != rec.Fence || got.State != idempotency.Claimed {
		t.Fatalf("record after Begin: %+v, %v", got, err)
	}
	f := rec.Fence
	steps := []struct {
		from idempotency.State
		ch   idempotency.Change
	}{
		{idempotency.Claimed, idempotency.Change{State: idempotency.Armed, Fence: f, Owner: "me", Lease: time.Minute}},
		{idempotency.Armed, idempotency.Change{State: idempotency.Claimed, Fence: f + 1, Owner: "B", Lease: time.Minute, Restart: true}},
		{idempotency.Claimed, idempotency.Change{State: idempotency.Completed, Fence: f + 1, Owner: "B", Result: []byte("done"), Retention: time.Hour}},
	}
	for _, st := range steps {
		before := lose()
		got, err := s.Update(ctx, k, st.from, st.ch.Fence-boolTok(st.ch.Restart), st.ch)
		waitLost(t, p, before)
		if err != nil || got.State != st.ch.State || got.Fence != st.ch.Fence {
			t.Fatalf("%s -> %s whose ack was lost: %+v, %v, want it recognised", st.from, st.ch.State, got, err)
		}
	}
	got, err := direct.Get(ctx, k)
	if err != nil || got.State != idempotency.Completed || string(got.Result) != "done" || got.Fence != f+1 || got.Owner != "B" {
		t.Fatalf("record after the lost acks: %+v, %v", got, err)
	}
}

func boolTok(b bool) fence.Token {
	if b {
		return 1
	}
	return 0
}

// TestStoreUnknownWhenCutOff: a step sent while the server
// cannot be reached returns an error matching fence.ErrUnknown after
// RetryFor, not a hang, and not a definite answer.
func TestStoreUnknownWhenCutOff(t *testing.T) {
	j, p := proxied(t)
	cfg := idemBucket(t)
	bucket(t, js(t), cfg)
	s, err := natsfence.NewIdempotencyStore(context.Background(), j, cfg.Bucket, &natsfence.IdempotencyOptions{Timeout: 200 * time.Millisecond, RetryFor: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	k := fencetest.Name("cut")
	rec, _, err := s.Begin(ctx, k, "fp", "me", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	// The arm's publish lands, its ack is lost, and the reconnect is refused.
	p.LoseReply(publishTo(cfg.Bucket))
	p.Refuse(true)
	defer p.Refuse(false)
	begun := time.Now()
	_, err = s.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
	took := time.Since(begun)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("an arm whose ack was lost, the server then unreachable: %v, want fence.ErrUnknown", err)
	}
	if took > 10*time.Second {
		t.Fatalf("the arm took %v with RetryFor 1s", took)
	}
	p.Refuse(false)
	got, err := newStore(t, js(t), cfg).Get(ctx, k)
	if err != nil || got.State != idempotency.Armed {
		t.Fatalf("record: %+v, %v, want armed (the publish landed)", got, err)
	}
}

// TestNewStoreRefuses: bad options and buckets are refused at
// construction with fence.ErrInvalid naming them.
func TestNewStoreRefuses(t *testing.T) {
	j := js(t)
	ctx := context.Background()
	bucket(t, j, jetstream.KeyValueConfig{Bucket: "idem_ttl", TTL: time.Hour})
	bucket(t, j, jetstream.KeyValueConfig{Bucket: "idem_ok"})
	for _, c := range []struct {
		what   string
		js     jetstream.JetStream
		bucket string
		o      *natsfence.IdempotencyOptions
		arg    string
	}{
		{"nil js", nil, "idem_ok", nil, "js"},
		{"empty bucket", j, "", nil, "bucket"},
		{"a bucket with a TTL", j, "idem_ttl", nil, "bucket"},
		{"negative Timeout", j, "idem_ok", &natsfence.IdempotencyOptions{Timeout: -1}, "Timeout"},
		{"negative RetryFor", j, "idem_ok", &natsfence.IdempotencyOptions{RetryFor: -1}, "RetryFor"},
	} {
		_, err := natsfence.NewIdempotencyStore(ctx, c.js, c.bucket, c.o)
		var ie *fence.InvalidError
		if !errors.As(err, &ie) || ie.Arg != c.arg {
			t.Errorf("%s: %v, want ErrInvalid naming %s", c.what, err, c.arg)
		}
	}
	if _, err := natsfence.NewIdempotencyStore(ctx, j, "idem_missing", nil); !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Errorf("a missing bucket: %v", err)
	}
}

// TestStoreUnknownStepDoesNotLandLater: the arm's first publish
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
	s := newStoreOpts(t, j, cfg, &natsfence.IdempotencyOptions{Timeout: 200 * time.Millisecond, RetryFor: time.Second})
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

// TestStoreDoCutOffOwner: the owner's client is cut off
// from the server (a partition) while its effect runs. Its effect's context
// must end before another Do, on a client of its own, starts the effect
// again, and that Do must not wait much beyond the owner's lease.
func TestStoreDoCutOffOwner(t *testing.T) {
	j, p := proxied(t)
	cfg := idemBucket(t)
	other := newStore(t, js(t), cfg)
	s := newStoreOpts(t, j, cfg, &natsfence.IdempotencyOptions{Timeout: 300 * time.Millisecond})
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

// TestStoreKeysByteForByte: keys that differ only in case, a
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

// TestStorePurgeSkipsForeignEntries: an entry the store did not
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

// releasedAndPurged claims k on s as "first", releases the claim and purges
// it, leaving a purge marker on the key; it returns the claim's fence.
func releasedAndPurged(ctx context.Context, t *testing.T, s *natsfence.IdempotencyStore, k string) fence.Token {
	t.Helper()
	rec, created, err := s.Begin(ctx, k, "fp", "first", time.Minute)
	if err != nil || !created {
		t.Fatalf("first claim: %+v %v %v", rec, created, err)
	}
	if _, err := s.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Released, Fence: rec.Fence, Owner: "first"}); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Purge(ctx); err != nil || n != 1 {
		t.Fatalf("purge: %d, %v", n, err)
	}
	return rec.Fence
}

// TestBeginDroppedClaimResentAfterPurgeMarkerAgedOut: a released record is
// removed by Purge, which leaves a marker on the key that ages out after
// the bucket's LimitMarkerTTL. A Begin of that key reads the marker and
// sends its claim expecting the marker's revision; the claim never reaches
// the server (the connection is cut with it), and the client is kept away
// until the marker has aged out. Nothing landed, and nothing can land any
// more (the claim expected a revision the key no longer has): the key holds
// no record before and after, as when the claim was sent. Begin must resend
// the claim and return it, or at least not report a definite non-event as
// an unknown outcome.
func TestBeginDroppedClaimResentAfterPurgeMarkerAgedOut(t *testing.T) {
	ctx := context.Background()
	j, p := proxied(t)
	cfg := idemBucket(t)
	s := newStoreOpts(t, j, cfg, &natsfence.IdempotencyOptions{Timeout: 500 * time.Millisecond})
	direct := newStore(t, js(t), cfg)
	k := fencetest.Name("purged-then-claimed")
	releasedAndPurged(ctx, t, direct, k)
	// The claim is dropped on its way and the client kept away past the
	// marker's life (LimitMarkerTTL, 1s).
	p.DropRequest(publishTo(cfg.Bucket))
	p.Refuse(true)
	go func() {
		for p.Pending() != 0 {
			time.Sleep(time.Millisecond)
		}
		time.Sleep(cfg.LimitMarkerTTL + time.Second) // the marker's life is the case
		p.Refuse(false)
	}()
	start := time.Now()
	rec, created, err := s.Begin(ctx, k, "fp", "second", time.Minute)
	t.Logf("Begin after %v: %+v created %v: %v", time.Since(start).Round(time.Millisecond), rec, created, err)
	got, gerr := direct.Get(ctx, k)
	if err != nil {
		if errors.Is(gerr, fence.ErrNotFound) && errors.Is(err, fence.ErrUnknown) {
			t.Fatalf("Begin reported an unknown outcome (%v) for a claim that never reached the server: the key holds no record, as when the claim was sent, and the claim can no longer land; it was not resent", err)
		}
		t.Fatalf("Begin: %v (record now: %+v, %v)", err, got, gerr)
	}
	if !created || gerr != nil || got.Owner != "second" || got.Fence != rec.Fence {
		t.Fatalf("Begin returned %+v created %v; the record is %+v, %v", rec, created, got, gerr)
	}
}

// TestBeginDroppedClaimResentOverNewerMarker: as in
// TestBeginDroppedClaimResentAfterPurgeMarkerAgedOut, but while the client
// is kept away the key's purge marker is replaced by another (a kv purge of
// the key). The key still holds no record, and the dropped claim, which
// expects the first marker's revision, can no longer land: Begin sends its
// claim again, expecting the new marker, and returns it.
func TestBeginDroppedClaimResentOverNewerMarker(t *testing.T) {
	ctx := context.Background()
	j, p := proxied(t)
	cfg := idemBucket(t)
	s := newStoreOpts(t, j, cfg, &natsfence.IdempotencyOptions{Timeout: 500 * time.Millisecond})
	kv := bucket(t, js(t), cfg)
	direct := newStore(t, js(t), cfg)
	k := fencetest.Name("purged-twice-then-claimed")
	first := releasedAndPurged(ctx, t, direct, k)
	p.DropRequest(publishTo(cfg.Bucket))
	p.Refuse(true)
	replaced := make(chan error, 1)
	go func() {
		for p.Pending() != 0 {
			time.Sleep(time.Millisecond) // polling the proxy's fault
		}
		// The claim was dropped: replace the marker it expects.
		replaced <- kv.Purge(ctx, natsfence.EncodeKey(k))
		p.Refuse(false)
	}()
	rec, created, err := s.Begin(ctx, k, "fp", "second", time.Minute)
	if perr := <-replaced; perr != nil {
		t.Fatalf("the marker's replacement: %v", perr)
	}
	got, gerr := direct.Get(ctx, k)
	if err != nil {
		t.Fatalf("Begin after its claim was dropped and the key's marker replaced: %v (record now: %+v, %v)", err, got, gerr)
	}
	if !created || gerr != nil || got.Owner != "second" || got.Fence != rec.Fence {
		t.Fatalf("Begin returned %+v created %v; the record is %+v, %v", rec, created, got, gerr)
	}
	if rec.Fence <= first {
		t.Fatalf("the new claim's fence %d is not above the purged record's %d", rec.Fence, first)
	}
}
