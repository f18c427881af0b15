package redislua_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// TestTryAcquireOnReplicaReturns: a client pointed at a read-only replica
// (a configuration mistake, not a pause) gets READONLY for every write.
// TryAcquire "grants the lease or returns ErrHeld at once": with a context
// that has no deadline it must still return (an error that names READONLY),
// not send the try again forever.
func TestTryAcquireOnReplicaReturns(t *testing.T) {
	primary := testenv.StartRedis(t)
	replica := testenv.StartRedis(t, "--replicaof", "127.0.0.1", strconv.Itoa(primary.Port))
	a, err := redislua.NewAcquirer(replica.Client(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		l, err := a.TryAcquire(ctx, fencetest.Name("replica"), time.Minute)
		if l != nil {
			_ = l.Release(context.Background())
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Error("TryAcquire on a read-only replica granted")
		}
		t.Logf("TryAcquire on a replica: %v", err)
	case <-time.After(20 * time.Second):
		cancel()
		t.Errorf("TryAcquire on a read-only replica, context without deadline: no answer after 20s (READONLY sent again forever); after cancel: %v", <-done)
	}
}

// TestStepsOnReplicaEndNotRun: on a read-only replica, with contexts that
// have no deadline, a grant, a wait, a write and an idempotency claim each
// return once Redis has refused them for NotRunWait, with an error matching
// redislua.ErrNotRun (Redis ran none of their sends) and not
// fence.ErrUnknown.
func TestStepsOnReplicaEndNotRun(t *testing.T) {
	primary := testenv.StartRedis(t)
	replica := testenv.StartRedis(t, "--replicaof", "127.0.0.1", strconv.Itoa(primary.Port))
	c := replica.Client(t)
	const wait = 300 * time.Millisecond
	a, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{NotRunWait: wait})
	if err != nil {
		t.Fatal(err)
	}
	w, err := redislua.NewWriter(c, &redislua.WriterOptions{NotRunWait: wait})
	if err != nil {
		t.Fatal(err)
	}
	s, err := redislua.NewIdempotencyStore(c, &redislua.IdempotencyOptions{NotRunWait: wait})
	if err != nil {
		t.Fatal(err)
	}
	steps := map[string]func(ctx context.Context) error{
		"try": func(ctx context.Context) error {
			l, err := a.TryAcquire(ctx, fencetest.Name("replica-try"), time.Minute)
			if l != nil {
				_ = l.Release(context.Background())
			}
			return err
		},
		"wait": func(ctx context.Context) error {
			l, err := a.Acquire(ctx, fencetest.Name("replica-wait"), time.Minute)
			if l != nil {
				_ = l.Release(context.Background())
			}
			return err
		},
		"write": func(ctx context.Context) error {
			return w.Write(ctx, fencetest.Name("replica-write"), []byte("v"), 1)
		},
		"idempotency-begin": func(ctx context.Context) error {
			_, _, err := s.Begin(ctx, fencetest.Name("replica-begin"), "fp", "me", time.Minute)
			return err
		},
	}
	for name, step := range steps {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- step(ctx) }()
			select {
			case err := <-done:
				if !errors.Is(err, redislua.ErrNotRun) || errors.Is(err, fence.ErrUnknown) || !strings.Contains(fmt.Sprint(err), "READONLY") {
					t.Errorf("%s on a read-only replica: %v, want ErrNotRun with Redis's READONLY, not ErrUnknown", name, err)
				}
			case <-time.After(30 * time.Second):
				cancel()
				t.Errorf("%s on a read-only replica, NotRunWait %v, context without deadline: no answer after 30s; after cancel: %v", name, wait, <-done)
			}
		})
	}
}
