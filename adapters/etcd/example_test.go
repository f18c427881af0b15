package etcdfence_test

import (
	"context"
	"log"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
)

// A lock whose tokens are etcd revisions: they survive the loss of a minority
// of members with no clock assumption. The protected write goes to any fenced
// writer (here a function standing for one). It needs an etcd cluster, so it
// is compiled but not run.
func ExampleNewAcquirer() {
	ctx := context.Background()
	cl, err := clientv3.New(clientv3.Config{Endpoints: []string{"127.0.0.1:2379"}, DialTimeout: 5 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	locks, err := etcdfence.NewAcquirer(cl, nil)
	if err != nil {
		log.Fatal(err)
	}
	var rows fence.FencedWriter // for example a sqlfence.Writer on the database you protect
	err = fence.Hold(ctx, locks, "invoice-run", 30*time.Second, func(ctx context.Context, l fence.Lease) error {
		if rows == nil {
			return nil
		}
		return rows.Write(ctx, "invoice-42", []byte("sent"), l.Token())
	})
	if err != nil {
		log.Fatal(err)
	}
}

// A client for a network that cuts connections: gRPC dials again after a cut
// only after its reconnection backoff, which starts at 1s, and every waiter on
// the connection waits with it. BenchmarkFlakyNetwork measures this setting
// against the default.
func ExampleNewAcquirer_flakyNetwork() {
	cl, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{"127.0.0.1:2379"},
		DialTimeout: 5 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
			MinConnectTimeout: 2 * time.Second,
		})},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	locks, err := etcdfence.NewAcquirer(cl, nil)
	if err != nil {
		log.Fatal(err)
	}
	_ = locks
}
