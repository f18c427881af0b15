package idempotency_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/idempotency"
)

// Do runs the charge once for the key "order-42"; the second call replays the
// recorded result instead of charging again. The effect key goes to the
// provider as its own Idempotency-Key.
func ExampleDo() {
	dir, err := os.MkdirTemp("", "idempotency-example")
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
	store, err := sqlfence.NewIdempotencyStore(sqlfence.SQLite(db), nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.CreateTable(ctx); err != nil {
		log.Fatal(err)
	}

	charges := 0
	charge := func(ctx context.Context, effectKey string) ([]byte, error) {
		charges++ // a call to the provider, with effectKey as its Idempotency-Key
		return []byte(fmt.Sprintf("ch_%d", charges)), nil
	}
	for i := 0; i < 2; i++ {
		res, err := idempotency.Do(ctx, store, "order-42", "amount=4200", charge, nil)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s replayed=%v\n", res.Value, res.Replayed)
	}
	fmt.Println("charges made:", charges)
	// Output:
	// ch_1 replayed=false
	// ch_1 replayed=true
	// charges made: 1
}
