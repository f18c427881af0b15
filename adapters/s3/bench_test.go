package s3fence_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// BenchmarkWrite compares a fenced write (subject) with a plain PutObject of the
// same size (baseline), interleaved, on the in-process S3: with the HEAD before
// every PUT (target <= 2.0) and reusing the ETag of the writer's own last write
// (target <= 1.1).
func BenchmarkWrite(b *testing.B) {
	for _, mode := range []string{"head", "reuse-etag"} {
		b.Run(mode, func(b *testing.B) {
			e := fakeS3(b)
			c := e.c
			w := newWriter(b, e, &s3fence.Options{ReuseETag: mode == "reuse-etag"})
			ctx := context.Background()
			value := bytes.Repeat([]byte("v"), 4096)
			tok := fence.Token(0)
			benchutil.Pair(b, func(i int) error {
				tok++
				value[0] = byte(i)
				return w.Write(ctx, "obj", value, tok)
			}, func(i int) error {
				value[0] = byte(i)
				_, err := c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("plain"),
					Body: bytes.NewReader(value), ContentLength: aws.Int64(int64(len(value)))})
				return err
			})
		})
	}
}
