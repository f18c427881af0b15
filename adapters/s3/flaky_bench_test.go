package s3fence_test

import (
	"testing"
	"time"

	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// BenchmarkFlakyNetwork: locked increments of one counter (Acquire, Read,
// fenced Write, Release) with the S3 acquirer and writer on one client that
// reaches the in-process gofakes3 only through a fault proxy with 1-3 ms
// jitter, then with 2% cuts too (benchutil.FlakyNetwork). S3 locks are slow
// (several requests a grant, waiters poll): 8 workers x 25 increments. Run it
// alone, once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/s3/
func BenchmarkFlakyNetwork(b *testing.B) {
	e := fakeS3(b)
	benchutil.FlakyNetwork(b, benchutil.Flaky{
		Name:   "s3-gofakes3",
		Target: func(b *testing.B) string { return serverHost(b, e) },
		Open: func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
			c := clientVia(e, p)
			a := newAcquirer(b, &s3env{c: c, bucket: e.bucket})
			w, err := s3fence.NewWriter(c, e.bucket, nil)
			if err != nil {
				b.Fatal(err)
			}
			return a, w
		},
		Workers: 8, Increments: 25,
		TTL: 10 * time.Second,
	})
}
