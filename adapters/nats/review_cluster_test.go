package natsfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/nats-io/nats.go/jetstream"
)

// TestClusterPartitionedHolder: on a 3-node cluster with R3 buckets, a holder
// whose client reaches one node through the fault proxy is partitioned away
// while it renews and writes with its token. Another process waiting on
// another node is granted only after the holder's context is done, with a
// larger token; the holder's renewal and write held by the partition and
// delivered after the heal change nothing: the renewal does not take the new
// holder's key, the old token is refused, and the new holder renews.
func TestClusterPartitionedHolder(t *testing.T) {
	if testing.Short() {
		t.Skip("a 3-node cluster")
	}
	c := natstest.StartCluster(t, 3)
	ctx := context.Background()
	lockCfg := natsfence.LockBucket("locks-part")
	lockCfg.Replicas = 3
	fenceCfg := jetstream.KeyValueConfig{Bucket: "fences-part", History: 1, Replicas: 3}
	opts := &natsfence.Options{Timeout: time.Second, RetryFor: 3 * time.Second}
	wopts := &natsfence.WriterOptions{Timeout: time.Second, RetryFor: 3 * time.Second}

	p := faultnet.Start(t, c.ClientAddr(0))
	hj := jsOn(t, natstest.Connect(t, "nats://"+p.Addr()))
	bj := jsOn(t, natstest.Connect(t, "nats://"+c.ClientAddr(1)))
	bucket(t, bj, lockCfg)
	bucket(t, bj, fenceCfg)
	a, err := natsfence.New(ctx, hj, lockCfg.Bucket, opts)
	if err != nil {
		t.Fatal(err)
	}
	hw, err := natsfence.NewWriter(ctx, hj, fenceCfg.Bucket, wopts)
	if err != nil {
		t.Fatal(err)
	}
	b, err := natsfence.New(ctx, bj, lockCfg.Bucket, opts)
	if err != nil {
		t.Fatal(err)
	}
	bw, err := natsfence.NewWriter(ctx, bj, fenceCfg.Bucket, wopts)
	if err != nil {
		t.Fatal(err)
	}

	holder, err := a.TryAcquire(ctx, "job", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := hw.Write(ctx, "job", []byte("old"), holder.Token()); err != nil {
		t.Fatal(err)
	}
	p.Partition()
	renewed := make(chan error, 1)
	go func() { renewed <- holder.Renew(ctx) }()

	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	l2, err := b.Acquire(wctx, "job", 5*time.Second)
	if err != nil {
		t.Fatalf("the waiter on another node: %v", err)
	}
	defer func() { _ = l2.Release(ctx) }()
	if holder.Context().Err() == nil {
		t.Fatalf("granted token %d while the partitioned holder's context (token %d) is live", l2.Token(), holder.Token())
	}
	if l2.Token() <= holder.Token() {
		t.Fatalf("token %d not above the holder's %d", l2.Token(), holder.Token())
	}
	if err := bw.Write(ctx, "job", []byte("new"), l2.Token()); err != nil {
		t.Fatal(err)
	}
	if err := <-renewed; err == nil {
		t.Fatalf("the partitioned holder's renewal: nil")
	}
	written := make(chan error, 1)
	go func() { written <- hw.Write(ctx, "job", []byte("stale"), holder.Token()) }()
	p.Heal()
	if err := <-written; err == nil {
		t.Fatalf("a write with the old token %d after %d: accepted", holder.Token(), l2.Token())
	}
	if err := holder.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("the old holder's renewal after the heal: %v, want ErrLost", err)
	}
	if err := l2.Renew(ctx); err != nil {
		t.Fatalf("the new holder's renewal after the heal: %v", err)
	}
	if _, err := a.TryAcquire(ctx, "job", 2*time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("TryAcquire while the new holder holds: %v", err)
	}
	if v, tok, err := bw.Read(ctx, "job"); err != nil || string(v) != "new" || tok != l2.Token() {
		t.Fatalf("Read = %q %d %v, want new %d", v, tok, err, l2.Token())
	}
}
