package s3fence_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"maps"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// metadataEdits are the metadata an operator's tool may set in place of the
// writer's: none at all, and a lower token beside the writer's other keys.
var metadataEdits = []struct {
	name string
	meta func(old map[string]string) map[string]string
}{
	{"removed", func(map[string]string) map[string]string { return map[string]string{"owner": "ops"} }},
	{"lowered", func(old map[string]string) map[string]string {
		m := map[string]string{}
		for k, v := range old {
			m[k] = v
		}
		m[s3fence.MetaToken] = "1"
		return m
	}},
}

// replaceMetadata copies key onto itself with MetadataDirective REPLACE and
// the metadata edit makes of the current one: the body stays as it was.
func replaceMetadata(t *testing.T, e *s3env, key string, edit func(map[string]string) map[string]string) {
	t.Helper()
	ctx := context.Background()
	head, err := e.c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key)})
	if err != nil {
		t.Fatalf("HEAD %q: %v", key, err)
	}
	meta := edit(head.Metadata)
	if _, err := e.c.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key),
		CopySource: aws.String(e.bucket + "/" + key), MetadataDirective: types.MetadataDirectiveReplace,
		Metadata: meta}); err != nil {
		t.Fatalf("CopyObject %q onto itself with new metadata: %v", key, err)
	}
	after, err := e.c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key)})
	if err != nil {
		t.Fatalf("HEAD %q: %v", key, err)
	}
	if maps.Equal(after.Metadata, meta) {
		return
	}
	// gofakes3 merges new metadata into the old, on a copy and on a put
	// alike: delete the object and put the same body with the new metadata.
	t.Logf("the server merged the metadata (%v) on CopyObject REPLACE: putting the same body with %v", after.Metadata, meta)
	out, err := e.c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key)})
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(out.Body)
	out.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key)}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key),
		Body: bytes.NewReader(body), Metadata: meta}); err != nil {
		t.Fatal(err)
	}
	after, err = e.c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key)})
	if err != nil || !maps.Equal(after.Metadata, meta) || aws.ToString(after.ETag) != aws.ToString(head.ETag) {
		t.Fatalf("after putting the same body with metadata %v: %v ETag %s (was %s), %v", meta, after.Metadata, aws.ToString(after.ETag), aws.ToString(head.ETag), err)
	}
}

// TestWriteFenceSurvivesReplacedMetadata: an object's token metadata removed
// or lowered in place (the body, with its envelope, unchanged) still fences
// a lower token, and Read still reports the stored write.
func TestWriteFenceSurvivesReplacedMetadata(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		for _, edit := range metadataEdits {
			t.Run(edit.name, func(t *testing.T) {
				ctx := context.Background()
				w := newWriter(t, e, nil)
				key := fencetest.Name("meta")
				if err := w.Write(ctx, key, []byte("ten"), 10); err != nil {
					t.Fatal(err)
				}
				replaceMetadata(t, e, key, edit.meta)
				err := w.Write(ctx, key, []byte("five"), 5)
				var se *fence.StaleError
				if !errors.As(err, &se) || se.Current != 10 {
					t.Errorf("Write(token 5) after token 10 and the metadata %s: %v, want a StaleError holding 10", edit.name, err)
				}
				if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "ten" || tok != 10 {
					t.Errorf("Read = %q token %d, %v; want \"ten\" token 10", v, tok, err)
				}
				// An equal token still writes, and the metadata is whole again.
				if err := w.Write(ctx, key, []byte("ten again"), 10); err != nil {
					t.Errorf("Write(token 10) again: %v", err)
				}
				if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "ten again" || tok != 10 {
					t.Errorf("Read = %q token %d, %v; want \"ten again\" token 10", v, tok, err)
				}
			})
		}
	})
}

// TestLockSurvivesReplacedMetadata: a lock object whose metadata was
// replaced in place still holds its holder and its counter: the name stays
// held, and the next grant's token is above the first.
func TestLockSurvivesReplacedMetadata(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		for _, edit := range metadataEdits {
			t.Run(edit.name, func(t *testing.T) {
				ctx := context.Background()
				a := newAcquirer(t, e)
				name := fencetest.Name("meta")
				l, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				replaceMetadata(t, e, "fencekit-locks/"+name, edit.meta)
				if l2, err := a.TryAcquire(ctx, name, time.Minute); !errors.Is(err, fence.ErrHeld) {
					if l2 != nil {
						_ = l2.Release(ctx)
					}
					t.Fatalf("TryAcquire while held, after the lock object's metadata was replaced: %v, want ErrHeld", err)
				}
				if err := l.Release(ctx); err != nil {
					t.Fatalf("Release: %v", err)
				}
				l2, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				defer l2.Release(ctx)
				if l2.Token() <= l.Token() {
					t.Errorf("grant after the metadata was replaced: token %d, want above %d", l2.Token(), l.Token())
				}
			})
		}
	})
}
