package natsfence_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/nats-io/nats.go/jetstream"
)

// TestClusterNodeRestart: on a 3-node cluster with R3 buckets, every node is
// restarted in turn (the lock bucket's stream leader first) while a lease is
// held and renewed and writes with its token go on, and a second process
// keeps trying to take the lock. No grant is made while the holder's context
// is live, every token is larger than the one before, and after the restarts
// the holder's older token is refused once a newer one has written.
func TestClusterNodeRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("a 3-node cluster")
	}
	c, lockCfg, fenceCfg, a, b, w := r3(t, "restart")
	ctx := context.Background()
	const ttl = 15 * time.Second
	holder, err := a.TryAcquire(ctx, "ledger", ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, "ledger", []byte("v0"), holder.Token()); err != nil {
		t.Fatal(err)
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var renewals, writes, tries atomic.Int64
	var mu sync.Mutex
	var renewErrs, writeErrs []error
	loop := func(f func()) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				f()
			}
		}()
	}
	// The holder renews every second (a ttl of 15s: one node's restart must
	// not cost the lease) ...
	loop(func() {
		err := holder.Renew(ctx)
		mu.Lock()
		if err != nil {
			renewErrs = append(renewErrs, err)
		} else {
			renewals.Add(1)
		}
		mu.Unlock()
		time.Sleep(time.Second) // pacing
	})
	// ... writes with its token ...
	loop(func() {
		err := w.Write(ctx, "ledger", []byte("by the holder"), holder.Token())
		mu.Lock()
		if err != nil {
			writeErrs = append(writeErrs, err)
		} else {
			writes.Add(1)
		}
		mu.Unlock()
		time.Sleep(20 * time.Millisecond) // pacing
	})
	// ... and another process tries to take the lock.
	var wrongGrants []string
	loop(func() {
		l, err := b.TryAcquire(ctx, "ledger", 5*time.Second)
		tries.Add(1)
		if err == nil {
			mu.Lock()
			if holder.Context().Err() == nil {
				wrongGrants = append(wrongGrants, "granted token "+l.Token().String()+" while the holder's context was live")
			}
			mu.Unlock()
			_ = l.Release(ctx)
		} else if !errors.Is(err, fence.ErrHeld) {
			t.Logf("TryAcquire during a restart: %v", err)
		}
		time.Sleep(50 * time.Millisecond) // pacing
	})

	order := []int{c.StreamLeader("KV_" + lockCfg.Bucket)}
	for i := range c.Nodes {
		if i != order[0] {
			order = append(order, i)
		}
	}
	for _, i := range order {
		t.Logf("restarting node %d (lock bucket leader: node %d, fence bucket leader: node %d)", i, c.StreamLeader("KV_"+lockCfg.Bucket), c.StreamLeader("KV_"+fenceCfg.Bucket))
		before := renewals.Load()
		c.Stop(i)
		time.Sleep(time.Second) // the node stays down a while: not a synchronisation
		c.Restart(i)
		// Go on once the holder has renewed after the node came back, and
		// the writer and the other process have each done a few calls
		// since then: a call caught by the restart can take seconds, and
		// the counts below must show the cluster was used around each one.
		back := time.Now()
		w0, t0 := writes.Load(), tries.Load()
		for deadline := back.Add(20 * time.Second); renewals.Load() < before+2 || writes.Load() < w0+4 || tries.Load() < t0+4; {
			if time.Now().After(deadline) || holder.Context().Err() != nil {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("during the restarts: %d renewals (%d failed), %d writes (%d failed), %d TryAcquire by the other process",
		renewals.Load(), len(renewErrs), writes.Load(), len(writeErrs), tries.Load())
	for _, err := range renewErrs {
		t.Logf("renewal: %v", err)
	}
	for _, err := range writeErrs {
		if !errors.Is(err, fence.ErrUnknown) {
			t.Errorf("a write with the holder's token during the restarts: %v (want nil, or ErrUnknown during an election)", err)
		}
	}
	for _, s := range wrongGrants {
		t.Error(s)
	}
	if holder.Context().Err() != nil {
		t.Fatalf("the holder lost its %v lease over three single-node restarts: %v", ttl, context.Cause(holder.Context()))
	}
	if renewals.Load() < 3 || writes.Load() < 10 || tries.Load() < 10 {
		t.Fatalf("too little went on during the restarts to prove anything: %d renewals, %d writes, %d tries", renewals.Load(), writes.Load(), tries.Load())
	}
	// The holder releases; the next grant is larger, writes, and the
	// holder's token is refused from then on.
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	next, err := b.TryAcquire(ctx, "ledger", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer next.Release(ctx)
	if next.Token() <= holder.Token() {
		t.Fatalf("the grant after the restarts: token %d, not above the holder's %d", next.Token(), holder.Token())
	}
	if err := w.Write(ctx, "ledger", []byte("by the next holder"), next.Token()); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, "ledger", []byte("stale"), holder.Token()); !errors.Is(err, fence.ErrStale) {
		t.Fatalf("the old token after the new holder's write: %v, want ErrStale", err)
	}
	if v, tok, err := w.Read(ctx, "ledger"); err != nil || string(v) != "by the next holder" || tok != next.Token() {
		t.Fatalf("stored %q token %d, %v", v, tok, err)
	}
}

// r3 starts a 3-node cluster with an R3 lock bucket and an R3 fence bucket
// (names ending in suffix), and returns them with an acquirer and a writer on
// one client and a second acquirer on a client of its own (another process).
func r3(t *testing.T, suffix string) (*natstest.Cluster, jetstream.KeyValueConfig, jetstream.KeyValueConfig, *natsfence.Acquirer, *natsfence.Acquirer, *natsfence.Writer) {
	t.Helper()
	c := natstest.StartCluster(t, 3)
	j := jsOn(t, natstest.Connect(t, c.URLs()))
	lockCfg := natsfence.LockBucket("locks-" + suffix)
	lockCfg.Replicas = 3
	fenceCfg := jetstream.KeyValueConfig{Bucket: "fences-" + suffix, History: 1, Replicas: 3}
	opts := &natsfence.AcquirerOptions{Timeout: 2 * time.Second, RetryFor: 10 * time.Second}
	a := newAcquirer(t, j, lockCfg, opts)
	bucket(t, j, fenceCfg)
	w, err := natsfence.NewWriter(context.Background(), j, fenceCfg.Bucket, &natsfence.WriterOptions{Timeout: 2 * time.Second, RetryFor: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	b, err := natsfence.NewAcquirer(context.Background(), jsOn(t, natstest.Connect(t, c.URLs())), lockCfg.Bucket, opts)
	if err != nil {
		t.Fatal(err)
	}
	return c, lockCfg, fenceCfg, a, b, w
}
