package natsfence_test

import (
	"context"
	"errors"
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
