package fence_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fencekit/fencekit/adapters/redislua"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
)

// ceilOf is min(Max, Min*2^attempt) for a Backoff with its defaults applied,
// computed by doubling with saturation.
func ceilOf(b fence.Backoff, attempt int) time.Duration {
	b = b.WithDefaults()
	c := b.Min
	for i := 0; i < attempt && c < b.Max; i++ {
		if c > math.MaxInt64/2 {
			c = math.MaxInt64
			break
		}
		c *= 2
	}
	return min(c, b.Max)
}

// TestBackoffDelayAtExtremeValues: Delay stays within
// [0, min(Max, Min*2^attempt)] for fields up to math.MaxInt64, for attempts
// past the width of a Duration and below zero, and never panics.
func TestBackoffDelayAtExtremeValues(t *testing.T) {
	const maxD = time.Duration(math.MaxInt64)
	for _, b := range []fence.Backoff{
		{Min: maxD},
		{Max: maxD},
		{Min: maxD, Max: maxD, MaxWait: maxD},
		{Min: time.Nanosecond, Max: maxD},
		{Min: 1<<62 + 1<<40, Max: maxD}, // Min<<2 wraps to a small positive value
		{Min: 3 * time.Nanosecond, Max: maxD},
	} {
		for _, attempt := range []int{-1, 0, 1, 2, 30, 61, 62, 63, 64, 1000, math.MaxInt} {
			want := ceilOf(b, max(attempt, 0))
			for i := 0; i < 50; i++ {
				d := b.Delay(attempt)
				if d < 0 || d > want {
					t.Fatalf("%+v.Delay(%d) = %v, want within [0, %v]", b, attempt, d, want)
				}
			}
		}
	}
	// The doubling is kept near the top: Min 2^62 ns, Max 2^63-1 ns, attempt
	// 1 draws from [0, 2^63-1], half of it above 2^62.
	b := fence.Backoff{Min: 1 << 62, Max: maxD}
	high := 0
	for i := 0; i < 200; i++ {
		if b.Delay(1) > 1<<62 {
			high++
		}
	}
	if high == 0 {
		t.Errorf("Delay(1) of %+v never above Min in 200 draws: the doubling was lost", b)
	}
}

// TestBackoffValidateNamesTheField: a negative field is refused with
// ErrInvalid naming it; the largest values are valid.
func TestBackoffValidateNamesTheField(t *testing.T) {
	for _, c := range []struct {
		b     fence.Backoff
		field string
	}{
		{fence.Backoff{Min: -1}, "Backoff.Min"},
		{fence.Backoff{Max: -time.Second}, "Backoff.Max"},
		{fence.Backoff{MaxWait: math.MinInt64}, "Backoff.MaxWait"},
	} {
		err := c.b.Validate()
		var ie *fence.InvalidError
		if !errors.Is(err, fence.ErrInvalid) || !errors.As(err, &ie) || ie.Arg != c.field {
			t.Errorf("%+v.Validate() = %v, want ErrInvalid naming %s", c.b, err, c.field)
		}
	}
	if err := (fence.Backoff{Min: math.MaxInt64, Max: math.MaxInt64, MaxWait: math.MaxInt64}).Validate(); err != nil {
		t.Errorf("Validate of the largest Backoff = %v, want nil", err)
	}
}

// TestAcquirerWithExtremeBackoffWaitsAndGivesUp: an acquirer built with
// Backoff{Min: math.MaxInt64} (accepted by its constructor) waits for a held
// lease and gives up at ctx's deadline with ErrHeld, without a panic.
func TestAcquirerWithExtremeBackoffWaitsAndGivesUp(t *testing.T) {
	db, err := sqlfence.OpenSQLite(t.TempDir() + "/backoff.db")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	for _, b := range []fence.Backoff{{Min: math.MaxInt64}, {Max: math.MaxInt64}, {Min: math.MaxInt64, MaxWait: math.MaxInt64}} {
		a, err := sqlfence.NewAcquirer(sqlfence.SQLite(db), &sqlfence.AcquirerOptions{Backoff: b})
		if err != nil {
			t.Fatalf("NewAcquirer with %+v: %v", b, err)
		}
		if err := a.CreateTable(context.Background()); err != nil {
			t.Fatal(err)
		}
		l, err := a.TryAcquire(context.Background(), "job", 30*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		_, err = a.Acquire(ctx, "job", time.Second)
		cancel()
		if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Acquire of a held lease with %+v = %v, want ErrHeld and DeadlineExceeded", b, err)
		}
		if err := l.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAcquirerConstructorsRefuseANegativeBackoff: every constructor that
// takes a Backoff refuses a negative field with ErrInvalid naming it, before
// any request.
func TestAcquirerConstructorsRefuseANegativeBackoff(t *testing.T) {
	bad := fence.Backoff{MaxWait: -time.Second}
	db, err := sqlfence.OpenSQLite(t.TempDir() + "/backoff.db")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	t.Cleanup(func() { c.Close() })
	for what, err := range map[string]error{
		"sqlfence.NewAcquirer": func() error {
			_, err := sqlfence.NewAcquirer(sqlfence.SQLite(db), &sqlfence.AcquirerOptions{Backoff: bad})
			return err
		}(),
		"redislua.NewAcquirer": func() error {
			_, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{Backoff: bad})
			return err
		}(),
		"redislua.NewRedlock": func() error {
			_, err := redislua.NewRedlock([]redislua.Client{c}, &redislua.RedlockOptions{Backoff: bad})
			return err
		}(),
	} {
		var ie *fence.InvalidError
		if !errors.As(err, &ie) || ie.Arg != "Backoff.MaxWait" {
			t.Errorf("%s with %+v = %v, want ErrInvalid naming Backoff.MaxWait", what, bad, err)
		}
	}
}
