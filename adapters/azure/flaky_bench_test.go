package azfence_test

import (
	"strings"
	"testing"

	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// BenchmarkFlakyNetwork: locked increments of one counter (Acquire, Read,
// fenced Write, Release) with the Azure acquirer and writer on one client
// that reaches Azurite only through a fault proxy with 1-3 ms jitter, then
// with 2% cuts too (benchutil.FlakyNetwork). Waiters poll (one Lease Blob
// request each), and every lease is Azure's shortest, 15 s
// (MinLeaseDuration): a grant that nobody releases holds the name for 15 s.
// 8 workers x 200 increments (the workload of every adapter's flaky-network
// benchmark): the pair of runs took 3.3 minutes on a loaded machine. Run it
// alone, once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/azure/
func BenchmarkFlakyNetwork(b *testing.B) {
	e := newEnv(b)
	if e.srv.External {
		b.Skip("the fault proxy sits in front of Azurite only (FENCEKIT_AZURE_URL is set)")
	}
	benchutil.FlakyNetwork(b, benchutil.Flaky{
		Name:   "azurite",
		Target: func(*testing.B) string { return e.srv.Host },
		Open: func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
			c := newClient(b, e.srv, strings.Replace(e.srv.ServiceURL, e.srv.Host, p.Addr(), 1), e.container)
			return newAcquirer(b, c), newWriter(b, c, nil)
		},
		Workers: 8, Increments: 200,
		TTL: azfence.MinLeaseDuration,
	})
}
