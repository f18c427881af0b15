package azfence_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blob"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestWriteFenceSurvivesLoweredMetadata: a blob whose token metadata was set
// lower by another tool (Set Blob Metadata keeps the body and its envelope)
// still fences every token below the envelope's.
func TestWriteFenceSurvivesLoweredMetadata(t *testing.T) {
	e := newEnv(t)
	w := newWriter(t, e.c, nil)
	ctx := context.Background()
	key := fencetest.Name("meta")
	if err := w.Write(ctx, key, []byte("ten"), 10); err != nil {
		t.Fatal(err)
	}
	bc := e.c.NewBlobClient(key)
	p, err := bc.GetProperties(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	md := p.Metadata
	one := "1"
	for k := range md {
		if strings.EqualFold(k, azfence.MetaToken) {
			delete(md, k)
		}
	}
	md[azfence.MetaToken] = &one
	if _, err := bc.SetMetadata(ctx, md, nil); err != nil {
		t.Fatal(err)
	}
	var se *fence.StaleError
	if err := w.Write(ctx, key, []byte("five"), 5); !errors.As(err, &se) || se.Current != 10 {
		t.Errorf("Write(token 5) after token 10 and the token metadata set to 1: %v, want a StaleError holding 10", err)
	}
	if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "ten" || tok != 10 {
		t.Errorf("Read = %q token %d, %v; want \"ten\" token 10", v, tok, err)
	}
	if err := w.Write(ctx, key, []byte("ten again"), 10); err != nil {
		t.Errorf("Write(token 10) again: %v", err)
	}
}

// TestLockSurvivesRemovedMetadata: a lock blob whose metadata another tool
// replaced (the token gone) between two grants still gives the next grant a
// token above the first.
func TestLockSurvivesRemovedMetadata(t *testing.T) {
	e := newEnv(t)
	first, next := grantsAroundLockEdit(t, e, func(ctx context.Context, bc *blob.Client) {
		note := "by hand"
		if _, err := bc.SetMetadata(ctx, map[string]*string{"note": &note}, nil); err != nil {
			t.Fatal(err)
		}
	})
	if next <= first {
		t.Errorf("grant after the lock blob's metadata was replaced: token %d, want above %d", next, first)
	}
}

// TestLockSurvivesLoweredMetadata: a lock blob whose token metadata another
// tool set lower (Set Blob Metadata, no lease held) between two grants still
// gives the next grant a token above the first: a paused holder of the first
// grant must not beat the new holder at a fenced writer.
func TestLockSurvivesLoweredMetadata(t *testing.T) {
	e := newEnv(t)
	first, next := grantsAroundLockEdit(t, e, func(ctx context.Context, bc *blob.Client) {
		p, err := bc.GetProperties(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		md := map[string]*string{}
		for k, v := range p.Metadata {
			if !strings.EqualFold(k, azfence.MetaToken) {
				md[k] = v
			}
		}
		one := "1"
		md[azfence.MetaToken] = &one
		if _, err := bc.SetMetadata(ctx, md, nil); err != nil {
			t.Fatal(err)
		}
	})
	if next <= first {
		t.Errorf("grant after the lock blob's token metadata was set to 1: token %d, want above the earlier grant's %d", next, first)
	}
}

// grantsAroundLockEdit grants and releases a fresh name, runs edit on its
// lock blob (as another tool would), grants it again and returns both tokens.
func grantsAroundLockEdit(t *testing.T, e *azenv, edit func(ctx context.Context, bc *blob.Client)) (first, next fence.Token) {
	t.Helper()
	a := newAcquirer(t, e.c)
	ctx := context.Background()
	name := fencetest.Name("meta")
	l, err := a.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	edit(ctx, e.c.NewBlobClient("fencekit-locks/"+name))
	l2, err := a.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l2.Release(context.Background()) })
	return l.Token(), l2.Token()
}

// TestTombstoneDeletedByHand: what Delete's doc says about a
// tombstone deleted by other means: the fence goes with it, and a write with
// a lower token than the tombstone's is accepted afterwards. While the
// tombstone is there, the same write is refused.
func TestTombstoneDeletedByHand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := newWriter(t, e.c, nil)
	ctx := context.Background()
	key := fencetest.Name("tomb")
	if err := w.Write(ctx, key, []byte("v"), 5); err != nil {
		t.Fatal(err)
	}
	if err := w.Delete(ctx, key, 7); err != nil {
		t.Fatal(err)
	}
	var se *fence.StaleError
	if err := w.Write(ctx, key, []byte("stale"), 6); !errors.As(err, &se) || se.Current != 7 {
		t.Fatalf("a write below the tombstone's token: %v, want *StaleError holding 7", err)
	}
	if _, err := e.c.NewBlobClient(key).Delete(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("stale"), 6); err != nil {
		t.Fatalf("after the tombstone was deleted by hand, Delete's doc says any token is accepted: %v", err)
	}
}

// TestMetadataEditedByHand: an operator sets a fenced blob's
// metadata (Set Blob Metadata replaces all of it: the portal's or the CLI's
// metadata update), and the token in metadata is gone while the body still
// holds the envelope with its token (Read returns it). A write with a lower
// token must still be refused: the fence is not lost with the metadata.
func TestMetadataEditedByHand(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := newWriter(t, e.c, nil)
	ctx := context.Background()
	for _, del := range []bool{false, true} {
		key := fencetest.Name("meta")
		v5 := "v5" + strings.Repeat(".", 300) // longer than the header read
		if err := w.Write(ctx, key, []byte(v5), 5); err != nil {
			t.Fatal(err)
		}
		if del {
			if err := w.Delete(ctx, key, 5); err != nil {
				t.Fatal(err)
			}
		}
		note := "by hand"
		if _, err := e.c.NewBlobClient(key).SetMetadata(ctx, map[string]*string{"note": &note}, nil); err != nil {
			t.Fatal(err)
		}
		if v, tok, err := w.Read(ctx, key); !del && (err != nil || tok != 5 || string(v) != v5) {
			t.Fatalf("Read after the metadata was replaced: %q, %d, %v; want v5 at token 5", v, tok, err)
		}
		var se *fence.StaleError
		if err := w.Write(ctx, key, []byte("stale"), 3); !errors.As(err, &se) || se.Current != 5 {
			t.Errorf("deleted %v: a write with token 3 after the metadata of the blob at token 5 was replaced: %v, want *StaleError holding 5", del, err)
		}
		if err := w.Write(ctx, key, []byte("v6"), 6); err != nil {
			t.Errorf("deleted %v: a write with token 6 after: %v", del, err)
		}
		if v, tok, err := w.Read(ctx, key); err != nil || tok != 6 || string(v) != "v6" {
			t.Errorf("deleted %v: Read = %q, %d, %v; want v6 at token 6", del, v, tok, err)
		}
	}
}
