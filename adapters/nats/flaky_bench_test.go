package natsfence_test

import (
	"github.com/nats-io/nats.go"
	"testing"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/natstest"
)

// BenchmarkFlakyNetwork: 8 workers x 200 locked increments of one counter
// (Acquire, Read, fenced Write, Release) with an acquirer and a KV writer
// whose client reaches the package's in-process server only through a fault
// proxy with 1-3 ms jitter, then with 2% cuts too (benchutil.FlakyNetwork).
// Run it alone, once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/nats/
func BenchmarkFlakyNetwork(b *testing.B) {
	benchutil.FlakyNetwork(b, benchutil.Flaky{
		Name:   "nats",
		Target: func(*testing.B) string { return srv.Addr().String() },
		Open: func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
			// The client's own pause before each reconnection (ReconnectWait
			// plus up to ReconnectJitter, 2s + 100ms by default, natstest's
			// 20ms + 100ms) is the application's choice, and with a single
			// server it pays it at every cut: 20ms and no jitter here, so
			// the figure is natsfence's cost of a cut, not the client's.
			j := jsOn(b, natstest.Connect(b, "nats://"+p.Addr(), nats.ReconnectJitter(0, 0)))
			return newAcquirer(b, j, lockBucket, nil), newWriter(b, j, writerBucket)
		},
	})
}
