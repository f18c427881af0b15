package azfence_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blob"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// awaitDatePast returns once Azure's Date (whole seconds), in microseconds,
// is above tok: the condition docs/guarantees.md states for a restored lock
// blob.
func awaitDatePast(t *testing.T, bc *blob.Client, tok uint64) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		p, err := bc.GetProperties(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		if p.Date == nil {
			t.Fatal("GetProperties: no Date")
		}
		if uint64(p.Date.UnixMicro()) > tok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("Azure's Date did not pass %d (µs) within 15s", tok)
		}
		time.Sleep(50 * time.Millisecond) // a poll's pace: the loop's condition decides
	}
}

// TestTokenAfterLockBlobRestoredFromSnapshot: an operator restores a lock
// blob from a snapshot taken before later grants (the snapshot copied over
// the base blob, or its metadata, seal included, set back on it), so its
// counter is below tokens handed out since. Once Azure's clock is past the
// last token handed out (it is in microseconds of Azure's clock), the next
// grant's token is above it, and the new holder's fenced write is accepted.
func TestTokenAfterLockBlobRestoredFromSnapshot(t *testing.T) {
	e := newEnv(t)
	for _, how := range []string{"snapshot copied over", "snapshot metadata set back"} {
		t.Run(how, func(t *testing.T) {
			ctx := context.Background()
			a, w := newAcquirer(t, e.c), newWriter(t, e.c, nil)
			name, key := fencetest.Name("restore"), fencetest.Name("data")
			bc := e.c.NewBlobClient("fencekit-locks/" + name)
			l1, err := a.TryAcquire(ctx, name, 15*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if err := l1.Release(ctx); err != nil {
				t.Fatal(err)
			}
			snap, err := bc.CreateSnapshot(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			sc, err := bc.WithSnapshot(*snap.Snapshot)
			if err != nil {
				t.Fatal(err)
			}
			var last uint64
			for range 3 { // grants after the snapshot
				l, err := a.TryAcquire(ctx, name, 15*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				if err := w.Write(ctx, key, []byte("v"), l.Token()); err != nil {
					t.Fatal(err)
				}
				last = uint64(l.Token())
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			awaitDatePast(t, bc, last)
			sp, err := sc.GetProperties(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if how == "snapshot copied over" {
				if _, err := bc.StartCopyFromURL(ctx, sc.URL(), nil); err != nil {
					t.Fatalf("copying snapshot %s over the lock blob: %v", *snap.Snapshot, err)
				}
			} else if _, err := bc.SetMetadata(ctx, sp.Metadata, nil); err != nil {
				t.Fatalf("setting the snapshot's metadata on the lock blob: %v", err)
			}
			p, err := bc.GetProperties(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			token := func(m map[string]*string) string {
				for k, v := range m {
					if strings.EqualFold(k, azfence.MetaToken) && v != nil {
						return *v
					}
				}
				return ""
			}
			t.Logf("restored token %s (the snapshot's %s), last token handed out %d", token(p.Metadata), token(sp.Metadata), last)
			l, err := newAcquirer(t, e.c).TryAcquire(ctx, name, 15*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Release(ctx)
			if uint64(l.Token()) <= last {
				t.Errorf("grant after the lock blob was restored from a snapshot: token %d, want above the last token handed out, %d", l.Token(), last)
			}
			if err := w.Write(ctx, key, []byte("new"), l.Token()); err != nil {
				t.Errorf("the new holder's write with token %d: %v", l.Token(), err)
			}
		})
	}
}
