package benchutil

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// Store is where a flaky benchmark keeps its counter: a fenced writer that
// reads back a key's value and the token that wrote it.
type Store interface {
	fence.FencedWriter
	Read(ctx context.Context, key string) ([]byte, fence.Token, error)
}

// Flaky is one backend of FlakyNetwork.
type Flaky struct {
	Name string
	// Target returns the server's address (host:port), the proxy's target.
	Target func(b *testing.B) string
	// Open returns an acquirer and a store that reach the server only
	// through p (a store that is not on the server, such as MemStore, is
	// allowed: then only the lock goes through the proxy).
	Open func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, Store)
	// Workers x Increments locked increments per run; 0 means 8 x 200.
	Workers, Increments int
	// TTL of each lease; 0 means 10s.
	TTL time.Duration
	// ReplyWindow is the proxy's (faultnet.Proxy.ReplyWindow): set it for a
	// multiplexed protocol (gRPC), whose first bytes back need not be the
	// reply. 0: the reply is the server's first bytes.
	ReplyWindow time.Duration
}

// FlakyNetwork runs, for each backend, Workers x Increments locked increments
// of one counter (Acquire, Read, fenced Write, Release) through a fault proxy
// with 1-3 ms jitter each way, then the same on a new proxy, client and name
// with 2% of the requests also cutting their connection (half before the
// server saw them, half after it acted). It reports the increments per second
// of each run and their ratio (the target is cuts/jitter >= 0.70), logs
// them as a table row, and fails on a lost or doubled increment. It asserts no
// speed.
func FlakyNetwork(b *testing.B, backends ...Flaky) {
	for _, be := range backends {
		b.Run(be.Name, func(b *testing.B) {
			workers, n, ttl := be.Workers, be.Increments, be.TTL
			if workers == 0 {
				workers, n = 8, 200
			}
			if ttl == 0 {
				ttl = 10 * time.Second
			}
			for i := 0; i < b.N; i++ {
				var rates [2]float64
				for j, cut := range []float64{0, 0.02} {
					p := faultnet.Start(b, be.Target(b))
					p.Latency(time.Millisecond, 3*time.Millisecond)
					p.ReplyWindow(be.ReplyWindow)
					a, s := be.Open(b, p)
					p.CutRate(cut)
					start := time.Now()
					retries := LockedIncrements(b, a, s, workers, n, ttl)
					rates[j] = float64(workers*n) / time.Since(start).Seconds()
					p.CutRate(0)
					b.Logf("%s, cut rate %v: %d increments in %v, %.1f increments/s, %d retried; proxy %+v",
						be.Name, cut, workers*n, time.Since(start).Round(time.Millisecond), rates[j], retries, p.Stats())
				}
				b.Logf("| %s | %dx%d | %.1f | %.1f | %.2f |", be.Name, workers, n, rates[0], rates[1], rates[1]/rates[0])
				b.ReportMetric(rates[0], "incr/s-jitter")
				b.ReportMetric(rates[1], "incr/s-cuts")
				b.ReportMetric(rates[1]/rates[0], "cuts/jitter")
			}
		})
	}
}

// LockedIncrements runs workers x n increments of one counter under one lock
// and checks that the counter ends at workers x n: no increment lost, none
// applied twice. A step whose outcome is unknown is settled by reading the
// counter again (only the holder writes it). It returns how many increments
// had to be tried again.
func LockedIncrements(b *testing.B, a fence.Acquirer, s Store, workers, n int, ttl time.Duration) int64 {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	name := fencetest.Name("flaky")
	var done, retries atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range n {
				for {
					ok, err := increment(ctx, a, s, name, ttl)
					if err != nil {
						errs <- err
						return
					}
					if ok {
						break
					}
					retries.Add(1)
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
	var v []byte
	var err error
	for i := 0; ; i++ {
		if v, _, err = s.Read(ctx, name); err == nil || i == 10 {
			break
		}
	}
	if err != nil {
		b.Fatal(err)
	}
	if got, want := string(v), strconv.Itoa(workers*n); got != want {
		b.Fatalf("the counter is %s after %d increments (%d retried): an increment was lost or doubled", got, done.Load(), retries.Load())
	}
	return retries.Load()
}

// increment adds one to the counter under the lock: true when it did, false
// when it must be tried again (a step failed before the write, or the lease
// was lost), an error when the outcome cannot be settled.
func increment(ctx context.Context, a fence.Acquirer, s Store, name string, ttl time.Duration) (bool, error) {
	l, err := a.Acquire(ctx, name, ttl)
	if err != nil {
		if ctx.Err() != nil {
			return false, err
		}
		return false, nil // an unknown grant, or a definite failure: both leave the counter alone
	}
	defer func() { _ = l.Release(context.WithoutCancel(ctx)) }()
	v, _, err := s.Read(l.Context(), name)
	cur := 0
	switch {
	case errors.Is(err, fence.ErrNotFound):
	case err != nil:
		return false, nil
	default:
		if cur, err = strconv.Atoi(string(v)); err != nil {
			return false, err
		}
	}
	next := []byte(strconv.Itoa(cur + 1))
	err = s.Write(l.Context(), name, next, l.Token())
	if err == nil {
		return true, nil
	}
	if !errors.Is(err, fence.ErrUnknown) {
		return false, nil // not applied
	}
	// Applied or not: the counter holds this token exactly when it was, as
	// long as no later holder has written it (the ttl is long enough for that
	// to be rare; then the outcome cannot be settled and the run fails).
	for i := 0; i < 20; i++ {
		v, tok, err := s.Read(ctx, name)
		switch {
		case errors.Is(err, fence.ErrNotFound):
			return false, nil // the counter's first write did not land
		case err != nil:
			continue
		case tok > l.Token():
			return false, fmt.Errorf("an unknown write of %s was overtaken by token %d before it was settled", next, tok)
		default:
			return string(v) == string(next) && tok == l.Token(), nil
		}
	}
	return false, fmt.Errorf("could not read the counter to settle an unknown write of %s", next)
}

// MemStore is a fenced store in this process's memory, for a backend that has
// no writer of its own (etcd): the counter is then exact under the lock alone,
// and only the lock's requests go through the proxy.
type MemStore struct {
	mu   sync.Mutex
	vals map[string]memEntry
}

type memEntry struct {
	v   []byte
	tok fence.Token
}

// Write stores value unless key holds a larger token.
func (m *MemStore) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.vals == nil {
		m.vals = map[string]memEntry{}
	}
	if e, ok := m.vals[key]; ok && e.tok > token {
		return &fence.StaleError{Key: key, Offered: token, Current: e.tok}
	}
	m.vals[key] = memEntry{append([]byte(nil), value...), token}
	return nil
}

// Read returns key's value and token, or fence.ErrNotFound.
func (m *MemStore) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.vals[key]
	if !ok {
		return nil, 0, fence.ErrNotFound
	}
	return e.v, e.tok, nil
}
