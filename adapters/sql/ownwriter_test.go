package sqlfence_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ownTableOptions are a user's table and column names, with an extra column
// the writer does not know.
func ownTableOptions(table string) *sqlfence.WriterOptions {
	return &sqlfence.WriterOptions{Table: table, KeyColumn: "doc_id", ValueColumn: "body", FenceColumn: "version"}
}

// TestWriterOwnTable runs the writer suite on a table of the user's, with
// other column names and an extra column, on SQLite and MySQL (PostgreSQL:
// TestPostgresWriterOwnTable).
func TestWriterOwnTable(t *testing.T) {
	ctx := context.Background()
	t.Run("sqlite", func(t *testing.T) {
		raw, fdb := openSQLite(t)
		if _, err := raw.ExecContext(ctx, `CREATE TABLE documents (doc_id TEXT PRIMARY KEY, body BLOB,
			version INTEGER NOT NULL DEFAULT 0, created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)`); err != nil {
			t.Fatal(err)
		}
		w := newWriterOn(t, fdb, ownTableOptions("documents"))
		fencetest.WriterSuite{New: func(t *testing.T) fence.FencedWriter { return w }, BadKeys: badKeys}.Run(t)
	})
	t.Run("mysql", func(t *testing.T) {
		raw, fdb := openMySQL(t, "")
		table := "documents_" + fencetest.Name("t")[2:]
		if _, err := raw.ExecContext(ctx, fmt.Sprintf("CREATE TABLE %s (doc_id VARBINARY(1024) PRIMARY KEY, body LONGBLOB, "+
			"version BIGINT NOT NULL DEFAULT 0, created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)", table)); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = raw.Exec("DROP TABLE " + table) })
		w := newWriterOn(t, fdb, ownTableOptions(table))
		fencetest.WriterSuite{New: func(t *testing.T) fence.FencedWriter { return w }, BadKeys: badKeys}.Run(t)
	})
}

// guardWriter is a fenced writer built from Guard: each Write is a guarded
// transaction (RunPgxTx) that upserts an ordinary row of the user's table.
// The guard row of the key is the fence.
type guardWriter struct {
	p     *pgxpool.Pool
	g     *sqlfence.Guards
	table string
}

func (g guardWriter) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	if value == nil {
		value = []byte{}
	}
	return sqlfence.RunPgxTx(ctx, g.p, nil, func(tx pgx.Tx) error {
		if err := g.g.GuardPgx(ctx, tx, key, token); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO %s (k, v, by_token) VALUES ($1, $2, $3)
			ON CONFLICT (k) DO UPDATE SET v = excluded.v, by_token = excluded.by_token`, g.table), key, value, int64(token))
		return err
	})
}

func (g guardWriter) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	if err := leasekit.CheckContext("read", ctx); err != nil {
		return nil, 0, err
	}
	if err := leasekit.CheckText("read", "key", key, sqlfence.MaxKeyBytes); err != nil {
		return nil, 0, err
	}
	var (
		v   []byte
		tok int64
	)
	err := g.p.QueryRow(ctx, fmt.Sprintf(`SELECT v, by_token FROM %s WHERE k = $1`, g.table), key).Scan(&v, &tok)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, 0, fence.ErrNotFound
	}
	return v, fence.Token(tok), err
}

// TestPostgresGuardWriterConformance runs the writer suite on writes fenced by
// Guard inside the writer's own transactions: Guard must reject a lower token
// with a StaleError naming the key, and let the transaction's ordinary write
// commit otherwise.
func TestPostgresGuardWriterConformance(t *testing.T) {
	p := pgPool(t, pgOpts{})
	table := "guarded_" + fencetest.Name("t")[2:]
	if _, err := p.Exec(context.Background(), fmt.Sprintf(`CREATE TABLE %s (k TEXT PRIMARY KEY, v BYTEA NOT NULL, by_token BIGINT NOT NULL)`, table)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = p.Exec(context.Background(), "DROP TABLE "+table) })
	w := guardWriter{p: p, g: pgGuards(t, p), table: table}
	fencetest.WriterSuite{New: func(t *testing.T) fence.FencedWriter { return w }, BadKeys: badKeys}.Run(t)
}
