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

var writerBucket = jetstream.KeyValueConfig{Bucket: "fences", History: 1}

func newWriter(t testing.TB, j jetstream.JetStream, cfg jetstream.KeyValueConfig) *natsfence.Writer {
	t.Helper()
	bucket(t, j, cfg)
	w, err := natsfence.NewWriter(context.Background(), j, cfg.Bucket, nil)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestWriterConformance(t *testing.T) {
	fencetest.WriterSuite{
		New:     func(t *testing.T) fence.FencedWriter { return newWriter(t, js(t), writerBucket) },
		BadKeys: []string{strings.Repeat("k", natsfence.MaxKeyBytes+1)},
		Faulty: func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			j, p := proxied(t)
			return newWriter(t, j, writerBucket), p
		},
	}.Run(t)
}

// TestWriterLongestKey: a key of MaxKeyBytes bytes that all need escaping (three
// bytes each in the KV key) is written and read back.
func TestWriterLongestKey(t *testing.T) {
	w := newWriter(t, js(t), writerBucket)
	ctx := context.Background()
	key := strings.Repeat(".", natsfence.MaxKeyBytes)
	if err := w.Write(ctx, key, []byte("v"), 1); err != nil {
		t.Fatalf("a %d-byte key: %v", len(key), err)
	}
	if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "v" || tok != 1 {
		t.Fatalf("Read = %q, %d, %v", v, tok, err)
	}
}

// TestEncodeKeyInjective: names that a careless mapping would fold together
// (case, an escaped look-alike, dots, a trailing space, bytes over 0x7f) get
// keys of their own, each valid for NATS KV.
func TestEncodeKeyInjective(t *testing.T) {
	names := []string{"a.b", "a=2Eb", "A.b", "a.b ", "a_b", "a/b", "a-b", "a b", ".a", "a.", "a..b",
		"é", "e\u0301", "\xff", "=", "==", "=3D", "*", ">", "a*b", "a>b", "\x00", ""}
	seen := map[string]string{}
	for _, n := range names[:len(names)-1] {
		k := natsfence.EncodeKey(n)
		if other, ok := seen[k]; ok {
			t.Errorf("%q and %q share the key %q", n, other, k)
		}
		seen[k] = n
		for _, c := range k {
			if !strings.ContainsRune("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_/=", c) {
				t.Errorf("key %q of %q holds %q", k, n, c)
			}
		}
	}
	// And through the server: each confusable name is a key of its own.
	w := newWriter(t, js(t), writerBucket)
	ctx := context.Background()
	for i, n := range names[:len(names)-1] {
		key := fencetest.Name("inj") + n
		_ = i
		if err := w.Write(ctx, key, []byte(n), 1); err != nil {
			t.Fatalf("Write(%q): %v", key, err)
		}
		if v, _, err := w.Read(ctx, key); err != nil || string(v) != n {
			t.Fatalf("Read(%q) = %q, %v", key, v, err)
		}
	}
}

// TestWriterRefusesExpiringBucket: a bucket whose entries expire would lose
// fences; NewWriter refuses it, naming the bucket.
func TestWriterRefusesExpiringBucket(t *testing.T) {
	j := js(t)
	bucket(t, j, jetstream.KeyValueConfig{Bucket: "fences-ttl", TTL: 10 * time.Minute})
	_, err := natsfence.NewWriter(context.Background(), j, "fences-ttl", nil)
	var ie *fence.InvalidError
	if !errors.As(err, &ie) || ie.Arg != "bucket" {
		t.Fatalf("NewWriter on an expiring bucket: %v, want ErrInvalid naming the bucket", err)
	}
	for _, b := range []string{"", "a.b", "a b"} {
		if _, err := natsfence.NewWriter(context.Background(), j, b, nil); !errors.Is(err, fence.ErrInvalid) || !strings.Contains(err.Error(), "bucket") {
			t.Errorf("bucket %q: %v, want ErrInvalid naming the bucket", b, err)
		}
	}
	if _, err := natsfence.NewWriter(context.Background(), nil, "fences", nil); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("nil js: %v", err)
	}
	if _, err := natsfence.NewWriter(context.Background(), j, writerBucket.Bucket, &natsfence.WriterOptions{Timeout: -1}); !errors.Is(err, fence.ErrInvalid) || !strings.Contains(err.Error(), "Timeout") {
		t.Fatalf("negative Timeout: %v", err)
	}
}

// TestWriterFenceGone: a key deleted or purged in the bucket behind the
// writer's back has lost its fence: the writer refuses a write with a lower
// token than the one it held, instead of accepting it as a first write.
func TestWriterFenceGone(t *testing.T) {
	j := js(t)
	kv := bucket(t, j, writerBucket)
	w := newWriter(t, j, writerBucket)
	ctx := context.Background()
	for _, purge := range []bool{false, true} {
		key := fencetest.Name("gone")
		if err := w.Write(ctx, key, []byte("new holder"), 9); err != nil {
			t.Fatal(err)
		}
		var err error
		if purge {
			err = kv.Purge(ctx, natsfence.EncodeKey(key))
		} else {
			err = kv.Delete(ctx, natsfence.EncodeKey(key))
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Write(ctx, key, []byte("paused holder"), 3); !errors.Is(err, natsfence.ErrFenceGone) {
			t.Errorf("purge %v: a write with a lower token after the fence was removed: %v, want ErrFenceGone", purge, err)
		}
	}
}

func natsfenceWriter(j jetstream.JetStream, timeout, retryFor time.Duration) (*natsfence.Writer, error) {
	return natsfence.NewWriter(context.Background(), j, writerBucket.Bucket, &natsfence.WriterOptions{Timeout: timeout, RetryFor: retryFor})
}

// TestWriterOnMirrorBucket: a KV bucket that mirrors another keeps its
// entries under the origin's subjects, so the Writer, which reads the
// bucket's own subjects, never sees a key's fence. NewWriter must refuse it
// (ErrInvalid naming the bucket), or a write must settle; it must not spin
// until the context ends, nor accept a lower token.
func TestWriterOnMirrorBucket(t *testing.T) {
	j := js(t)
	origin := jetstream.KeyValueConfig{Bucket: "fences-origin", History: 1}
	bucket(t, j, origin)
	mirror := jetstream.KeyValueConfig{Bucket: "fences-mirror", Mirror: &jetstream.StreamSource{Name: origin.Bucket}}
	bucket(t, j, mirror)
	ctx := context.Background()
	w, err := natsfence.NewWriter(ctx, j, mirror.Bucket, nil)
	var ie *fence.InvalidError
	if errors.As(err, &ie) && ie.Arg == "bucket" {
		return
	}
	if err != nil {
		t.Fatalf("NewWriter on a mirror: %v, want ErrInvalid naming the bucket", err)
	}
	key := fencetest.Name("mirror")
	ow := newWriter(t, j, origin)
	if err := ow.Write(ctx, key, []byte("v9"), 9); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err = w.Write(wctx, key, []byte("v1"), 1)
	if wctx.Err() != nil {
		t.Fatalf("a write on a mirror bucket spun until its context ended: %v", err)
	}
	if err == nil {
		t.Fatalf("a write with token 1 on a mirror of a key at token 9: accepted")
	}
}

// TestWriterConcurrentCutRate: writers on clients of their own, two of them
// behind proxies that cut connections at random (requests dropped or replies
// lost), write one key with interleaved tokens. Every stale answer names a
// current token above the one offered and at least every token that writer
// had seen accepted; the key ends at the largest token whose write returned
// nil, or at a larger one whose outcome was unknown.
func TestWriterConcurrentCutRate(t *testing.T) {
	ctx := context.Background()
	key := fencetest.Name("race")
	type result struct {
		tok fence.Token
		err error
	}
	const writers, each = 4, 25
	results := make(chan result, writers*each)
	done := make(chan struct{}, writers)
	for i := 0; i < writers; i++ {
		j := js(t)
		var p interface{ CutRate(float64) }
		if i < 2 {
			j, p = proxied(t)
		}
		bucket(t, j, writerBucket)
		w, err := natsfence.NewWriter(ctx, j, writerBucket.Bucket, &natsfence.WriterOptions{Timeout: 500 * time.Millisecond, RetryFor: 3 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if p != nil {
			p.CutRate(0.05)
		}
		go func(i int) {
			defer func() { done <- struct{}{} }()
			var seen fence.Token
			for n := 0; n < each; n++ {
				tok := fence.Token(1 + n*writers + (i*3+n)%writers)
				err := w.Write(ctx, key, []byte{byte(i), byte(n)}, tok)
				var se *fence.StaleError
				if errors.As(err, &se) && !errors.Is(err, fence.ErrUnknown) {
					if se.Current <= tok || se.Current < seen {
						t.Errorf("writer %d: stale %d with current %d (seen accepted %d)", i, tok, se.Current, seen)
					}
				}
				if err == nil && tok > seen {
					seen = tok
				}
				results <- result{tok, err}
			}
		}(i)
	}
	for i := 0; i < writers; i++ {
		<-done
	}
	close(results)
	var maxOK, maxUnknown fence.Token
	for r := range results {
		switch {
		case r.err == nil && r.tok > maxOK:
			maxOK = r.tok
		case errors.Is(r.err, fence.ErrUnknown) && r.tok > maxUnknown:
			maxUnknown = r.tok
		}
	}
	_, tok, err := newWriter(t, js(t), writerBucket).Read(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if tok != maxOK && !(tok > maxOK && tok <= maxUnknown) {
		t.Fatalf("the key ends at token %d; largest accepted %d, largest unknown %d", tok, maxOK, maxUnknown)
	}
	t.Logf("ends at %d; largest accepted %d, largest unknown %d", tok, maxOK, maxUnknown)
}
