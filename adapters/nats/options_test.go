package natsfence_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/nats-io/nats.go/jetstream"
)

// TestConstructorsRefuseUnusableOptions: an option that would make every
// call fail (a Timeout of 2ns meant as 2s, a Drift no ttl is above, an Owner
// too large for a message) is refused by the constructor with
// fence.ErrInvalid naming it, the same way by New, NewWriter and NewStore.
func TestConstructorsRefuseUnusableOptions(t *testing.T) {
	ctx := context.Background()
	j := js(t)
	bucket(t, j, lockBucket)
	bucket(t, j, writerBucket)
	wantInvalid := func(what, arg string, err error) {
		t.Helper()
		var ie *fence.InvalidError
		if !errors.As(err, &ie) || !errors.Is(err, fence.ErrInvalid) || ie.Arg != arg {
			t.Errorf("%s: %v, want ErrInvalid naming %s", what, err, arg)
		}
	}
	for _, c := range []struct {
		arg string
		o   natsfence.AcquirerOptions
	}{
		{"Timeout", natsfence.AcquirerOptions{Timeout: 2}},
		{"Timeout", natsfence.AcquirerOptions{Timeout: natsfence.MinTimeout - 1}},
		{"MaxWait", natsfence.AcquirerOptions{MaxWait: 2}},
		{"Recheck", natsfence.AcquirerOptions{Recheck: 2}},
		{"Drift", natsfence.AcquirerOptions{Drift: natsfence.MaxTTL}},
		{"Owner", natsfence.AcquirerOptions{Owner: strings.Repeat("o", 1<<20)}},
	} {
		_, err := natsfence.NewAcquirer(ctx, j, lockBucket.Bucket, &c.o)
		wantInvalid("New", c.arg, err)
	}
	_, err := natsfence.NewWriter(ctx, j, writerBucket.Bucket, &natsfence.WriterOptions{Timeout: 2})
	wantInvalid("NewWriter", "Timeout", err)
	_, err = natsfence.NewIdempotencyStore(ctx, j, writerBucket.Bucket, &natsfence.IdempotencyOptions{Timeout: 2})
	wantInvalid("NewStore", "Timeout", err)

	// The shortest accepted values work.
	a, err := natsfence.NewAcquirer(ctx, j, lockBucket.Bucket, &natsfence.AcquirerOptions{Timeout: natsfence.MinTimeout * 100, MaxWait: natsfence.MinTimeout, Recheck: natsfence.MinTimeout})
	if err != nil {
		t.Fatal(err)
	}
	l, err := a.TryAcquire(ctx, fencetest.Name("opts"), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = l.Release(ctx)
}

// TestDriftNotBelowTTL: a Drift at least the lease's ttl makes a lease whose
// context is done at birth while the server holds the name for the ttl: a
// lease already lost must not come with a nil error, and the
// name must not be blocked by it.
func TestDriftNotBelowTTL(t *testing.T) {
	a := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Drift: 10 * time.Second})
	other := newAcquirer(t, js(t), lockBucket, nil)
	ctx := context.Background()
	name := fencetest.Name("drift")
	l, err := a.TryAcquire(ctx, name, 5*time.Second)
	if err == nil {
		defer func() { _ = l.Release(ctx) }()
		if l.Context().Err() != nil {
			t.Fatalf("TryAcquire with Drift 10s and ttl 5s: a lease whose context is already done (%v), with a nil error", context.Cause(l.Context()))
		}
		t.Fatalf("TryAcquire with Drift 10s and ttl 5s: nil error, want ErrInvalid naming Drift")
	}
	var ie *fence.InvalidError
	if !errors.As(err, &ie) || ie.Arg != "Drift" {
		t.Fatalf("TryAcquire with Drift 10s and ttl 5s: %v, want ErrInvalid naming Drift", err)
	}
	l2, err := other.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("the name after the refused acquire: %v", err)
	}
	_ = l2.Release(ctx)
}

// TestTimeoutTooShortRefused: a Timeout no request can meet (2,
// meant as seconds, is 2ns) is refused at construction with fence.ErrInvalid
// naming Timeout, instead of making every step fail at use after RetryFor.
func TestTimeoutTooShortRefused(t *testing.T) {
	j := js(t)
	cfg := idemBucket(t)
	bucket(t, j, cfg)
	ctx := context.Background()
	if s, err := natsfence.NewIdempotencyStore(ctx, j, cfg.Bucket, &natsfence.IdempotencyOptions{Timeout: 2, RetryFor: 200 * time.Millisecond}); err == nil {
		_, _, berr := s.Begin(ctx, fencetest.Name("k"), "fp", "me", time.Minute)
		t.Errorf("NewStore with Timeout 2ns accepted; a Begin then: %v", berr)
	} else if ie := (*fence.InvalidError)(nil); !errors.As(err, &ie) || ie.Arg != "Timeout" {
		t.Errorf("NewStore with Timeout 2ns: %v, want fence.ErrInvalid naming Timeout", err)
	}
	if _, err := natsfence.NewWriter(ctx, j, cfg.Bucket, &natsfence.WriterOptions{Timeout: 2}); err == nil {
		t.Error("NewWriter with Timeout 2ns accepted")
	}
	if _, err := natsfence.NewIdempotencyStore(ctx, j, cfg.Bucket, &natsfence.IdempotencyOptions{Timeout: natsfence.MinTimeout}); err != nil {
		t.Errorf("NewStore with Timeout MinTimeout: %v", err)
	}
}

// TestDiscardOldBucketRefused: a bucket whose stream drops its
// oldest messages when it reaches a message or byte limit (discard old, as
// an operator can set with nats stream edit) removes records, fences and
// leases as a TTL does: a completed key's record goes, and its effect runs
// again. NewStore, NewWriter and New refuse such a bucket as they refuse a
// TTL.
func TestDiscardOldBucketRefused(t *testing.T) {
	j := js(t)
	ctx := context.Background()
	name := "discard_" + strings.TrimPrefix(idemBucket(t).Bucket, "idem_")
	if _, err := j.CreateStream(ctx, jetstream.StreamConfig{
		Name: "KV_" + name, Subjects: []string{"$KV." + name + ".>"}, MaxMsgsPerSubject: 1,
		AllowRollup: true, DenyDelete: true, AllowDirect: true, Discard: jetstream.DiscardOld, MaxMsgs: 2,
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = j.DeleteStream(context.Background(), "KV_"+name) })
	s, err := natsfence.NewIdempotencyStore(ctx, j, name, nil)
	if err == nil {
		// What it would do: the third key's record pushes the first out.
		runs := 0
		for _, k := range []string{"a", "b", "c", "a"} {
			if _, err := idempotency.Do(ctx, s, k, "fp", func(context.Context, string) ([]byte, error) {
				if k == "a" {
					runs++
				}
				return nil, nil
			}, &idempotency.Options{Retention: idempotency.Forever}); err != nil {
				t.Fatal(err)
			}
		}
		t.Errorf("NewStore accepted a discard-old bucket with MaxMsgs 2; key a's effect then ran %d times", runs)
	} else if ie := (*fence.InvalidError)(nil); !errors.As(err, &ie) || ie.Arg != "bucket" {
		t.Errorf("NewStore: %v, want fence.ErrInvalid naming the bucket", err)
	}
	if _, err := natsfence.NewWriter(ctx, j, name, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("NewWriter: %v, want fence.ErrInvalid", err)
	}
	if _, err := natsfence.NewAcquirer(ctx, j, name, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("New: %v, want fence.ErrInvalid", err)
	}
}

// TestHugeTimeoutRefusedOrWorks: a Timeout New accepts must
// work: it sets how long a grant's marker lives, and must neither overflow
// nor make every grant fail. Either New refuses it with ErrInvalid naming
// Timeout, or a grant on a free name succeeds.
func TestHugeTimeoutRefusedOrWorks(t *testing.T) {
	ctx := context.Background()
	j := js(t)
	bucket(t, j, lockBucket)
	for _, timeout := range []time.Duration{math.MaxInt64, natsfence.MaxTTL, 200 * 365 * 24 * time.Hour} {
		a, err := natsfence.NewAcquirer(ctx, j, lockBucket.Bucket, &natsfence.AcquirerOptions{Timeout: timeout})
		if err != nil {
			var ie *fence.InvalidError
			if !errors.As(err, &ie) || ie.Arg != "Timeout" {
				t.Errorf("New with Timeout %v: %v, want nil or ErrInvalid naming Timeout", timeout, err)
			}
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		l, err := a.TryAcquire(cctx, fencetest.Name("hugetimeout"), 5*time.Second)
		cancel()
		if err != nil {
			t.Errorf("New accepted Timeout %v, then a grant on a free name: %v", timeout, err)
			continue
		}
		_ = l.Release(ctx)
	}
}
