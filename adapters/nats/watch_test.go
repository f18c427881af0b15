package natsfence_test

// The waiting Acquire's watch: a watch request unanswered within
// Options.Timeout is given up and asked again (watchOnce). Each test drives
// waiters against the real in-process server(s), with the consumer-create
// requests of the waiter's client held back selectively (slowCreates: a
// dialer whose connection delays only the client's
// $JS.API.CONSUMER.CREATE publishes, everything else passes at once), a
// faultnet proxy, or a 3-node cluster.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// slowCreates is a nats.CustomDialer whose connections hold back every
// consumer-create request the client sends (PUB/HPUB to
// $JS.API.CONSUMER.CREATE.…) for a delay, then send it; every other command
// is sent at once. The server thus answers watch requests late, and only
// them, the way a busy meta leader would.
type slowCreates struct {
	delay   atomic.Int64 // nanoseconds; 0: no delay; <0: held until flush
	jitter  atomic.Int64 // nanoseconds added at random in [0, jitter)
	creates atomic.Int64 // consumer-create requests seen
	sent    atomic.Int64 // consumer-create requests sent on to the server
	mu      sync.Mutex
	flush   chan struct{} // closed to send what is held now
}

func newSlowCreates(d time.Duration) *slowCreates {
	s := &slowCreates{flush: make(chan struct{})}
	s.delay.Store(int64(d))
	return s
}

func (s *slowCreates) Dial(network, address string) (net.Conn, error) {
	c, err := net.DialTimeout(network, address, 2*time.Second)
	if err != nil {
		return nil, err
	}
	return &slowConn{Conn: c, s: s}, nil
}

// release sends what is held now, and from now on delays by d.
func (s *slowCreates) release(d time.Duration) {
	s.delay.Store(int64(d))
	s.mu.Lock()
	close(s.flush)
	s.flush = make(chan struct{})
	s.mu.Unlock()
}

func (s *slowCreates) flushed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.flush
}

type slowConn struct {
	net.Conn
	s   *slowCreates
	pmu sync.Mutex // the parse buffer
	buf []byte
	wmu sync.Mutex // writes to Conn
}

var createPrefix = []byte("$JS.API.CONSUMER.CREATE.")

func (c *slowConn) Write(b []byte) (int, error) {
	c.pmu.Lock()
	defer c.pmu.Unlock()
	c.buf = append(c.buf, b...)
	for {
		i := bytes.Index(c.buf, []byte("\r\n"))
		if i < 0 {
			break
		}
		n := i + 2
		f := bytes.Fields(c.buf[:i])
		create := false
		if len(f) >= 3 {
			op := string(bytes.ToUpper(f[0]))
			if op == "PUB" || op == "HPUB" {
				size, err := strconv.Atoi(string(f[len(f)-1]))
				if err != nil {
					return 0, fmt.Errorf("slowConn: %q: %v", c.buf[:i], err)
				}
				if len(c.buf) < n+size+2 {
					break // the payload is not all here yet
				}
				n += size + 2
				create = bytes.HasPrefix(f[1], createPrefix)
			}
		}
		cmd := append([]byte(nil), c.buf[:n]...)
		c.buf = c.buf[n:]
		if create {
			c.s.creates.Add(1)
			if d := time.Duration(c.s.delay.Load()); d != 0 {
				if j := c.s.jitter.Load(); j > 0 && d > 0 {
					d += time.Duration(time.Now().UnixNano() % j)
				}
				flush := c.s.flushed()
				go func() {
					if d > 0 {
						tm := time.NewTimer(d)
						defer tm.Stop()
						select {
						case <-tm.C:
						case <-flush:
						}
					} else {
						<-flush
					}
					c.wmu.Lock()
					_, _ = c.Conn.Write(cmd)
					c.wmu.Unlock()
					c.s.sent.Add(1)
				}()
				continue
			}
			c.s.sent.Add(1)
		}
		c.wmu.Lock()
		_, err := c.Conn.Write(cmd)
		c.wmu.Unlock()
		if err != nil {
			return 0, err
		}
	}
	return len(b), nil
}

// slowWaiter returns an Acquirer on bucket cfg (created when missing) whose
// client goes through s, and that client.
func slowWaiter(t *testing.T, s *slowCreates, cfg jetstream.KeyValueConfig, o *natsfence.AcquirerOptions) (*natsfence.Acquirer, *nats.Conn) {
	t.Helper()
	nc := natstest.Connect(t, srv.ClientURL(), nats.SetCustomDialer(s))
	j := jsOn(t, nc)
	return newAcquirer(t, j, cfg, o), nc
}

// streamConsumers counts the consumers of the bucket's stream.
func streamConsumers(t *testing.T, j jetstream.JetStream, cfg jetstream.KeyValueConfig) int {
	t.Helper()
	st, err := j.Stream(context.Background(), "KV_"+cfg.Bucket)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Consumers
}

// settles waits up to within for nothing of the waiters to be left: no
// acquirer goroutine beyond n0, no subscription on nc beyond s0, no consumer
// on the bucket beyond c0. It returns how long that took.
func settles(t *testing.T, direct jetstream.JetStream, cfg jetstream.KeyValueConfig, nc *nats.Conn, n0, s0, c0 int, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		n, where := acquirerGoroutines()
		s, cs := nc.NumSubscriptions(), streamConsumers(t, direct, cfg)
		if n <= n0 && s <= s0 && cs <= c0 {
			return time.Since(start)
		}
		if time.Since(start) > within {
			t.Fatalf("%v after the waits ended: %d acquirer goroutines (before %d) %s, subscriptions %d (before %d), consumers %d (before %d)", within, n, n0, where, s, s0, cs, c0)
		}
		time.Sleep(50 * time.Millisecond) // polling counts
	}
}

// TestWatchSlowAnswer: the server answers every watch request of
// the waiter's client 3 Timeouts late (a busy meta leader; the answer does
// come). With each request given up after Timeout and asked again with the
// same Timeout, every answer came after its request was given up, the waiter
// never had a watch (17 requests, 8 orphan consumers), and a release woke it
// only at its Recheck. Each unanswered request now gives the next twice the
// time, and the waiter is granted promptly after the release.
func TestWatchSlowAnswer(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-watch-slow")
	const timeout = 400 * time.Millisecond
	s := newSlowCreates(3 * timeout)
	direct := js(t)
	holder := newAcquirer(t, direct, cfg, nil)
	waiter, _ := slowWaiter(t, s, cfg, &natsfence.AcquirerOptions{Timeout: timeout, Recheck: time.Minute, MaxWait: 2 * time.Minute})
	name, key, h, waiting := holdForWaiter(t, holder, "slowwatch", 60*time.Second)
	wctx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	res := goAcquire(wctx, waiter, name, 10*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	// The first request reaches the server 3 Timeouts after it was made:
	// a request never given up would make that answer the watch, however
	// late.
	for giveUp := time.Now().Add(10 * time.Second); s.sent.Load() < 1; {
		if time.Now().After(giveUp) {
			t.Fatal("no watch request reached the server within 10s")
		}
		time.Sleep(5 * time.Millisecond) // polling a counter
	}
	released := time.Now()
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-res:
		if r.err != nil {
			t.Fatal(r.err)
		}
		defer r.l.Release(ctx)
		if r.l.Token() <= h.Token() {
			t.Fatalf("token %d after %d", r.l.Token(), h.Token())
		}
		t.Logf("granted %v after the release; %d watch requests", r.at.Sub(released), s.creates.Load())
	case <-time.After(10 * time.Second):
		t.Fatalf("a waiter (Timeout %v, Recheck 1m) whose watch requests are answered %v late was not granted within 10s of the release: "+
			"it made %d watch requests, gave each up after Timeout, and never had a watch; %d consumers on the bucket (left by the late answers)",
			timeout, 3*timeout, s.creates.Load(), streamConsumers(t, direct, cfg))
	}
}

// TestWatchCancelWhilePending: the waiter's watch request is held
// (no answer) when the Acquire's ctx is cancelled. Acquire returns at once
// with ErrHeld and context.Canceled; once the held request reaches the
// server (its consumer is made, with nobody to deliver to), nothing of the
// waiter is left: no acquirer goroutine, no subscription on its client, and
// no consumer on the bucket past the server's inactivity threshold.
func TestWatchCancelWhilePending(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-watch-cancel")
	const timeout = 500 * time.Millisecond
	s := newSlowCreates(-1) // held until released
	direct := js(t)
	holder := newAcquirer(t, direct, cfg, nil)
	waiter, nc := slowWaiter(t, s, cfg, &natsfence.AcquirerOptions{Timeout: timeout, Recheck: time.Minute})
	name, key, h, waiting := holdForWaiter(t, holder, "cancelpending", 60*time.Second)
	defer h.Release(ctx)
	n0, _ := acquirerGoroutines()
	s0, c0 := nc.NumSubscriptions(), streamConsumers(t, direct, cfg)
	for round := range 3 {
		wctx, cancel := context.WithCancel(ctx)
		before := s.creates.Load()
		res := goAcquire(wctx, waiter, name, 10*time.Second)
		waitKeyA(t, waiting, key, res, "the waiter never waited")
		// Cancel while a request is unanswered: the first one (round 0),
		// or one asked again after Timeout (rounds 1, 2).
		for giveUp := time.Now().Add(10 * time.Second); s.creates.Load() < before+int64(round)+1; {
			if time.Now().After(giveUp) {
				t.Fatalf("round %d: %d watch requests in 10s, want %d", round, s.creates.Load()-before, round+1)
			}
			time.Sleep(2 * time.Millisecond) // polling a counter
		}
		cancelled := time.Now()
		cancel()
		select {
		case r := <-res:
			if r.l != nil || !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
				t.Fatalf("round %d: Acquire cancelled while its watch request was unanswered: %v, %v; want ErrHeld and Canceled", round, r.l, r.err)
			}
			if d := r.at.Sub(cancelled); d > 2*time.Second {
				t.Fatalf("round %d: Acquire returned %v after its cancel", round, d)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: Acquire did not return within 10s of its cancel while its watch request was unanswered", round)
		}
	}
	made := s.creates.Load()
	s.release(0) // the held requests reach the server: consumers nobody listens on
	took := settles(t, direct, cfg, nc, n0, s0, c0, 20*time.Second)
	t.Logf("%d watch requests; all gone %v after they reached the server", made, took)
}

// TestWatchManyWaitersThroughFaults: 20 waiters on one name, and then
// 20 waiters on 20 names, all on one client whose watch requests are
// answered between 0.5 and 1.5 Timeouts late (about half given up, some as
// the answer comes: the stopWatch path), through a proxy that cuts every
// connection and then holds all bytes for a second while the holders
// release. Once healed, every waiter is granted (Recheck a minute), the
// grants on one name never overlap and their tokens grow, and nothing of
// the waiters is left once they released.
func TestWatchManyWaitersThroughFaults(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-watch-many")
	const timeout = 500 * time.Millisecond
	s := newSlowCreates(timeout / 2)
	s.jitter.Store(int64(timeout))
	direct := js(t)
	holder := newAcquirer(t, direct, cfg, nil)
	p := faultnet.Start(t, srv.Addr().String())
	nc := natstest.Connect(t, "nats://"+p.Addr(), nats.SetCustomDialer(s))
	waiter := newAcquirer(t, jsOn(t, nc), cfg, &natsfence.AcquirerOptions{Timeout: timeout, Recheck: time.Minute, MaxWait: 2 * time.Minute})
	waiting := waitingHook(t)
	n0, _ := acquirerGoroutines()
	s0, c0 := nc.NumSubscriptions(), streamConsumers(t, direct, cfg)
	const n = 20
	for _, many := range []bool{false, true} {
		names := make([]string, n)
		keys := map[string]bool{}
		holds := map[string]fence.Lease{}
		for i := range names {
			if many || i == 0 {
				names[i] = fencetest.Name(fmt.Sprintf("many%d-", i))
				h, err := holder.TryAcquire(ctx, names[i], 60*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				holds[names[i]] = h
				keys[natsfence.EncodeKey(names[i])] = true
			} else {
				names[i] = names[0]
			}
		}
		var (
			mu     sync.Mutex
			inside = map[string]int{}
			last   = map[string]fence.Token{}
			errs   []error
			wg     sync.WaitGroup
		)
		for name, h := range holds {
			last[name] = h.Token()
		}
		wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		defer cancel()
		granted := make(chan time.Time, n)
		for i := range n {
			wg.Add(1)
			go func(name string) {
				defer wg.Done()
				l, err := waiter.Acquire(wctx, name, 10*time.Second)
				mu.Lock()
				if err != nil {
					errs = append(errs, fmt.Errorf("%s: %w", name, err))
					mu.Unlock()
					return
				}
				granted <- time.Now()
				if inside[name]++; inside[name] != 1 {
					errs = append(errs, fmt.Errorf("%s: %d holders at once", name, inside[name]))
				}
				if l.Token() <= last[name] {
					errs = append(errs, fmt.Errorf("%s: token %d after %d", name, l.Token(), last[name]))
				}
				last[name] = l.Token()
				inside[name]--
				mu.Unlock()
				if err := l.Release(ctx); err != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("%s: release: %w", name, err))
					mu.Unlock()
				}
			}(names[i])
		}
		for seen := 0; seen < n; {
			select {
			case k := <-waiting:
				if keys[k] {
					seen++
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("many=%v: only %d of %d waiters began to wait within 30s", many, seen, n)
			}
		}
		// The faults: every connection cut (every waiter watches anew),
		// then all bytes held for a second while the holders release.
		reconnects := nc.Stats().Reconnects
		p.CutAll()
		for giveUp := time.Now().Add(10 * time.Second); !nc.IsConnected() || nc.Stats().Reconnects == reconnects; {
			if time.Now().After(giveUp) {
				t.Fatal("not connected again within 10s of the cut")
			}
			time.Sleep(time.Millisecond) // polling the client's state
		}
		p.Partition()
		for _, h := range holds {
			if err := h.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(time.Second) // the partition's duration
		p.Heal()
		healed := time.Now()
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("many=%v: %d of %d waiters granted within 30s of the heal (Recheck 1m); %d watch requests", many, len(granted), n, s.creates.Load())
		}
		mu.Lock()
		for _, err := range errs {
			t.Error(err)
		}
		mu.Unlock()
		var lastAt time.Time
		for range n {
			if at := <-granted; at.After(lastAt) {
				lastAt = at
			}
		}
		t.Logf("many=%v: all %d granted within %v of the heal; %d watch requests so far", many, n, lastAt.Sub(healed), s.creates.Load())
	}
	took := settles(t, direct, cfg, nc, n0, s0, c0, 20*time.Second)
	t.Logf("all gone %v after the last release", took)
}

// TestWatchAcrossLossOfFollowerNode: on a 3-node cluster, holder and waiter
// on different nodes (Timeout 2s, Recheck a minute), the node under the
// waiter, which leads neither the JetStream meta group nor the bucket's
// stream, stops. The waiter's connection breaks with its node; it watches
// anew on another node and must be granted promptly after the holder's
// release.
func TestWatchAcrossLossOfFollowerNode(t *testing.T) {
	c := cluster3(t)
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-watch-follower")
	cfg.Replicas = 3
	hj0 := jsOn(t, natstest.Connect(t, c.URLs()))
	bucket(t, hj0, cfg)
	stream := "KV_" + cfg.Bucket
	meta := func() int {
		for i, s := range c.Nodes {
			if s != nil && s.JetStreamIsLeader() {
				return i
			}
		}
		return -1
	}
	var m, sl int
	for giveUp := time.Now().Add(20 * time.Second); ; {
		m, sl = meta(), c.StreamLeader(stream)
		if m >= 0 && sl >= 0 && m != sl {
			break
		}
		if time.Now().After(giveUp) {
			t.Fatalf("no meta leader apart from the stream leader within 20s (meta %d, stream %d)", m, sl)
		}
		if m >= 0 && m == sl {
			// Move the stream's leadership off the meta leader.
			_, _ = hj0.Conn().Request("$JS.API.STREAM.LEADER.STEPDOWN."+stream, nil, 2*time.Second)
		}
		time.Sleep(50 * time.Millisecond) // polling the cluster
	}
	stop := 3 - m - sl // neither the meta leader nor the stream's
	holderNode := (stop + 1) % 3
	urls := func(first int) string {
		u := "nats://" + c.ClientAddr(first)
		for i := range c.Nodes {
			if i != first {
				u += ",nats://" + c.ClientAddr(i)
			}
		}
		return u
	}
	hj := jsOn(t, natstest.Connect(t, urls(holderNode)))
	wj := jsOn(t, natstest.Connect(t, urls(stop)))
	holderSide := newAcquirer(t, hj, cfg, nil)
	waiter := newAcquirer(t, wj, cfg, &natsfence.AcquirerOptions{Recheck: time.Minute, MaxWait: 2 * time.Minute})
	name, key, h, waiting := holdForWaiter(t, holderSide, "leader-follower", 60*time.Second)
	res := goAcquire(ctx, waiter, name, 10*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	t.Logf("meta leader n%d, stream leader n%d; stopping n%d (the waiter's), holder on n%d", m, sl, stop, holderNode)
	c.Stop(stop)
	waitKeyA(t, waiting, key, res, "the waiter did not try again after its node stopped")
	var rerr error
	for giveUp := time.Now().Add(30 * time.Second); ; {
		if rerr = h.Release(ctx); rerr == nil || time.Now().After(giveUp) {
			break
		}
		time.Sleep(100 * time.Millisecond) // the election: polling
	}
	if rerr != nil {
		t.Fatalf("the holder's release after n%d stopped: %v", stop, rerr)
	}
	grantedAfterRelease(t, res, h, 15*time.Second, fmt.Sprintf("after its node n%d (a follower) stopped", stop))
}

// TestLateWatchStopped: an Acquire whose ctx ends while its watch's
// creation is held up (a partition) leaves nothing behind once the
// partition heals and the consumer's creation completes on the server: no
// goroutine of the acquirer, no subscription on the client, no consumer on
// the bucket for longer than the server keeps one without interest.
func TestLateWatchStopped(t *testing.T) {
	j, p := proxied(t)
	ctx := context.Background()
	direct := js(t)
	holderSide := newAcquirer(t, direct, lockBucket, nil)
	bucket(t, j, lockBucket)
	stream, err := direct.Stream(ctx, "KV_"+lockBucket.Bucket)
	if err != nil {
		t.Fatal(err)
	}
	waiter := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	nc := j.Conn()
	consumers := func() int {
		info, err := stream.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.State.Consumers
	}
	name := fencetest.Name("latewatch")
	h, err := holderSide.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Release(ctx)
	s0, c0 := nc.NumSubscriptions(), consumers()
	n0, _ := acquirerGoroutines() // other tests' leftovers
	p.Partition()
	wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	_, err = waiter.Acquire(wctx, name, 10*time.Second)
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Acquire during a partition: %v, want ErrHeld and DeadlineExceeded", err)
	}
	p.Heal()
	var n, s, cs int
	var where string
	for giveUp := time.Now().Add(20 * time.Second); ; {
		n, where = acquirerGoroutines()
		s, cs = nc.NumSubscriptions(), consumers()
		if n <= n0 && s <= s0 && cs <= c0 {
			break
		}
		if time.Now().After(giveUp) {
			t.Fatalf("20s after the heal: %d acquirer goroutines (before %d) %s, subscriptions %d (before %d), consumers %d (before %d)", n, n0, where, s, s0, cs, c0)
		}
		time.Sleep(100 * time.Millisecond) // polling counts
	}
	t.Logf("subscriptions %d, consumers %d", s, cs)
}

// TestWatchRequestFailsThenWaiterWoken: the first watch requests of a
// waiting Acquire fail (as a consumer refused under load would). Its
// Recheck is a minute, so only its watch can wake it: the request must be
// made again, and the holder's release then wakes the waiter at once. (A
// worker of the MutualExclusion suite case once waited two minutes on a
// busy lock: a watch request that failed once was never made again.)
func TestWatchRequestFailsThenWaiterWoken(t *testing.T) {
	ctx := context.Background()
	holder := newAcquirer(t, js(t), lockBucket, nil)
	waiter := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	// The holder's grant makes no watch request: the hook is for the
	// waiter's.
	name, key, h, waiting := holdForWaiter(t, holder, "watchfails", 30*time.Second)
	var failed atomic.Int32
	natsfence.SetWatchErrHook(func(k string) error {
		if k == key && failed.Add(1) <= 3 {
			return errors.New("test: watch request refused")
		}
		return nil
	})
	t.Cleanup(func() { natsfence.SetWatchErrHook(nil) })
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	res := goAcquire(wctx, waiter, name, 10*time.Second)
	waitKeyA(t, waiting, key, res, "the waiter never waited")
	// The watch is asked again until a request goes through (the fourth).
	for end := time.Now().Add(10 * time.Second); failed.Load() < 4; {
		if time.Now().After(end) {
			t.Fatalf("the watch was asked %d times in 10s: a failed request was not made again", failed.Load())
		}
		time.Sleep(2 * time.Millisecond) // polling a counter
	}
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	grantedAfterRelease(t, res, h, 10*time.Second, "after its first watch requests failed")
}
