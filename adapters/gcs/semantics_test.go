package gcsfence_test

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"cloud.google.com/go/storage"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestGenerationSemantics records what the server does with generation
// preconditions, which the writer and the acquirer rely on: ifGenerationMatch
// on another generation, ifGenerationMatch=0 on an existing object, and
// ifGenerationMatch on a missing object all fail with 412 and write nothing;
// a matching one succeeds; every upload gets a new, larger generation, also
// after the object was deleted and recreated (no reuse); ifMetagenerationMatch
// on an upload is logged as enforced or ignored (fake-gcs-server ignores it,
// so neither package uses it), as is ifGenerationMatch on a delete (neither
// package deletes); the "updated" time of an upload lies on the
// server's clock between the request and its answer (here the server's clock
// is this machine's).
func TestGenerationSemantics(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		ctx := context.Background()
		key := "semantics-" + time.Now().Format("150405.000000")
		obj := e.b().Object(key)
		put := func(c *storage.Conditions, body string) (*storage.ObjectAttrs, error) {
			o := obj.Retryer(storage.WithPolicy(storage.RetryNever))
			if c != nil {
				o = o.If(*c)
			}
			w := o.NewWriter(ctx)
			w.ChunkSize = 0
			_, _ = io.WriteString(w, body)
			if err := w.Close(); err != nil {
				return nil, err
			}
			return w.Attrs(), nil
		}
		before := time.Now()
		a1, err := put(&storage.Conditions{DoesNotExist: true}, "v1")
		after := time.Now()
		if err != nil {
			t.Fatalf("ifGenerationMatch=0 on a missing object: %v", err)
		}
		if a1.Updated.Before(before.Add(-time.Second)) || a1.Updated.After(after.Add(time.Second)) {
			t.Logf("updated %v is off this machine's clock (%v..%v): a remote server", a1.Updated, before, after)
		}
		t.Logf("updated has %s precision: %v", map[bool]string{true: "sub-millisecond", false: "millisecond (or coarser)"}[a1.Updated.Nanosecond()%1e6 != 0], a1.Updated)
		for _, c := range []struct {
			what string
			cond storage.Conditions
			obj  *storage.ObjectHandle
		}{
			{"ifGenerationMatch with another generation", storage.Conditions{GenerationMatch: a1.Generation + 1}, obj},
			{"ifGenerationMatch=0 on an existing object", storage.Conditions{DoesNotExist: true}, obj},
			{"ifGenerationMatch on a missing object", storage.Conditions{GenerationMatch: a1.Generation}, e.b().Object(key + "-missing")},
		} {
			w := c.obj.If(c.cond).Retryer(storage.WithPolicy(storage.RetryNever)).NewWriter(ctx)
			w.ChunkSize = 0
			_, _ = io.WriteString(w, "should not land")
			err := w.Close()
			t.Logf("%s: %d (%v)", c.what, status(err), err)
			if status(err) != 412 {
				t.Errorf("%s: answered %d (%v), want 412", c.what, status(err), err)
			}
		}
		if got, err := obj.Attrs(ctx); err != nil || got.Generation != a1.Generation {
			t.Errorf("a refused upload changed the object: %+v, %v", got, err)
		}
		if _, err := e.b().Object(key + "-missing").Attrs(ctx); !errors.Is(err, storage.ErrObjectNotExist) {
			t.Errorf("a refused upload created the missing object: %v", err)
		}
		_, err = put(&storage.Conditions{GenerationMatch: a1.Generation, MetagenerationMatch: a1.Metageneration + 7}, "v-meta")
		t.Logf("ifMetagenerationMatch with another metageneration on an upload: %d (%v): %s", status(err), err,
			map[bool]string{true: "enforced", false: "ignored"}[status(err) == 412])
		cur, err := obj.Attrs(ctx)
		if err != nil {
			t.Fatal(err)
		}
		gens := []int64{a1.Generation}
		if cur.Generation != a1.Generation {
			gens = append(gens, cur.Generation)
		}
		a2, err := put(&storage.Conditions{GenerationMatch: cur.Generation}, "v1") // identical bytes
		if err != nil {
			t.Fatalf("ifGenerationMatch on the current generation: %v", err)
		}
		gens = append(gens, a2.Generation)
		if err := obj.Delete(ctx); err != nil {
			t.Fatal(err)
		}
		a3, err := put(&storage.Conditions{DoesNotExist: true}, "v1")
		if err != nil {
			t.Fatalf("recreate after delete: %v", err)
		}
		gens = append(gens, a3.Generation)
		t.Logf("generations of identical uploads, delete, recreate: %v", gens)
		for i := 1; i < len(gens); i++ {
			if gens[i] <= gens[i-1] {
				t.Errorf("generation %d after %d: reused or went back", gens[i], gens[i-1])
			}
		}
		// Delete with ifGenerationMatch on another generation: GCS refuses it
		// with 412; logged, since neither package deletes conditionally.
		derr := obj.If(storage.Conditions{GenerationMatch: a3.Generation + 1}).Retryer(storage.WithPolicy(storage.RetryNever)).Delete(ctx)
		_, aerr := obj.Attrs(ctx)
		t.Logf("delete with ifGenerationMatch on another generation: %d (%v): %s", status(derr), derr,
			map[bool]string{true: "enforced", false: "ignored: the object was deleted"}[aerr == nil])
		if aerr != nil {
			if _, err := put(&storage.Conditions{DoesNotExist: true}, "v1"); err != nil {
				t.Fatal(err)
			}
		}
		// A stale precondition from before the delete never matches again.
		if _, err := put(&storage.Conditions{GenerationMatch: a2.Generation}, "stale"); status(err) != 412 {
			t.Errorf("ifGenerationMatch on a generation from before the delete: %v, want 412", err)
		}
		_ = obj.Delete(ctx)
	})
}

// TestLibraryRetries records what cloud.google.com/go/storage (v1.71.0) does
// with a conditional upload answered 503, as the writer's doc says: with its
// defaults (ChunkSize 16 MiB, RetryIdempotent) it sends the upload again and
// reports the second answer, so a first attempt that landed would surface as
// 412; with ChunkSize 0 it sends once and reports the 503; with RetryNever
// too (what gcsfence uses) it sends once.
func TestLibraryRetries(t *testing.T) {
	e := fakeGCS(t)
	ctx := context.Background()
	for _, c := range []struct {
		what      string
		chunk     int
		never     bool
		wantSends int32
	}{
		{"defaults", -1, false, 2},
		{"ChunkSize 0", 0, false, 1},
		{"ChunkSize 0 and RetryNever", 0, true, 1},
	} {
		obj := e.b().Object(fencetest.Name("retries"))
		if c.never {
			obj = obj.Retryer(storage.WithPolicy(storage.RetryNever))
		}
		e.f.inject("503")
		before := e.f.uploads.Load()
		w := obj.If(storage.Conditions{DoesNotExist: true}).NewWriter(ctx)
		if c.chunk >= 0 {
			w.ChunkSize = c.chunk
		}
		_, _ = io.WriteString(w, "x")
		err := w.Close()
		n := e.f.uploads.Load() - before
		t.Logf("%s: %d uploads sent, error %v", c.what, n, err)
		if n != c.wantSends || (n == 1) != (status(err) == 503) {
			t.Errorf("%s: %d uploads sent (error %v), want %d", c.what, n, err, c.wantSends)
		}
	}
}
