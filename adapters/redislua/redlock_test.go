package redislua_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// quietLogger drops go-redis's log lines: the node-loss tests kill servers on
// purpose, and every failed dial would be logged.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

func fiveNodes(t *testing.T) ([]*testenv.RedisServer, []redislua.Client) {
	redis.SetLogger(quietLogger{})
	servers := make([]*testenv.RedisServer, 5)
	clients := make([]redislua.Client, 5)
	for i := range servers {
		servers[i] = testenv.StartRedis(t)
		clients[i] = servers[i].Client(t)
	}
	return servers, clients
}

func TestRedlockConformance(t *testing.T) {
	servers, clients := fiveNodes(t)
	r, err := redislua.NewRedlock(clients, nil)
	if err != nil {
		t.Fatal(err)
	}
	fencetest.AcquirerSuite{
		New: func(t *testing.T) fence.Acquirer { return r },
		// Another process: a Redlock on clients of its own to the same nodes.
		NewOther: func(t *testing.T) fence.Acquirer {
			own := make([]redislua.Client, len(servers))
			for i, s := range servers {
				own[i] = s.Client(t)
			}
			r, err := redislua.NewRedlock(own, nil)
			if err != nil {
				t.Fatal(err)
			}
			return r
		},
		ShortTTL: 300 * time.Millisecond,
		// Contenders split the votes and retry: keep the contention test to a
		// size that finishes in seconds under -race on two cores.
		Workers: 8, Increments: 10,
		MaxTTL:   redislua.MaxTTL,
		BadNames: []string{"a{b}", "x}"},
	}.Run(t)
}

// TestRedlockNodeLoss: with 2 of 5 nodes killed it still grants, with tokens
// that keep growing; with 3 killed it refuses with ErrNoQuorum.
func TestRedlockNodeLoss(t *testing.T) {
	servers, clients := fiveNodes(t)
	r, _ := redislua.NewRedlock(clients, nil)
	ctx := context.Background()
	var last fence.Token
	grant := func(stage string) error {
		l, err := r.TryAcquire(ctx, "job", 2*time.Second)
		if err != nil {
			return err
		}
		if l.Token() <= last {
			t.Errorf("%s: token %d not above %d", stage, l.Token(), last)
		}
		last = l.Token()
		return l.Release(ctx)
	}
	for i := 0; i < 3; i++ {
		if err := grant("all nodes up"); err != nil {
			t.Fatal(err)
		}
	}
	// Kill the two nodes that took part in every grant so far; the others
	// must carry the counter on.
	servers[0].Kill()
	servers[1].Kill()
	for i := 0; i < 3; i++ {
		if err := grant("2 of 5 killed"); err != nil {
			t.Fatalf("with 2 of 5 nodes killed: %v", err)
		}
	}
	// A holder's lease survives on the three nodes left; a second holder is refused.
	l, err := r.TryAcquire(ctx, "job", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.TryAcquire(ctx, "job", time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("second holder with 3 of 5 nodes up: %v, want ErrHeld", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	servers[2].Kill()
	_, err = r.TryAcquire(ctx, "job", time.Second)
	if !errors.Is(err, redislua.ErrNoQuorum) || errors.Is(err, fence.ErrHeld) {
		t.Fatalf("with 3 of 5 nodes killed: %v, want ErrNoQuorum", err)
	}
	_, err = r.Acquire(ctx, "job", time.Second)
	if !errors.Is(err, redislua.ErrNoQuorum) {
		t.Fatalf("Acquire with 3 of 5 nodes killed: %v, want ErrNoQuorum at once", err)
	}
}

// TestRedlockTokensAcrossMajorities grants on changing majorities (a different
// pair of nodes down each time) and checks that every token is larger than the
// one before: each majority overlaps the previous one.
func TestRedlockTokensAcrossMajorities(t *testing.T) {
	servers, clients := fiveNodes(t)
	ctx := context.Background()
	var last fence.Token
	for round := 0; round < 5; round++ {
		down := []int{round % 5, (round + 2) % 5}
		for _, i := range down {
			if err := servers[i].Stop(); err != nil {
				t.Fatal(err)
			}
		}
		r, _ := redislua.NewRedlock(clients, &redislua.RedlockOptions{NodeTimeout: 100 * time.Millisecond})
		l, err := r.TryAcquire(ctx, "rotating", 400*time.Millisecond)
		if err != nil {
			t.Fatalf("round %d (nodes %v paused): %v", round, down, err)
		}
		if l.Token() <= last {
			t.Errorf("round %d: token %d not above %d", round, l.Token(), last)
		}
		last = l.Token()
		if err := l.Release(ctx); err != nil {
			t.Fatalf("round %d release: %v", round, err)
		}
		for _, i := range down {
			if err := servers[i].Continue(); err != nil {
				t.Fatal(err)
			}
		}
		// A paused node still runs the lock request it never answered for when
		// it resumes, possibly after the release: that lock lasts until its ttl.
		time.Sleep(500 * time.Millisecond)
	}
}
