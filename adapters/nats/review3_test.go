package natsfence_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/nats-io/nats.go/jetstream"
)

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

// TestAcquirersConcurrentCutRate: acquirers on clients of their own, two of
// them behind proxies that cut connections at random, contend for one name;
// each lease is released, renewed then released, or left to expire. Whenever
// a lease is granted, every earlier lease's context is done and its token is
// below the new one.
func TestAcquirersConcurrentCutRate(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("contend")
	var mu sync.Mutex
	var granted []fence.Lease
	const acquirers, rounds = 3, 6
	done := make(chan struct{}, acquirers)
	for i := 0; i < acquirers; i++ {
		j := js(t)
		var p interface{ CutRate(float64) }
		if i < 2 {
			j, p = proxied(t)
		}
		a := newAcquirer(t, j, lockBucket, &natsfence.Options{Timeout: 500 * time.Millisecond, RetryFor: 2 * time.Second, Recheck: 500 * time.Millisecond})
		if p != nil {
			p.CutRate(0.05)
		}
		go func(i int) {
			defer func() { done <- struct{}{} }()
			for n := 0; n < rounds; n++ {
				wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				start := time.Now()
				l, err := a.Acquire(wctx, name, time.Second)
				cancel()
				if err != nil {
					continue // ErrUnknown or a cut: nothing was granted to us
				}
				took := time.Since(start)
				mu.Lock()
				t.Logf("acquirer %d: token %d after %v (context err %v)", i, l.Token(), took, l.Context().Err())
				for _, e := range granted {
					if e.Context().Err() == nil {
						t.Errorf("acquirer %d granted token %d while token %d's context is live", i, l.Token(), e.Token())
					}
					if e.Token() >= l.Token() {
						t.Errorf("acquirer %d granted token %d after token %d", i, l.Token(), e.Token())
					}
				}
				granted = append(granted, l)
				mu.Unlock()
				switch (i + n) % 3 {
				case 0:
					_ = l.Release(ctx)
				case 1:
					_ = l.Renew(ctx)
					_ = l.Release(ctx)
				case 2:
					<-l.Context().Done()
				}
			}
		}(i)
	}
	for i := 0; i < acquirers; i++ {
		<-done
	}
	if len(granted) < acquirers {
		t.Fatalf("only %d grants", len(granted))
	}
	t.Logf("%d grants", len(granted))
}
