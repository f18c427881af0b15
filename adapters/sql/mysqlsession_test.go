package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
)

// sessionMatrix are DSN parameters that change how text reaches a MySQL
// server: a connection character set unlike the client's (with and without
// the packet-limit fallback), client character sets that are not utf8mb4,
// and sql_mode variants.
var sessionMatrix = []string{
	"charset=utf8mb4&character_set_connection=latin1",
	"charset=utf8mb4&character_set_connection=latin1&maxAllowedPacket=4096",
	"charset=latin1",
	"charset=utf8",
	"charset=utf8&character_set_connection=utf8mb4",
	"sql_mode=" + url.QueryEscape("'ANSI_QUOTES'"),
	"sql_mode=" + url.QueryEscape("'NO_BACKSLASH_ESCAPES'"),
	"sql_mode=" + url.QueryEscape("'PAD_CHAR_TO_FULL_LENGTH'"),
	"sql_mode=" + url.QueryEscape("''"),
}

// matrixSuffix makes every key and name of a suite non-ASCII, with a
// 4-byte character and a trailing space.
const matrixSuffix = "/é ü€😀 "

// suffixWriter is a Writer whose keys all end in matrixSuffix; the empty key
// stays empty, so that it is still refused.
type suffixWriter struct{ w *sqlfence.Writer }

func suffixed(k string) string {
	if k == "" {
		return k
	}
	return k + matrixSuffix
}

func unsuffixed(err error) error {
	var se *fence.StaleError
	if errors.As(err, &se) {
		return &fence.StaleError{Key: strings.TrimSuffix(se.Key, matrixSuffix), Offered: se.Offered, Current: se.Current}
	}
	return err
}

func (s suffixWriter) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	return unsuffixed(s.w.Write(ctx, suffixed(key), value, token))
}

func (s suffixWriter) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	return s.w.Read(ctx, suffixed(key))
}

func (s suffixWriter) Delete(ctx context.Context, key string, token fence.Token) error {
	return unsuffixed(s.w.Delete(ctx, suffixed(key), token))
}

// TestMySQLSessionMatrix runs, under every session setting: the
// WriterSuite (its keys made non-ASCII with a trailing space, on the
// package's table and on a table of the user's own with a NO PAD binary
// VARCHAR key), and representative cases of the acquirer with guards and of
// the idempotency store, with values on both sides of the inline limit and
// past the packet limit where the DSN sets one. The AcquirerSuite and the
// idempotencytest Suite run whole under the first setting (a connection
// character set unlike the client's), whose conversions the other settings'
// cases cover.
func TestMySQLSessionMatrix(t *testing.T) {
	raw0, _ := openMySQL(t, "")
	// 768 characters of 4 bytes fill InnoDB's 3072-byte index limit.
	nopad := fmt.Sprintf("user_nopad_%d", time.Now().UnixNano()%1e9)
	var err error
	for _, coll := range []string{"utf8mb4_nopad_bin", "utf8mb4_0900_bin"} {
		if _, err = raw0.Exec("CREATE TABLE " + nopad + " (k VARCHAR(768) CHARACTER SET utf8mb4 COLLATE " + coll + " PRIMARY KEY, v LONGBLOB, f BIGINT NOT NULL)"); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("no NO PAD binary collation: %v", err)
	}
	t.Cleanup(func() { _, _ = raw0.Exec("DROP TABLE IF EXISTS " + nopad) })
	for i, params := range sessionMatrix {
		t.Run(params, func(t *testing.T) {
			raw, fdb := openMySQL(t, params)
			for _, opts := range []*sqlfence.WriterOptions{nil, {Table: nopad, KeyColumn: "k", ValueColumn: "v", FenceColumn: "f"}} {
				w, err := sqlfence.NewWriter(fdb, opts)
				if err != nil {
					t.Fatal(err)
				}
				name := "default"
				if opts != nil {
					name = "nopad_bin"
				}
				t.Run("WriterSuite/"+name, func(t *testing.T) {
					fencetest.WriterSuite{New: func(t *testing.T) fence.FencedWriter { return suffixWriter{w} }, BadKeys: badKeys, Writers: 4, WritesEach: 5}.Run(t)
				})
				t.Run("WriterSizes/"+name, func(t *testing.T) { matrixWriterSizes(t, w) })
			}
			t.Run("AcquirerAndGuards", func(t *testing.T) { matrixAcquirer(t, raw, fdb) })
			t.Run("Idempotency", func(t *testing.T) { matrixIdempotency(t, raw, fdb) })
			if i == 0 {
				t.Run("AcquirerSuite", func(t *testing.T) {
					a := newAcquirerOn(t, fdb, nil)
					fencetest.AcquirerSuite{New: func(t *testing.T) fence.Acquirer { return a }, MaxTTL: sqlfence.MaxTTL, BadNames: badKeys,
						NewOther: otherAcquirer(mysqlOpener(params), nil)}.Run(t)
				})
				t.Run("IdempotencySuite", func(t *testing.T) {
					s := mustStore(t, fdb)
					idempotencytest.Suite{New: func(t *testing.T) idempotency.Store { return s }, BadKeys: badKeys}.Run(t)
				})
			}
		})
	}
}

// matrixSizes straddle the 4096-byte inline limit; past the 4096-byte
// packet limit the driver refuses the inlined statement and the fallback
// sends it with parameters.
var matrixSizes = []int{0, 1, 2000, 4096, 4097, 9000}

// matrixWriterSizes: a non-ASCII key with a trailing space, and the same
// key without it, are two rows; every value size round-trips, a lower token
// is stale whichever path either statement took.
func matrixWriterSizes(t *testing.T, w *sqlfence.Writer) {
	ctx := context.Background()
	key := fencetest.Name("mx") + matrixSuffix
	trimmed := strings.TrimRight(key, " ")
	if err := w.Write(ctx, trimmed, []byte("other"), 1<<40); err != nil {
		t.Fatal(err)
	}
	for j, size := range matrixSizes {
		v := inlinePattern(size)
		tok := fence.Token(100 * (j + 1))
		if err := w.Write(ctx, key, v, tok); err != nil {
			t.Fatalf("Write %d bytes at %d: %v", size, tok, err)
		}
		if got, gt, err := w.Read(ctx, key); err != nil || gt != tok || !bytes.Equal(got, v) {
			t.Fatalf("Read after %d bytes at %d: %d bytes (equal %v) at %d, %v", size, tok, len(got), bytes.Equal(got, v), gt, err)
		}
		for _, lower := range matrixSizes {
			var se *fence.StaleError
			if err := w.Write(ctx, key, inlinePattern(lower), tok-1); !errors.As(err, &se) || se.Current != tok {
				t.Fatalf("Write %d bytes at %d after %d bytes at %d: %v, want a StaleError at %d", lower, tok-1, size, tok, err, tok)
			}
		}
	}
	if got, tok, err := w.Read(ctx, trimmed); err != nil || tok != 1<<40 || string(got) != "other" {
		t.Errorf("the key without its trailing space: %q %d %v", got, tok, err)
	}
}

// matrixAcquirer: a non-ASCII lock name with a trailing space is held once
// (the same name again is refused, the name without the space is another
// lock); its grant's guard advance and Guard in the caller's transaction
// reach one row; Inspect and Bump address it.
func matrixAcquirer(t *testing.T, raw *sql.DB, fdb *sqlfence.DB) {
	ctx := context.Background()
	g := mustGuards(t, fdb)
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{AdvanceGuards: g})
	plain := newAcquirerOn(t, fdb, nil)
	for _, acq := range []*sqlfence.Acquirer{a, plain} {
		name := fencetest.Name("mx-l") + matrixSuffix
		l, err := acq.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := acq.TryAcquire(ctx, name, time.Minute); !errors.Is(err, fence.ErrHeld) {
			t.Errorf("TryAcquire of a held name: %v, want ErrHeld", err)
		}
		other, err := acq.TryAcquire(ctx, strings.TrimRight(name, " "), time.Minute)
		if err != nil {
			t.Errorf("TryAcquire of the name without its trailing space: %v", err)
		} else {
			_ = other.Release(ctx)
		}
		if info, err := acq.Inspect(ctx, name); err != nil || !info.Held || info.Counter != l.Token() {
			t.Errorf("Inspect: %+v %v, want held at %d", info, err, l.Token())
		}
		if err := l.Renew(ctx); err != nil {
			t.Errorf("Renew: %v", err)
		}
		if err := l.Release(ctx); err != nil {
			t.Errorf("Release: %v", err)
		}
		next, err := acq.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if next.Token() <= l.Token() {
			t.Errorf("the next grant's token %d is not above %d", next.Token(), l.Token())
		}
		if acq == a {
			err := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, l.Token()) })
			var se *fence.StaleError
			if !errors.As(err, &se) || se.Current != next.Token() {
				t.Errorf("Guard with the old token: %v, want a StaleError at %d", err, next.Token())
			}
			if err := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, next.Token()) }); err != nil {
				t.Errorf("Guard with the current token: %v", err)
			}
		}
		if err := next.Release(ctx); err != nil {
			t.Errorf("Release: %v", err)
		}
		if err := acq.Bump(ctx, name, next.Token()+10); err != nil {
			t.Errorf("Bump: %v", err)
		}
		if info, err := acq.Inspect(ctx, name); err != nil || info.Counter != next.Token()+10 {
			t.Errorf("Inspect after Bump: %+v %v, want %d", info, err, next.Token()+10)
		}
	}
}

// matrixIdempotency: Do and CompleteTx with non-ASCII keys, fingerprints
// and owners, and results of every size, record and replay exactly.
func matrixIdempotency(t *testing.T, raw *sql.DB, fdb *sqlfence.DB) {
	ctx := context.Background()
	s := mustStore(t, fdb)
	for _, size := range matrixSizes {
		key := fmt.Sprintf("%s%s%d", fencetest.Name("mx-i"), matrixSuffix, size)
		want := inlinePattern(size)
		runs := 0
		for i := 0; i < 2; i++ {
			r, err := idempotency.Do(ctx, s, key, "fp é ", func(context.Context, string) ([]byte, error) { runs++; return want, nil }, nil)
			if err != nil || !bytes.Equal(r.Value, want) {
				t.Fatalf("Do %d with a %d-byte result: %d bytes (equal %v), %v", i, size, len(r.Value), bytes.Equal(r.Value, want), err)
			}
		}
		if runs != 1 {
			t.Errorf("the effect ran %d times, want once", runs)
		}
		// CompleteTx: claimed and armed by the store, completed in the
		// caller's transaction.
		ck := key + "/tx "
		rec, _, err := s.Begin(ctx, ck, "fp é ", "me é ", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Update(ctx, ck, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me é ", Lease: time.Minute}); err != nil {
			t.Fatal(err)
		}
		if err := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return s.CompleteTx(ctx, tx, ck, rec.Fence, want, time.Hour) }); err != nil {
			t.Fatalf("CompleteTx with a %d-byte result: %v", size, err)
		}
		if got, err := s.Get(ctx, ck); err != nil || got.State != idempotency.Completed || !bytes.Equal(got.Result, want) || got.Fingerprint != "fp é " {
			t.Errorf("Get after CompleteTx: %v %d bytes %q, %v", got.State, len(got.Result), got.Fingerprint, err)
		}
	}
}
