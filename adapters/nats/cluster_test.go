package natsfence_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/nats-io/nats.go/jetstream"
)

// TestClusterLeaderLoss runs on a 3-node JetStream cluster with R3 buckets.
// A lease is held and writes go on; the stream leader of the lock bucket (and
// of the fence bucket) is killed. The cut-off holder does not renew. It checks:
// no call hangs during the election (each returns within its RetryFor); the
// holder's context is done before the next grant; every token granted is
// larger than every earlier one; no write with an older token is accepted
// after a newer one; a node restarted rejoins and grants go on.
func TestClusterLeaderLoss(t *testing.T) {
	if testing.Short() {
		t.Skip("a 3-node cluster")
	}
	c, lockCfg, fenceCfg, a, b, w := r3(t, "r3")
	// A client of its own for the diagnostics when no grant comes.
	nc := natstest.Connect(t, c.URLs())
	j := jsOn(t, nc)
	ctx := context.Background()

	// 8s: the holder's key must outlive the node's kill and the
	// TryAcquire during the election below, which a loaded run (two busy
	// loops beside it) stretched past a 3s lease.
	const holderTTL = 8 * time.Second
	holderSent := time.Now()
	holder, err := a.TryAcquire(ctx, "report", holderTTL)
	if err != nil {
		t.Fatal(err)
	}
	tokens := []fence.Token{holder.Token()}
	if err := w.Write(ctx, "report", []byte("by the first holder"), holder.Token()); err != nil {
		t.Fatal(err)
	}

	// Writes go on with the holder's token while the leaders change.
	stopWrites := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var writeErrs []error
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stopWrites:
				return
			default:
			}
			start := time.Now()
			err := w.Write(ctx, "report", []byte("by the first holder, during the election"), holder.Token())
			if d := time.Since(start); d > 15*time.Second {
				t.Errorf("a write during the election took %v (RetryFor 10s): a hang", d)
			}
			mu.Lock()
			writeErrs = append(writeErrs, err)
			mu.Unlock()
			time.Sleep(10 * time.Millisecond) // pacing, not synchronisation
		}
	}()

	type grant struct {
		l  fence.Lease
		at time.Time
		// holderDone: the cut-off holder's context was done when the grant returned.
		holderDone bool
		err        error
	}
	next := make(chan grant, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		for {
			l, err := b.Acquire(wctx, "report", 5*time.Second)
			if err == nil || wctx.Err() != nil {
				next <- grant{l: l, at: time.Now(), holderDone: holder.Context().Err() != nil, err: err}
				return
			}
			// An error during the election (not ErrHeld): clear, and retried.
			t.Logf("Acquire during the election: %v", err)
		}
	}()

	// Kill one node (two of three would leave no quorum): the lock bucket's
	// stream leader. The fence bucket loses a replica, and its leader too
	// when that node led both.
	lockStream, fenceStream := "KV_"+lockCfg.Bucket, "KV_"+fenceCfg.Bucket
	leader := c.StreamLeader(lockStream)
	if leader < 0 {
		t.Fatalf("no leader for %s", lockStream)
	}
	t.Logf("killing node %d, leader of %s (leader of %s: node %d)", leader, lockStream, fenceStream, c.StreamLeader(fenceStream))
	c.Stop(leader)
	// What a client sees during the election: an answer or a clear error in bounded time.
	start := time.Now()
	_, err = b.TryAcquire(ctx, "report", 5*time.Second)
	t.Logf("TryAcquire during the election: %v after %v", err, time.Since(start))
	if err == nil {
		// The key cannot expire before holderTTL has passed since its
		// create was sent: a grant back before then is two holders.
		t.Fatalf("granted %v after the first holder's %v key was created: while it had not expired", time.Since(holderSent), holderTTL)
	}
	if time.Since(start) > 15*time.Second {
		t.Errorf("TryAcquire during the election took %v", time.Since(start))
	}

	g := <-next
	if g.err != nil {
		st, _ := j.Stream(ctx, lockStream)
		m, merr := st.GetLastMsgForSubject(ctx, "$KV."+lockCfg.Bucket+".report")
		if merr == nil {
			t.Logf("the lock key: seq %d stored %v (%v ago), headers %v", m.Sequence, m.Time, time.Since(m.Time), m.Header)
		} else {
			t.Logf("the lock key: %v", merr)
		}
		resp, rerr := nc.Request("$JS.API.STREAM.MSG.GET."+lockStream, []byte(`{"last_by_subj":"$KV.`+lockCfg.Bucket+`.report"}`), 5*time.Second)
		if rerr == nil {
			t.Logf("leader get: %s", resp.Data)
		} else {
			t.Logf("leader get: %v", rerr)
		}
		t.Fatalf("no grant after the leader loss: %v", g.err)
	}
	if !g.holderDone {
		t.Error("the next holder was granted while the cut-off holder's context was live")
	}
	if !errors.Is(context.Cause(holder.Context()), fence.ErrLost) {
		t.Errorf("cut-off holder's context cause: %v", context.Cause(holder.Context()))
	}
	tokens = append(tokens, g.l.Token())
	if err := w.Write(ctx, "report", []byte("by the second holder"), g.l.Token()); err != nil {
		t.Fatalf("the new holder's write: %v", err)
	}
	close(stopWrites)
	wg.Wait()
	// After the new holder's write, the old token is refused.
	if err := w.Write(ctx, "report", []byte("stale"), holder.Token()); !errors.Is(err, fence.ErrStale) {
		t.Errorf("the old holder's write after the new holder's: %v, want ErrStale", err)
	}
	mu.Lock()
	var ok, unknown, stale, other int
	for _, err := range writeErrs {
		switch {
		case err == nil:
			ok++
		case errors.Is(err, fence.ErrUnknown):
			unknown++
		case errors.Is(err, fence.ErrStale):
			stale++
		default:
			other++
			t.Logf("write during the election: %v", err)
		}
	}
	mu.Unlock()
	t.Logf("writes with the first token during the election: %d ok, %d unknown, %d stale, %d other", ok, unknown, stale, other)
	if err := holder.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("the old holder's Release: %v, want ErrLost", err)
	}
	if err := g.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// The killed nodes come back; grants go on with larger tokens.
	for i, s := range c.Nodes {
		if s == nil {
			c.Restart(i)
		}
	}
	for i := 0; i < 5; i++ {
		l, err := a.TryAcquire(ctx, "report", 3*time.Second)
		if err != nil {
			t.Fatalf("grant %d after the restart: %v", i, err)
		}
		tokens = append(tokens, l.Token())
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for i := 1; i < len(tokens); i++ {
		if tokens[i] <= tokens[i-1] {
			t.Fatalf("tokens %v: grant %d is not above the one before", tokens, i)
		}
	}
	// Now the fence bucket's leader: writes with the current token during
	// its election end in bounded time, nil or an error (ErrUnknown when
	// the outcome is open), and the old token stays refused afterwards.
	fl := c.StreamLeader(fenceStream)
	if fl < 0 {
		t.Fatalf("no leader for %s", fenceStream)
	}
	t.Logf("killing node %d, leader of %s", fl, fenceStream)
	c.Stop(fl)
	for i := 0; i < 20; i++ {
		start := time.Now()
		err := w.Write(ctx, "report", []byte("by the second holder"), g.l.Token())
		if d := time.Since(start); d > 15*time.Second {
			t.Errorf("a write during the fence bucket's election took %v", d)
		}
		if err != nil {
			t.Logf("write during the fence bucket's election: %v", err)
		}
	}
	if err := w.Write(ctx, "report", []byte("stale"), holder.Token()); !errors.Is(err, fence.ErrStale) {
		t.Errorf("the old holder's write after the fence leader's loss: %v, want ErrStale", err)
	}
	c.Restart(fl)
	v, tok, err := w.Read(ctx, "report")
	if err != nil || string(v) != "by the second holder" || tok != g.l.Token() {
		t.Errorf("stored %q token %d, %v", v, tok, err)
	}
}

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
	opts := &natsfence.AcquirerOptions{Timeout: time.Second, RetryFor: 3 * time.Second}
	wopts := &natsfence.WriterOptions{Timeout: time.Second, RetryFor: 3 * time.Second}

	p := faultnet.Start(t, c.ClientAddr(0))
	hj := jsOn(t, natstest.Connect(t, "nats://"+p.Addr()))
	bj := jsOn(t, natstest.Connect(t, "nats://"+c.ClientAddr(1)))
	bucket(t, bj, lockCfg)
	bucket(t, bj, fenceCfg)
	a, err := natsfence.NewAcquirer(ctx, hj, lockCfg.Bucket, opts)
	if err != nil {
		t.Fatal(err)
	}
	hw, err := natsfence.NewWriter(ctx, hj, fenceCfg.Bucket, wopts)
	if err != nil {
		t.Fatal(err)
	}
	b, err := natsfence.NewAcquirer(ctx, bj, lockCfg.Bucket, opts)
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
