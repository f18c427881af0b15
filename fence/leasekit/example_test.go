package leasekit_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// memBackend stands for a remote store with a compare-and-set: it keeps, per
// name, the token counter, the holder's token and the expiry on its own clock.
// A real acquirer would make one request per method here. A name's counter
// starts at the backend's clock in microseconds, not at 0, so a name whose
// state is deleted (an operator, a lifecycle rule, an eviction) never grants
// a token below one it granted before, as long as the clock does not step
// back and the name made fewer grants than microseconds passed.
type memBackend struct {
	mu    sync.Mutex
	locks map[string]*memLock
}

type memLock struct {
	counter, holder fence.Token
	expires         time.Time
}

// grant is the backend's atomic step: it takes an expired or free lock and
// advances its counter.
func (b *memBackend) grant(name string, ttl time.Duration) (fence.Token, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now() // the backend's clock
	l := b.locks[name]
	if l == nil {
		l = &memLock{counter: fence.Token(now.UnixMicro())}
		b.locks[name] = l
	}
	if l.holder != 0 && now.Before(l.expires) {
		return 0, false
	}
	l.counter++
	l.holder, l.expires = l.counter, now.Add(ttl)
	return l.counter, true
}

// extend renews or (ttl 0) releases the lock if tok still holds it.
func (b *memBackend) extend(name string, tok fence.Token, ttl time.Duration) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	l := b.locks[name]
	now := time.Now()
	if l == nil || l.holder != tok || !now.Before(l.expires) {
		return false
	}
	if ttl == 0 {
		l.holder = 0
	} else {
		l.expires = now.Add(ttl)
	}
	return true
}

// memAcquirer is a complete third-party acquirer on leasekit.
type memAcquirer struct{ b *memBackend }

type memLease struct {
	*leasekit.Base
	b *memBackend
}

// check refuses bad input with ErrInvalid, before anything looks at whether
// ctx is done (a wait whose context ended is ErrHeld, which callers retry).
func (memAcquirer) check(ctx context.Context, name string, ttl time.Duration) error {
	if err := leasekit.CheckContext("acquire", ctx); err != nil {
		return err
	}
	if err := leasekit.CheckName("acquire", name); err != nil {
		return err
	}
	return leasekit.CheckTTL("acquire", ttl, 0, 0)
}

func (a memAcquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check(ctx, name, ttl); err != nil {
		return nil, err
	}
	sent := time.Now() // before the request: the local deadline counts from here
	tok, ok := a.b.grant(name, ttl)
	if !ok {
		return nil, fence.ErrHeld
	}
	return &memLease{Base: leasekit.New(name, tok, ttl, 0, sent), b: a.b}, nil
}

func (a memAcquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check(ctx, name, ttl); err != nil {
		return nil, err
	}
	return leasekit.Acquire(ctx, fence.Backoff{}, nil, func(ctx context.Context) (fence.Lease, error) {
		return a.TryAcquire(ctx, name, ttl)
	})
}

func (l *memLease) Renew(ctx context.Context) error {
	if err := leasekit.CheckContext("renew", ctx); err != nil {
		return err
	}
	if l.Context().Err() != nil {
		return fence.ErrLost // ended locally: a renewal would hold the name for nobody
	}
	sent := time.Now()
	if !l.b.extend(l.Name(), l.Token(), l.TTL()) {
		l.End(fence.ErrLost)
		return fence.ErrLost
	}
	if !l.Extend(sent) { // confirmed too late: give the name back
		l.b.extend(l.Name(), l.Token(), 0)
		return fence.ErrLost
	}
	return nil
}

func (l *memLease) Release(ctx context.Context) error {
	if err := leasekit.CheckContext("release", ctx); err != nil {
		return err
	}
	ok := l.b.extend(l.Name(), l.Token(), 0)
	l.End(context.Canceled)
	if !ok {
		return fence.ErrLost
	}
	return nil
}

// A minimal acquirer for another backend, built on leasekit: the backend
// decides grants and expiry; leasekit keeps the holder's conservative local
// deadline and the lease's context. TestExampleAcquirer runs the conformance
// suite on it.
func Example() {
	a := memAcquirer{b: &memBackend{locks: map[string]*memLock{}}}
	ctx := context.Background()
	l, _ := a.TryAcquire(ctx, "invoice-42", time.Minute)
	_, err := a.TryAcquire(ctx, "invoice-42", time.Minute)
	fmt.Println(err)
	_ = l.Release(ctx)
	l2, _ := a.TryAcquire(ctx, "invoice-42", time.Minute)
	fmt.Println(l2.Token() == l.Token()+1, l.Context().Err() != nil)
	// Output:
	// fence: lease held by another holder
	// true true
}

// TestExampleAcquirer: the example acquirer passes fence/fencetest's suite.
func TestExampleAcquirer(t *testing.T) {
	b := &memBackend{locks: map[string]*memLock{}}
	a := memAcquirer{b: b}
	fencetest.AcquirerSuite{New: func(*testing.T) fence.Acquirer { return a },
		// The backend forgets the name, as an operator's DELETE would.
		DeleteState: func(_ *testing.T, name string) {
			b.mu.Lock()
			defer b.mu.Unlock()
			delete(b.locks, name)
		},
	}.Run(t)
}
