package natsfence_test

import (
	"context"
	"strings"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/nats-io/nats.go/jetstream"
)

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
