package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
)

// store is a fenced writer that can also read.
type store interface {
	fence.FencedWriter
	fence.Reader
}

// backend is what the demo and the benchmarks need from one lock backend.
type backend struct {
	name   string
	acq    fence.Acquirer
	fenced store
	// plainPut and plainGet are an unfenced store, the "before" of the lesson.
	plainPut func(ctx context.Context, key string, value []byte) error
	plainGet func(ctx context.Context, key string) ([]byte, error)
	// forceRelease frees a lock without checking whose it is: the lesson's
	// plain-DEL release bug, for the demo to show what it does.
	forceRelease func(ctx context.Context, name string) error
	close        func() error
}

var backendNames = []string{"sqlite"}

// openSQLiteBackend opens path, or a temporary file when path is empty.
func openSQLiteBackend(ctx context.Context, path string) (*backend, error) {
	cleanup := func() error { return nil }
	if path == "" {
		dir, err := os.MkdirTemp("", "fence-")
		if err != nil {
			return nil, err
		}
		path = filepath.Join(dir, "demo.db")
		cleanup = func() error { return os.RemoveAll(dir) }
	}
	db, err := sqlfence.OpenSQLite(path)
	if err != nil {
		return nil, errors.Join(err, cleanup())
	}
	fdb := sqlfence.SQLite(db)
	fail := func(err error) (*backend, error) {
		return nil, errors.Join(err, db.Close(), cleanup())
	}
	w, err := sqlfence.NewWriter(fdb, nil)
	if err != nil {
		return fail(err)
	}
	a, err := sqlfence.NewAcquirer(fdb, nil)
	if err != nil {
		return fail(err)
	}
	if err := w.CreateTable(ctx); err != nil {
		return fail(err)
	}
	if err := a.CreateTable(ctx); err != nil {
		return fail(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS demo_plain (key TEXT PRIMARY KEY, value BLOB NOT NULL)`); err != nil {
		return fail(err)
	}
	return &backend{
		name:   "sqlite (" + path + ")",
		acq:    a,
		fenced: w,
		plainPut: func(ctx context.Context, key string, value []byte) error {
			_, err := db.ExecContext(ctx, `INSERT INTO demo_plain (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = excluded.value`, key, value)
			return err
		},
		plainGet: func(ctx context.Context, key string) ([]byte, error) {
			var v []byte
			err := db.QueryRowContext(ctx, `SELECT value FROM demo_plain WHERE key = $1`, key).Scan(&v)
			if errors.Is(err, sql.ErrNoRows) {
				return nil, fence.ErrNotFound
			}
			return v, err
		},
		forceRelease: func(ctx context.Context, name string) error {
			// The documented lease table, released the wrong way: no token check.
			_, err := db.ExecContext(ctx, `UPDATE fence_leases SET expires_at = 0 WHERE name = $1`, name)
			return err
		},
		close: func() error { return errors.Join(db.Close(), cleanup()) },
	}, nil
}

func openBackend(ctx context.Context, name, dbPath string) (*backend, error) {
	switch name {
	case "sqlite":
		return openSQLiteBackend(ctx, dbPath)
	default:
		return nil, fmt.Errorf("%w: unknown backend %q (have: %s)", errUsage, name, strings.Join(backendNames, ", "))
	}
}
