package etcdfence_test

import (
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
)

// BenchmarkFlakyNetwork: 8 workers x 200 locked increments of one counter
// (Acquire, Read, fenced Write, Release) with an acquirer whose client reaches
// an embedded etcd's client port only through a fault proxy with 1-3 ms
// jitter, then with 2% cuts too (benchutil.FlakyNetwork). etcd has no writer
// here: the counter is a fenced store in memory (benchutil.MemStore), so only
// the lock's requests cross the proxy. Run it alone, once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/etcd/
//
// It runs twice: with clientv3's default gRPC reconnection backoff (1s
// base, growing 1.6 times per failed dial: after a cut, every worker on the
// shared connection waits for it), and with the 20ms base that the README's
// flaky-network advice gives (clientv3.Config.DialOptions, fastReconnect).
func BenchmarkFlakyNetwork(b *testing.B) {
	c := etcdtest.Start(b, 1)
	open := func(opts ...grpc.DialOption) func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
		return func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
			cl, err := clientv3.New(clientv3.Config{Endpoints: []string{p.Addr()}, DialTimeout: 5 * time.Second,
				Logger: zap.NewNop(), DialOptions: opts})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { cl.Close() })
			a, err := etcdfence.NewAcquirer(cl, nil)
			if err != nil {
				b.Fatal(err)
			}
			return a, &benchutil.MemStore{}
		}
	}
	flaky := benchutil.Flaky{
		Name:   "etcd",
		Target: func(*testing.B) string { return c.ClientAddr(0) },
		// A lost reply's connection is cut 20ms after its request (about
		// two of etcd's write round trips through the jitter here): the
		// first bytes back on the shared HTTP/2 connection need not be its
		// reply (faultnet.ReplyWindow). On the other backends the cut
		// comes with the reply, one round trip after the request.
		ReplyWindow: 20 * time.Millisecond,
		Open:        open(),
	}
	fast := flaky
	fast.Name, fast.Open = "etcd-fast-reconnect", open(fastReconnect)
	benchutil.FlakyNetwork(b, flaky, fast)
}

// fastReconnect is the README's advice for a client on a flaky network: a
// reconnection backoff from 20ms (gRPC's default starts at 1s).
var fastReconnect = grpc.WithConnectParams(grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
	MinConnectTimeout: 2 * time.Second,
})
