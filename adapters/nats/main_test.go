package natsfence_test

import (
	"context"
	"os"
	"testing"

	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// srv is the package's one server: JetStream on, store in a temporary
// directory, a random port it binds itself.
var srv *server.Server

func TestMain(m *testing.M) {
	var stop func()
	srv, stop = natstest.StartMain()
	code := m.Run()
	stop()
	os.Exit(code)
}

// js returns a JetStream context on a client of its own.
func js(t testing.TB) jetstream.JetStream {
	t.Helper()
	return jsOn(t, natstest.Connect(t, srv.ClientURL()))
}

func jsOn(t testing.TB, nc *nats.Conn) jetstream.JetStream {
	t.Helper()
	j, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return j
}

// proxied returns a JetStream context whose client reaches the server only
// through a new faultnet proxy.
func proxied(t testing.TB) (jetstream.JetStream, *faultnet.Proxy) {
	t.Helper()
	p := faultnet.Start(t, srv.Addr().String())
	return jsOn(t, natstest.Connect(t, "nats://"+p.Addr())), p
}

// bucket returns the bucket name on j, creating it with cfg when missing.
func bucket(t testing.TB, j jetstream.JetStream, cfg jetstream.KeyValueConfig) jetstream.KeyValue {
	t.Helper()
	kv, err := j.CreateOrUpdateKeyValue(context.Background(), cfg)
	if err != nil {
		t.Fatalf("bucket %s: %v", cfg.Bucket, err)
	}
	return kv
}

var _ = fencetest.Name
