package natsfence_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
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
		o   natsfence.Options
	}{
		{"Timeout", natsfence.Options{Timeout: 2}},
		{"Timeout", natsfence.Options{Timeout: natsfence.MinTimeout - 1}},
		{"MaxWait", natsfence.Options{MaxWait: 2}},
		{"Recheck", natsfence.Options{Recheck: 2}},
		{"Drift", natsfence.Options{Drift: natsfence.MaxTTL}},
		{"Owner", natsfence.Options{Owner: strings.Repeat("o", 1<<20)}},
	} {
		_, err := natsfence.New(ctx, j, lockBucket.Bucket, &c.o)
		wantInvalid("New", c.arg, err)
	}
	_, err := natsfence.NewWriter(ctx, j, writerBucket.Bucket, &natsfence.WriterOptions{Timeout: 2})
	wantInvalid("NewWriter", "Timeout", err)
	_, err = natsfence.NewStore(ctx, j, writerBucket.Bucket, &natsfence.StoreOptions{Timeout: 2})
	wantInvalid("NewStore", "Timeout", err)

	// The shortest accepted values work.
	a, err := natsfence.New(ctx, j, lockBucket.Bucket, &natsfence.Options{Timeout: natsfence.MinTimeout * 100, MaxWait: natsfence.MinTimeout, Recheck: natsfence.MinTimeout})
	if err != nil {
		t.Fatal(err)
	}
	l, err := a.TryAcquire(ctx, fencetest.Name("opts"), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = l.Release(ctx)
}
