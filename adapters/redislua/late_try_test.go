package redislua_test

import (
	"context"
	"errors"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// lateClient sends its next script call through a partitioned proxy and
// reports a read timeout at once, as go-redis does when ReadTimeout passes
// while the request is still on its way: the call lands when the proxy heals.
type lateClient struct {
	*redis.Client
	slow   *redis.Client
	armed  atomic.Bool
	landed chan *redis.Cmd
}

func (h *lateClient) EvalSha(ctx context.Context, sha string, keys []string, args ...any) *redis.Cmd {
	if h.armed.CompareAndSwap(true, false) {
		go func() { h.landed <- h.slow.EvalSha(context.WithoutCancel(ctx), sha, keys, args...) }()
		cmd := redis.NewCmd(ctx)
		cmd.SetErr(&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded})
		return cmd
	}
	return h.Client.EvalSha(ctx, sha, keys, args...)
}

// TestAcquirerLateTryAfterRelease (a grant landing after its
// sender gave up, on a single instance): a try that timed out on the way is sent again and granted; the
// lease is released; then the first try lands. It must not lock the name for
// a ttl on behalf of a lease that is gone.
func TestAcquirerLateTryAfterRelease(t *testing.T) {
	ctx := context.Background()
	p := faultnet.Start(t, testenv.RedisAddr())
	slow := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: -1, ReadTimeout: time.Minute})
	t.Cleanup(func() { slow.Close() })
	c := &lateClient{Client: testenv.RedisClient(t), slow: slow, landed: make(chan *redis.Cmd, 1)}
	a, _ := redislua.NewAcquirer(c, nil)
	other, _ := redislua.NewAcquirer(testenv.RedisClient(t), nil)
	const ttl = 20 * time.Second
	name := fencetest.Name("latetry")
	if err := slow.Ping(ctx).Err(); err != nil { // the slow connection is open
		t.Fatal(err)
	}
	if l, err := a.TryAcquire(ctx, name, ttl); err != nil { // loads the script
		t.Fatal(err)
	} else if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	p.Partition()
	c.armed.Store(true)
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire whose first try timed out: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	p.Heal()
	var landed *redis.Cmd
	select {
	case landed = <-c.landed:
	case <-time.After(30 * time.Second):
		t.Fatal("the late try never landed")
	}
	if landed.Err() != nil {
		t.Fatalf("late try: %v", landed.Err())
	}
	ol, err := other.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("after a released lease's first try landed late (reply %v): %v", landed.Val(), err)
	}
	if err := ol.Release(ctx); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}
