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
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/nats-io/nats.go/jetstream"
)

var lockBucket = natsfence.LockBucket("locks")

func newAcquirer(t testing.TB, j jetstream.JetStream, cfg jetstream.KeyValueConfig, opts *natsfence.AcquirerOptions) *natsfence.Acquirer {
	t.Helper()
	bucket(t, j, cfg)
	a, err := natsfence.NewAcquirer(context.Background(), j, cfg.Bucket, opts)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func TestAcquirerConformance(t *testing.T) {
	shared := newAcquirer(t, js(t), lockBucket, nil)
	// The token counter is the bucket's (its stream sequence): the
	// TokensExhausted case, which brings it near fence.MaxToken, gets a
	// bucket of its own.
	exhausting := func(t *testing.T) bool { return strings.HasSuffix(t.Name(), "/TokensExhausted") }
	fencetest.AcquirerSuite{Parallel: true,
		New: func(t *testing.T) fence.Acquirer {
			if exhausting(t) {
				return newAcquirer(t, js(t), exhaustBucket, nil)
			}
			return shared
		},
		// Another process: an acquirer on a client of its own.
		NewOther: func(t *testing.T) fence.Acquirer {
			if exhausting(t) {
				return newAcquirer(t, js(t), exhaustBucket, nil)
			}
			return newAcquirer(t, js(t), lockBucket, nil)
		},
		SetCounter: func(t *testing.T, _ string, tok fence.Token) { setCounter(t, js(t), tok) },
		Faulty: func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
			j, p := proxied(t)
			return newAcquirer(t, j, lockBucket, nil), p
		},
		// The server counts key TTLs in whole seconds, at least one.
		ShortTTL: natsfence.MinTTL,
		// The server expires a key on a timer of its own and then writes
		// its marker through the stream's queue: on a loaded machine (-race,
		// 8 packages at once) a name was still held 1.38s past a 2s lease's local
		// deadline, where 40ms is usual.
		ExpiryLag: 2 * time.Second,
		MaxTTL:    natsfence.MaxTTL,
		BadNames:  []string{strings.Repeat("n", natsfence.MaxKeyBytes+1)},
		// Every message of the name's key purged, as nats kv purge would; the
		// token's revision is the bucket stream's sequence, which a purge
		// does not set back (TestTokensAfterBucketRecreated deletes the bucket).
		DeleteState: func(t *testing.T, name string) {
			kv, err := js(t).KeyValue(context.Background(), lockBucket.Bucket)
			if err == nil {
				err = kv.Purge(context.Background(), natsfence.EncodeKey(name))
			}
			if err != nil {
				t.Fatalf("purging the key of %q: %v", name, err)
			}
		},
	}.Run(t)
}

// TestAcquirerRefusesBucket: a bucket without limit markers, or with a TTL,
// is refused at construction, naming the bucket; so is a negative option.
func TestAcquirerRefusesBucket(t *testing.T) {
	j := js(t)
	for _, cfg := range []jetstream.KeyValueConfig{
		{Bucket: "locks-nomarkers"},
		{Bucket: "locks-ttl", LimitMarkerTTL: time.Second, TTL: time.Hour},
	} {
		bucket(t, j, cfg)
		_, err := natsfence.NewAcquirer(context.Background(), j, cfg.Bucket, nil)
		var ie *fence.InvalidError
		if !errors.As(err, &ie) || ie.Arg != "bucket" {
			t.Errorf("bucket %s: %v, want ErrInvalid naming the bucket", cfg.Bucket, err)
		}
	}
	bucket(t, j, lockBucket)
	for _, o := range []natsfence.AcquirerOptions{{Drift: -1}, {MaxWait: -1}, {Timeout: -1}, {RetryFor: -1}, {Recheck: -1}} {
		if _, err := natsfence.NewAcquirer(context.Background(), j, lockBucket.Bucket, &o); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("options %+v: %v", o, err)
		}
	}
	a := newAcquirer(t, j, lockBucket, nil)
	if _, err := a.TryAcquire(context.Background(), "n", 999*time.Millisecond); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("ttl under a second: %v", err)
	}
}

// TestTokensAfterBucketRecreated: deleting the lock bucket and
// making it again restarts the stream's sequence at 1; the next grant's token
// is still larger than every token of the old bucket.
func TestTokensAfterBucketRecreated(t *testing.T) {
	j := js(t)
	cfg := natsfence.LockBucket("locks-recreated")
	a := newAcquirer(t, j, cfg, nil)
	ctx := context.Background()
	var last fence.Token
	for i := 0; i < 50; i++ { // move the old stream's sequence on
		l, err := a.TryAcquire(ctx, "job", 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		last = l.Token()
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := j.DeleteKeyValue(ctx, cfg.Bucket); err != nil {
		t.Fatal(err)
	}
	b := newAcquirer(t, j, cfg, nil)
	l, err := b.TryAcquire(ctx, "job", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	if l.Token() <= last {
		t.Fatalf("after the bucket was re-created: token %d, not above the old bucket's %d", l.Token(), last)
	}
	// The acquirer made before the re-creation reads the new creation time too.
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l2, err := a.TryAcquire(ctx, "job", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release(ctx)
	if l2.Token() <= l.Token() {
		t.Fatalf("the old acquirer after the re-creation: token %d, not above %d", l2.Token(), l.Token())
	}
}

// TestWaiterWokenByExpiry: a waiter is granted soon after the holder's key
// expires on the server (the expiry marker wakes it), well before Recheck.
func TestWaiterWokenByExpiry(t *testing.T) {
	j := js(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	ctx := context.Background()
	name := fencetest.Name("expiry")
	h, err := a.TryAcquire(ctx, name, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	l, err := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute}).Acquire(wctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("a waiter after the holder's key expired (Recheck 1m): %v", err)
	}
	defer l.Release(ctx)
	if h.Context().Err() == nil {
		t.Error("granted while the expired holder's context was live")
	}
	if l.Token() <= h.Token() {
		t.Errorf("token %d not above %d", l.Token(), h.Token())
	}
}

// TestFractionalTTLRoundedUp: the server counts a key's TTL in whole seconds
// and truncates a fraction; a 1.5s lease must not expire on the server at 1s
// while its holder's context is live. Another acquirer tries all along.
func TestFractionalTTLRoundedUp(t *testing.T) {
	a := newAcquirer(t, js(t), lockBucket, nil)
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	name := fencetest.Name("fraction")
	h, err := a.TryAcquire(ctx, name, 1500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	giveUp := time.Now().Add(10 * time.Second)
	for {
		l, err := other.TryAcquire(ctx, name, 5*time.Second)
		if err == nil {
			if h.Context().Err() == nil {
				t.Fatal("granted to another acquirer while the 1.5s holder's context was live")
			}
			_ = l.Release(ctx)
			return
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatal(err)
		}
		if time.Now().After(giveUp) {
			t.Fatal("the 1.5s lease never expired")
		}
		time.Sleep(20 * time.Millisecond) // pacing of the tries
	}
}

// exhaustBucket is the bucket of TestAcquirerTokensExhausted: setCounter
// purges it whole.
var exhaustBucket = natsfence.LockBucket("locks_exhausted")

// setCounter makes the next grant of a new name in exhaustBucket carry tok+1:
// a stream purge up to a sequence beyond the last moves the stream's next
// sequence there (it removes every entry: only for this test's own bucket).
// Such a grant writes a marker first (a key without one), which takes the
// sequence before its create's.
func setCounter(t *testing.T, j jetstream.JetStream, tok fence.Token) {
	t.Helper()
	ctx := context.Background()
	st, err := j.Stream(ctx, "KV_"+exhaustBucket.Bucket)
	if err != nil {
		t.Fatal(err)
	}
	created := uint64(st.CachedInfo().Created.UnixMicro())
	if err := st.Purge(ctx, jetstream.WithPurgeSequence(uint64(tok)-created)); err != nil {
		t.Fatalf("purge to sequence %d: %v", uint64(tok)-created, err)
	}
}

// TestLongestNameWaits: a name of MaxKeyBytes bytes that each escape to three
// (the longest KV key), on a bucket with a long name, is granted, waited for
// (the watch's consumer has the key in its subject) and written.
func TestLongestNameWaits(t *testing.T) {
	j := js(t)
	bname := strings.Repeat("b", 200)
	cfg := natsfence.LockBucket(bname)
	a := newAcquirer(t, j, cfg, nil)
	other := newAcquirer(t, js(t), cfg, nil)
	ctx := context.Background()
	name := strings.Repeat("\xff", natsfence.MaxKeyBytes)
	l, err := a.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		l2, err := other.Acquire(wctx, name, 5*time.Second)
		if err == nil {
			err = l2.Release(ctx)
		}
		got <- err
	}()
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("the waiter on the longest name: %v", err)
	}
	wcfg := jetstream.KeyValueConfig{Bucket: strings.Repeat("w", 200)}
	bucket(t, j, wcfg)
	w, err := natsfence.NewWriter(ctx, j, wcfg.Bucket, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, name, []byte("v"), 1); err != nil {
		t.Fatalf("write on the longest key: %v", err)
	}
	if v, tok, err := w.Read(ctx, name); err != nil || string(v) != "v" || tok != 1 {
		t.Fatalf("Read = %q %d %v", v, tok, err)
	}
}

// TestInspect: a free name, a held one (also after renewals, which write new
// revisions: the token shown stays the grant's), and one released; the
// counter is at least every token granted and below the next grant's.
func TestInspect(t *testing.T) {
	a := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Owner: "inspector"})
	ctx := context.Background()
	name := fencetest.Name("inspect")
	info, err := a.Inspect(ctx, name)
	if err != nil || info.Held || info.Token != 0 {
		t.Fatalf("a free name: %+v, %v", info, err)
	}
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := l.Renew(ctx); err != nil {
			t.Fatalf("renew %d: %v", i, err)
		}
	}
	info, err = a.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != l.Token() || info.Owner != "inspector" || info.TimeLeft <= 0 || info.TimeLeft > 10*time.Second {
		t.Fatalf("held after 3 renewals: %+v, %v, want token %d, owner inspector, up to 10s left", info, err, l.Token())
	}
	if info.Counter < l.Token() {
		t.Fatalf("counter %d below the granted token %d", info.Counter, l.Token())
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	info, err = a.Inspect(ctx, name)
	if err != nil || info.Held {
		t.Fatalf("after the release: %+v, %v", info, err)
	}
	l2, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release(ctx)
	if l2.Token() <= info.Counter {
		t.Fatalf("the next grant's token %d is not above the counter %d", l2.Token(), info.Counter)
	}
	if _, err := a.Inspect(ctx, ""); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("Inspect of an empty name: %v", err)
	}
}
