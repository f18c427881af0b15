package natsfence_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/natstest"
)

// TestRenewAcrossLeaderChangesKeepsHealthyLease: on a 3-node cluster with an
// R3 lock bucket, a connected holder renews its lease back to back while the
// lock bucket's stream leader steps down again and again, and once is
// killed. No Renew may report the lease lost (ErrLost) while the server
// still holds the holder's entry: each read and publish is answered by a
// leader, or fails as unknown and is retried. Nobody else is granted the
// name while the holder's context is live.
func TestRenewAcrossLeaderChangesKeepsHealthyLease(t *testing.T) {
	if testing.Short() {
		t.Skip("a 3-node cluster")
	}
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
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
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
				return
			}
			time.Sleep(20 * time.Millisecond) // pacing
		}
	}()
	// Others try the name all along: none may be granted while the holder's
	// context is live.
	wg.Add(1)
	twoHolders := make(chan string, 1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			lb, err := b.TryAcquire(ctx, name, ttl)
			if err == nil {
				live := l.Context().Err() == nil
				_ = lb.Release(ctx)
				if live {
					twoHolders <- fmt.Sprintf("granted token %d while the holder's (token %d) context is live", lb.Token(), l.Token())
					return
				}
			}
			time.Sleep(100 * time.Millisecond) // pacing
		}
	}()
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
