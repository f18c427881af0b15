package gcsfence_test

import (
	"net/url"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// BenchmarkFlakyNetwork: locked increments of one counter (Acquire, Read,
// fenced Write, Release) with the GCS acquirer and writer on one client that
// reaches the in-process fake-gcs-server only through a fault proxy with 1-3
// ms jitter, then with 2% cuts too (benchutil.FlakyNetwork). Waiters poll:
// 8 workers x 200 increments (the workload of every adapter's flaky-network
// benchmark; the pair of runs took about 2 minutes on a loaded machine). Run
// it alone, once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/gcs/
func BenchmarkFlakyNetwork(b *testing.B) {
	e := fakeGCS(b)
	benchutil.FlakyNetwork(b, benchutil.Flaky{
		Name: "gcs-fake",
		Target: func(b *testing.B) string {
			u, err := url.Parse(e.url)
			if err != nil {
				b.Fatal(err)
			}
			return u.Host
		},
		Open: func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
			env := &gcsEnv{c: newClient(b, "http://"+p.Addr()), bucket: e.bucket}
			return newAcquirer(b, env), newWriter(b, env, nil)
		},
		Workers: 8, Increments: 200,
		TTL: 10 * time.Second,
	})
}
