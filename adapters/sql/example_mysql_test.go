package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"log"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	_ "github.com/go-sql-driver/mysql" // registers the "mysql" driver
)

// The same lock and fenced row on MySQL 8 or MariaDB 10.5+, through
// go-sql-driver/mysql, with a guarded transaction of your own. It needs a
// server, so it is compiled but not run.
func ExampleMySQL() {
	ctx := context.Background()
	db, err := sql.Open("mysql", "fencekit:fencekit@tcp(127.0.0.1:3306)/test")
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	fdb := sqlfence.MySQL(db)
	locks, err := sqlfence.NewAcquirer(fdb, nil)
	if err != nil {
		log.Fatal(err)
	}
	rows, err := sqlfence.NewWriter(fdb, nil)
	if err != nil {
		log.Fatal(err)
	}
	guards, err := sqlfence.NewGuards(fdb, nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := errors.Join(locks.CreateTable(ctx), rows.CreateTable(ctx), guards.CreateTable(ctx)); err != nil {
		log.Fatal(err)
	}
	// Your own table; here one invoice.
	if _, err := db.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS invoices (id INT PRIMARY KEY, sent BOOL NOT NULL DEFAULT FALSE)"); err != nil {
		log.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, "INSERT IGNORE INTO invoices (id) VALUES (42)"); err != nil {
		log.Fatal(err)
	}
	err = fence.Hold(ctx, locks, "invoice-42", 10*time.Second, func(ctx context.Context, l fence.Lease) error {
		if err := rows.Write(ctx, "invoice-42.pdf", []byte("%PDF-1.7 ..."), l.Token()); err != nil {
			return err
		}
		// Fence a transaction of yours: the guard takes the guard row's lock.
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if err := guards.Guard(ctx, tx, "invoice-42", l.Token()); err != nil {
			return err // fence.ErrStale: a newer holder exists
		}
		if _, err := tx.ExecContext(ctx, "UPDATE invoices SET sent = 1 WHERE id = 42"); err != nil {
			return err
		}
		return tx.Commit()
	})
	if err != nil {
		log.Fatal(err)
	}
}
