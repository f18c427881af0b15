package fence_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
)

// Hold runs the work under a lease it renews, and the work's write carries the
// lease's token. A write with an older token, like a paused holder's, is
// refused.
func ExampleHold() {
	dir, err := os.MkdirTemp("", "fence-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := sqlfence.OpenSQLite(filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	ctx := context.Background()
	locks, err := sqlfence.NewAcquirer(sqlfence.SQLite(db), nil)
	if err != nil {
		log.Fatal(err)
	}
	rows, err := sqlfence.NewWriter(sqlfence.SQLite(db), nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := errors.Join(locks.CreateTable(ctx), rows.CreateTable(ctx)); err != nil {
		log.Fatal(err)
	}

	// Tokens start at the database's clock in microseconds (so a deleted
	// lease row never hands out a smaller one) and grow by one per grant.
	var tokens []fence.Token
	for _, report := range []string{"first run", "second run"} {
		err := fence.Hold(ctx, locks, "nightly-report", 10*time.Second, func(ctx context.Context, l fence.Lease) error {
			tokens = append(tokens, l.Token())
			return rows.Write(ctx, "report", []byte(report), l.Token())
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	fmt.Println("the second run's token is larger:", tokens[1] > tokens[0])
	// A late write with the first run's token is stale.
	err = rows.Write(ctx, "report", []byte("late"), tokens[0])
	fmt.Println("late write with the first run's token is stale:", errors.Is(err, fence.ErrStale))
	// Output:
	// the second run's token is larger: true
	// late write with the first run's token is stale: true
}
