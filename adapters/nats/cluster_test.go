package natsfence_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
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
	c := cluster3(t)
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

// TestRenewAcrossLeaderChangesKeepsHealthyLease: on a 3-node cluster with an
// R3 lock bucket, a connected holder renews its lease back to back while the
// lock bucket's stream leader steps down again and again, and once is
// killed. No Renew may report the lease lost (ErrLost) while the server
// still holds the holder's entry: each read and publish is answered by a
// leader, or fails as unknown and is retried. Nobody else is granted the
// name while the holder's context is live.
func TestRenewAcrossLeaderChangesKeepsHealthyLease(t *testing.T) {
	c, lockCfg, _, a, b, _ := r3(t, "renew-stepdown")
	nc := natstest.Connect(t, c.URLs())
	ctx := context.Background()
	const ttl = 8 * time.Second
	name := "renewed-through-elections"
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	stream := "KV_" + lockCfg.Bucket
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var renewErrs []string
	lost := make(chan error, 1)
	untilStopped(&wg, stop, func() bool {
		rctx, cancel := context.WithTimeout(ctx, ttl/3)
		err := l.Renew(rctx)
		cancel()
		if err != nil {
			mu.Lock()
			renewErrs = append(renewErrs, err.Error())
			mu.Unlock()
		}
		if errors.Is(err, fence.ErrLost) {
			lost <- err
			return false
		}
		time.Sleep(20 * time.Millisecond) // pacing
		return true
	})
	// Others try the name all along: none may be granted while the holder's
	// context is live.
	twoHolders := make(chan string, 1)
	untilStopped(&wg, stop, func() bool {
		lb, err := b.TryAcquire(ctx, name, ttl)
		if err == nil {
			live := l.Context().Err() == nil
			_ = lb.Release(ctx)
			if live {
				twoHolders <- fmt.Sprintf("granted token %d while the holder's (token %d) context is live", lb.Token(), l.Token())
				return false
			}
		}
		time.Sleep(100 * time.Millisecond) // pacing
		return true
	})
	check := func() {
		select {
		case err := <-lost:
			info, ierr := b.Inspect(ctx, name)
			t.Fatalf("a renewal during the elections reported the lease lost: %v; the server's lock then: held %v token %d (the holder's %d) time left %v, %v; renewal errors so far: %q",
				err, info.Held, info.Token, l.Token(), info.TimeLeft, ierr, renewErrs)
		case s := <-twoHolders:
			t.Fatal("two holders: " + s)
		default:
		}
	}
	defer func() { close(stop); wg.Wait() }()
	for i := 0; i < 12; i++ {
		_, err := nc.Request("$JS.API.STREAM.LEADER.STEPDOWN."+stream, nil, 5*time.Second)
		if err != nil {
			t.Logf("step down %d: %v", i, err)
		}
		time.Sleep(700 * time.Millisecond) // between elections
		check()
	}
	leader := c.StreamLeader(stream)
	if leader >= 0 {
		t.Logf("killing node %d, the leader of %s", leader, stream)
		c.Stop(leader)
		for end := time.Now().Add(6 * time.Second); time.Now().Before(end); {
			time.Sleep(100 * time.Millisecond)
			check()
		}
		c.Restart(leader)
	}
	for end := time.Now().Add(4 * time.Second); time.Now().Before(end); {
		time.Sleep(100 * time.Millisecond)
		check()
	}
	if err := l.Context().Err(); err != nil {
		t.Fatalf("the holder's context ended: %v; renewal errors: %q", context.Cause(l.Context()), renewErrs)
	}
	mu.Lock()
	t.Logf("renewal errors during the elections: %d %q", len(renewErrs), renewErrs)
	mu.Unlock()
	_ = natsfence.MinTTL
}

// TestClusterNodeRestart: on a 3-node cluster with R3 buckets, every node is
// restarted in turn (the lock bucket's stream leader first) while a lease is
// held and renewed and writes with its token go on, and a second process
// keeps trying to take the lock. No grant is made while the holder's context
// is live, every token is larger than the one before, and after the restarts
// the holder's older token is refused once a newer one has written.
func TestClusterNodeRestart(t *testing.T) {
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
	loop := func(f func()) { untilStopped(&wg, stop, func() bool { f(); return true }) }
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
	c := cluster3(t)
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

// TestClusterStoreLeaderLoss: on a 3-node cluster with an R3 bucket, Do goes
// on over 40 keys (each called twice) while the bucket's stream leader is
// killed. Every effect runs at most once, no Do hangs past its bound, and a
// Do that returned its effect's result left the key completed with it, as
// the new leader holds it.
func TestClusterStoreLeaderLoss(t *testing.T) {
	c := cluster3(t)
	j := jsOn(t, natstest.Connect(t, c.URLs()))
	cfg := natsfence.LockBucket("idem-r3")
	cfg.Replicas = 3
	o := &natsfence.IdempotencyOptions{Timeout: time.Second, RetryFor: 10 * time.Second}
	s := newStoreOpts(t, j, cfg, o)
	const keys = 40
	var runs [keys]atomic.Int32
	var done [keys]atomic.Bool
	var wg sync.WaitGroup
	var mu sync.Mutex
	outcomes := map[string]int{}
	// Key 5's first effect holds its Do open until the leader's shutdown is
	// over, so at least one Do straddles the kill whatever the scheduling.
	inEffect, killDone := make(chan struct{}), make(chan struct{})
	var killed atomic.Int64    // when the leader's shutdown began, unix ns
	var straddled atomic.Int32 // Do calls under way when it began
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range keys {
			k := fmt.Sprintf("order-%d", i)
			for attempt := range 2 {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				begun := time.Now()
				r, err := idempotency.Do(ctx, s, k, "fp", func(context.Context, string) ([]byte, error) {
					runs[i].Add(1)
					if i == 5 && attempt == 0 {
						close(inEffect)
						<-killDone
					}
					return []byte(k), nil
				}, &idempotency.Options{Lease: 5 * time.Second})
				cancel()
				if kt := killed.Load(); kt != 0 && begun.UnixNano() < kt && time.Now().UnixNano() > kt {
					straddled.Add(1)
				}
				if d := time.Since(begun); d > 25*time.Second {
					t.Errorf("Do(%s) took %v: a hang", k, d)
				}
				mu.Lock()
				switch {
				case err == nil && string(r.Value) == k:
					done[i].Store(true)
					outcomes["ok"]++
				case err == nil:
					t.Errorf("Do(%s) returned %q", k, r.Value)
				case errors.Is(err, idempotency.ErrInProgress):
					outcomes["in progress"]++
				default:
					outcomes["error"]++
					t.Logf("Do(%s) during the election: %v", k, err)
				}
				mu.Unlock()
			}
		}
	}()
	<-inEffect
	leader := c.StreamLeader("KV_" + cfg.Bucket)
	if leader < 0 {
		t.Fatal("no stream leader")
	}
	t.Logf("killing node %d, the bucket's stream leader", leader)
	killed.Store(time.Now().UnixNano())
	c.Stop(leader)
	close(killDone)
	wg.Wait()
	t.Logf("outcomes of %d Do calls: %v; %d under way when the leader went down", 2*keys, outcomes, straddled.Load())
	if straddled.Load() == 0 {
		t.Fatal("no Do call was under way when the leader went down: the case proved nothing")
	}
	check := newStoreOpts(t, jsOn(t, natstest.Connect(t, c.URLs())), cfg, o)
	for i := range keys {
		k := fmt.Sprintf("order-%d", i)
		if n := runs[i].Load(); n > 1 {
			t.Errorf("%s: the effect ran %d times", k, n)
		}
		if !done[i].Load() {
			continue
		}
		rec, err := check.Get(context.Background(), k)
		if err != nil || rec.State != idempotency.Completed || string(rec.Result) != k {
			t.Errorf("%s: Do returned its result, but the record is %+v, %v", k, rec, err)
		}
	}
	if outcomes["ok"] < keys {
		t.Errorf("only %d of %d keys completed", outcomes["ok"], keys)
	}
}

// cluster3 starts a 3-node cluster, or skips t in -short mode.
func cluster3(t *testing.T) *natstest.Cluster {
	t.Helper()
	if testing.Short() {
		t.Skip("a 3-node cluster")
	}
	return natstest.StartCluster(t, 3)
}

// untilStopped runs f again and again in a goroutine of wg until stop is
// closed or f returns false.
func untilStopped(wg *sync.WaitGroup, stop <-chan struct{}, f func() bool) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if !f() {
				return
			}
		}
	}()
}
