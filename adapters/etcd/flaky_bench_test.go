package etcdfence_test

import (
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/etcdtest"
)

// BenchmarkFlakyNetwork: 8 workers x 200 locked increments of one counter
// (Acquire, Read, fenced Write, Release) with an acquirer whose client reaches
// an embedded etcd's client port only through a fault proxy with 1-3 ms
// jitter, then with 2% cuts too (benchutil.FlakyNetwork). etcd has no writer
// here: the counter is a fenced store in memory (benchutil.MemStore), so only
// the lock's requests cross the proxy. Run it alone, once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/etcd/
func BenchmarkFlakyNetwork(b *testing.B) {
	c := etcdtest.Start(b, 1)
	benchutil.FlakyNetwork(b, benchutil.Flaky{
		Name:   "etcd",
		Target: func(*testing.B) string { return c.ClientAddr(0) },
		// A lost reply's connection is cut 20ms after its request (about
		// two of etcd's write round trips through the jitter here): the
		// first bytes back on the shared HTTP/2 connection need not be its
		// reply (faultnet.ReplyWindow). On the other backends the cut
		// comes with the reply, one round trip after the request.
		ReplyWindow: 20 * time.Millisecond,
		Open: func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
			a, err := etcdfence.New(etcdtest.NewClient(b, p.Addr()), nil)
			if err != nil {
				b.Fatal(err)
			}
			return a, &benchutil.MemStore{}
		},
	})
}
