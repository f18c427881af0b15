package s3fence_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsmiddleware "github.com/aws/aws-sdk-go-v2/aws/middleware"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	smithyhttp "github.com/aws/smithy-go/transport/http"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// serverDate is the Date header of an answer of e's server.
func serverDate(t *testing.T, e *s3env) time.Time {
	t.Helper()
	out, err := e.c.HeadBucket(context.Background(), &s3.HeadBucketInput{Bucket: aws.String(e.bucket)})
	if err != nil {
		t.Fatal(err)
	}
	r, ok := awsmiddleware.GetRawResponse(out.ResultMetadata).(*smithyhttp.Response)
	if !ok {
		t.Fatal("HeadBucket: no raw response")
	}
	d, err := http.ParseTime(r.Header.Get("Date"))
	if err != nil {
		t.Fatalf("HeadBucket: Date %q: %v", r.Header.Get("Date"), err)
	}
	return d
}

// awaitDatePast returns once the server's Date, in microseconds, is above
// tok: the condition docs/guarantees.md states for a restored lock object.
func awaitDatePast(t *testing.T, e *s3env, tok uint64) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for uint64(serverDate(t, e).UnixMicro()) <= tok {
		if time.Now().After(deadline) {
			t.Fatalf("the server's Date did not pass %d (µs) within 15s", tok)
		}
		time.Sleep(50 * time.Millisecond) // a poll's pace: the loop's condition decides
	}
}

// lockBody is the body of the object at key.
func lockBody(t *testing.T, e *s3env, key string) []byte {
	t.Helper()
	out, err := e.c.GetObject(context.Background(), &s3.GetObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key)})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Body.Close()
	b, err := io.ReadAll(out.Body)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestTokenAfterLockObjectRestoredFromOlderVersion: an operator restores an
// older version of a lock object (a copy of the version onto the key, with
// bucket versioning; on a server without versioning, the bytes of that
// version put back, as from a backup), whose counter is below the tokens
// granted since. Once S3's Date is past the last token handed out (it is
// in microseconds of S3's clock), the next grant's token is above it, and
// the new holder's fenced write is accepted.
func TestTokenAfterLockObjectRestoredFromOlderVersion(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		ctx := context.Background()
		_, verr := e.c.PutBucketVersioning(ctx, &s3.PutBucketVersioningInput{Bucket: aws.String(e.bucket),
			VersioningConfiguration: &types.VersioningConfiguration{Status: types.BucketVersioningStatusEnabled}})
		if verr != nil {
			t.Logf("no bucket versioning (%v): the restore puts an earlier version's bytes back", verr)
		}
		a, w := newAcquirer(t, e), newWriter(t, e, nil)
		name, key := fencetest.Name("restore"), fencetest.Name("data")
		lockKey := "fencekit-locks/" + name
		l1, err := a.TryAcquire(ctx, name, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if err := l1.Release(ctx); err != nil {
			t.Fatal(err)
		}
		old, err := e.c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(lockKey)})
		if err != nil {
			t.Fatal(err)
		}
		oldBody, err := io.ReadAll(old.Body)
		old.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		var last uint64
		for range 3 { // grants after the version that will be restored
			l, err := a.TryAcquire(ctx, name, 10*time.Second)
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
		awaitDatePast(t, e, last)
		restored := false
		if verr == nil && aws.ToString(old.VersionId) != "" {
			src := e.bucket + "/" + lockKey + "?versionId=" + url.QueryEscape(aws.ToString(old.VersionId))
			if _, err := e.c.CopyObject(ctx, &s3.CopyObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(lockKey), CopySource: aws.String(src)}); err != nil {
				t.Fatalf("restoring version %s of the lock object: %v", aws.ToString(old.VersionId), err)
			}
			if restored = bytes.Equal(lockBody(t, e, lockKey), oldBody); !restored {
				t.Logf("CopyObject from version %s copied another version (the server ignores versionId): putting its bytes back", aws.ToString(old.VersionId))
			}
		}
		if !restored {
			if _, err := e.c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(lockKey), Body: bytes.NewReader(oldBody)}); err != nil {
				t.Fatalf("putting the earlier version's bytes back: %v", err)
			}
		}
		if b := lockBody(t, e, lockKey); !bytes.Equal(b, oldBody) {
			t.Fatalf("the lock object holds %s after the restore, want %s", b, oldBody)
		}
		t.Logf("restored %s (version %q), last token handed out %d", oldBody, aws.ToString(old.VersionId), last)
		l, err := newAcquirer(t, e).TryAcquire(ctx, name, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release(ctx)
		if uint64(l.Token()) <= last {
			t.Errorf("grant after the restore of an older version: token %d, want above the last token handed out, %d", l.Token(), last)
		}
		if err := w.Write(ctx, key, []byte("new"), l.Token()); err != nil {
			t.Errorf("the new holder's write with token %d: %v", l.Token(), err)
		}
	})
}
