package s3fence_test

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/fencekit/fencekit/adapters/redislua"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/testenv"
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
			w := newWriter(b, e, &s3fence.WriterOptions{ReuseETag: mode == "reuse-etag"})
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

// BenchmarkAcquireRelease measures an uncontended TryAcquire + Release with the
// S3 acquirer (on gofakes3 and on versitygw, counting the requests each pair
// sends) and, in the same run, with the SQLite and Redis acquirers.
func BenchmarkAcquireRelease(b *testing.B) {
	ctx := context.Background()
	run := func(b *testing.B, a fence.Acquirer, count func() int32) {
		name := fencetest.Name("bench")
		// The name's first grant creates its lock object and waits about a
		// second for S3's clock (the token floor): keep it out of the timing.
		if l, err := a.TryAcquire(ctx, name, time.Minute); err != nil {
			b.Fatal(err)
		} else if err := l.Release(ctx); err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		var before int32
		if count != nil {
			before = count()
		}
		for i := 0; i < b.N; i++ {
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				b.Fatal(err)
			}
			if err := l.Release(ctx); err != nil {
				b.Fatal(err)
			}
		}
		if count != nil {
			b.ReportMetric(float64(count()-before)/float64(b.N), "requests/op")
		}
	}
	b.Run("s3-gofakes3", func(b *testing.B) {
		e := fakeS3(b)
		run(b, newAcquirer(b, e), e.f.reqs.Load)
	})
	b.Run("s3-versitygw", func(b *testing.B) {
		e := realS3(b)
		var count func() int32
		if e.f != nil {
			count = e.f.reqs.Load
		}
		run(b, newAcquirer(b, e), count)
	})
	b.Run("sqlite", func(b *testing.B) {
		db, err := sqlfence.OpenSQLite(filepath.Join(b.TempDir(), "bench.db"))
		if err != nil {
			b.Fatal(err)
		}
		defer db.Close()
		a, _ := sqlfence.NewAcquirer(sqlfence.SQLite(db), nil)
		if err := a.CreateTable(ctx); err != nil {
			b.Fatal(err)
		}
		run(b, a, nil)
	})
	b.Run("redis", func(b *testing.B) {
		a, _ := redislua.NewAcquirer(testenv.RedisClient(b), nil)
		run(b, a, nil)
	})
}
