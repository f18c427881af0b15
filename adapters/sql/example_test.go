package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	_ "github.com/go-sql-driver/mysql"
)

// A holder whose lease expired writes after the next holder: the fence refuses it.
func Example() {
	dir, _ := os.MkdirTemp("", "example")
	defer os.RemoveAll(dir)
	db, err := sqlfence.OpenSQLite(filepath.Join(dir, "app.db"))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	ctx := context.Background()
	fdb := sqlfence.SQLite(db)
	locks, _ := sqlfence.NewAcquirer(fdb, nil)
	rows, _ := sqlfence.NewWriter(fdb, nil)
	_ = locks.CreateTable(ctx)
	_ = rows.CreateTable(ctx)

	a, _ := locks.TryAcquire(ctx, "invoice-42", 100*time.Millisecond)
	time.Sleep(150 * time.Millisecond) // A pauses past its lease
	b, _ := locks.TryAcquire(ctx, "invoice-42", time.Minute)
	fmt.Println("B writes:", rows.Write(ctx, "invoice-42", []byte("by B"), b.Token()))

	err = rows.Write(ctx, "invoice-42", []byte("by A"), a.Token())
	var stale *fence.StaleError
	fmt.Println("A's write is stale:", errors.As(err, &stale), "- it offered A's token:", stale.Offered == a.Token(), "- the key holds B's:", stale.Current == b.Token())
	fmt.Println("B's token is A's + 1:", b.Token() == a.Token()+1)
	fmt.Println("A's release:", errors.Is(a.Release(ctx), fence.ErrLost))
	v, tok, _ := rows.Read(ctx, "invoice-42")
	fmt.Printf("stored %q with B's token: %v\n", v, tok == b.Token())
	_ = b.Release(ctx)
	// Output:
	// B writes: <nil>
	// A's write is stale: true - it offered A's token: true - the key holds B's: true
	// B's token is A's + 1: true
	// A's release: true
	// stored "by B" with B's token: true
}

// Guard fences every write of a transaction of yours.
func ExampleGuards_Guard() {
	dir, _ := os.MkdirTemp("", "example")
	defer os.RemoveAll(dir)
	db, err := sqlfence.OpenSQLite(filepath.Join(dir, "app.db"))
	if err != nil {
		panic(err)
	}
	defer db.Close()
	ctx := context.Background()
	guards, err := sqlfence.NewGuards(sqlfence.SQLite(db), nil)
	if err != nil {
		panic(err)
	}
	if err := guards.CreateTable(ctx); err != nil {
		panic(err)
	}
	_, _ = db.Exec(`CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER)`)
	_, _ = db.Exec(`INSERT INTO accounts VALUES (7, 100)`)

	debit := func(token fence.Token) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		if err := guards.Guard(ctx, tx, "account-7", token); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE accounts SET balance = balance - 10 WHERE id = 7`); err != nil {
			return err
		}
		return tx.Commit()
	}
	fmt.Println("token 5:", debit(5))
	fmt.Println("token 4 is stale:", errors.Is(debit(4), fence.ErrStale))
	var balance int
	_ = db.QueryRow(`SELECT balance FROM accounts WHERE id = 7`).Scan(&balance)
	fmt.Println("balance:", balance)
	// Output:
	// token 5: <nil>
	// token 4 is stale: true
	// balance: 90
}

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
