package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
)

// splitSessions are DSN parameters under which the server converts a text
// parameter on its way in: a connection character set unlike the client's.
// The second also makes a statement with a value of a few KiB too large to
// inline (the packet-limit fallback).
var splitSessions = []string{
	"character_set_connection=latin1",
	"charset=utf8mb4&character_set_connection=latin1&maxAllowedPacket=4096",
}

// keyRows returns the hex of every key column value in table's column col
// that starts with prefix, read on a session without conversions.
func keyRows(t *testing.T, raw *sql.DB, table, col, prefix string) []string {
	t.Helper()
	rows, err := raw.QueryContext(context.Background(), "SELECT HEX(`"+col+"`) FROM "+table+" WHERE LEFT(`"+col+"`, LENGTH(X'"+hexOf(prefix)+"')) = X'"+hexOf(prefix)+"'")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []string
	for rows.Next() {
		var h string
		if err := rows.Scan(&h); err != nil {
			t.Fatal(err)
		}
		got = append(got, h)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return got
}

func hexOf(s string) string {
	const digits = "0123456789ABCDEF"
	b := make([]byte, 0, 2*len(s))
	for i := 0; i < len(s); i++ {
		b = append(b, digits[s[i]>>4], digits[s[i]&15])
	}
	return string(b)
}

// TestMySQLWriteSameRowWhateverArgumentPath: a non-ASCII key written with a
// small value (its arguments inlined) and then with a value too large to
// inline (sent as parameters) is one row: the second write, with a lower
// token, is stale, and the large value round-trips byte for byte.
func TestMySQLWriteSameRowWhateverArgumentPath(t *testing.T) {
	ctx := context.Background()
	raw, _ := openMySQL(t, "")
	for _, params := range splitSessions {
		t.Run(params, func(t *testing.T) {
			_, fdb := openMySQL(t, params)
			w, err := sqlfence.NewWriter(fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			key := fencetest.Name("split") + "/café ü€😀 "
			if err := w.Write(ctx, key, []byte("small"), 100); err != nil {
				t.Fatal(err)
			}
			big := bytes.Repeat([]byte("é\xff\x00€"), 1250) // 5000+ bytes, past the inline limit
			err = w.Write(ctx, key, big, 50)
			var se *fence.StaleError
			if !errors.As(err, &se) || se.Current != 100 {
				t.Errorf("Write at 50 with %d bytes after 100: %v, want a StaleError at 100", len(big), err)
			}
			if v, tok, err := w.Read(ctx, key); err != nil || tok != 100 || string(v) != "small" {
				t.Errorf("Read: %q %d %v, want small at 100", v, tok, err)
			}
			if err := w.Write(ctx, key, big, 200); err != nil {
				t.Fatal(err)
			}
			if v, tok, err := w.Read(ctx, key); err != nil || tok != 200 || !bytes.Equal(v, big) {
				t.Errorf("Read after a large write: %d bytes (equal %v) at %d, %v", len(v), bytes.Equal(v, big), tok, err)
			}
			if err := w.Write(ctx, key, []byte("small"), 150); !errors.As(err, &se) || se.Current != 200 {
				t.Errorf("small Write at 150 after a large one at 200: %v, want a StaleError at 200", err)
			}
			if rows := keyRows(t, raw, "fence_values", "key", key[:len(key)-len("/café ü€😀 ")]); len(rows) != 1 || rows[0] != hexOf(key) {
				t.Errorf("rows for the key: %v, want one, %s", rows, hexOf(key))
			}
		})
	}
}

// TestMySQLGuardSameRowAsGrant: the grant's guard advance (in the package's
// own transaction) and Guard in the caller's transaction reach one guard row
// for a non-ASCII name: the old holder's guarded transaction is stale.
func TestMySQLGuardSameRowAsGrant(t *testing.T) {
	ctx := context.Background()
	raw0, _ := openMySQL(t, "")
	for _, params := range splitSessions {
		t.Run(params, func(t *testing.T) {
			raw, fdb := openMySQL(t, params)
			g := mustGuards(t, fdb)
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{AdvanceGuards: g})
			prefix := fencetest.Name("split-g")
			name := prefix + "/café ü€😀 "
			old, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if err := old.Release(ctx); err != nil {
				t.Fatal(err)
			}
			cur, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			defer cur.Release(ctx)
			err = sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, old.Token()) })
			var se *fence.StaleError
			if !errors.As(err, &se) || se.Current != cur.Token() {
				t.Errorf("Guard with the old token %d after a grant of %d: %v, want a StaleError at %d", old.Token(), cur.Token(), err, cur.Token())
			}
			if err := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, cur.Token()) }); err != nil {
				t.Errorf("Guard with the current token: %v", err)
			}
			if rows := keyRows(t, raw0, "fence_guards", "name", prefix); len(rows) != 1 || rows[0] != hexOf(name) {
				t.Errorf("guard rows for the name: %v, want one, %s", rows, hexOf(name))
			}
		})
	}
}

// TestMySQLCompleteTxSameRowAsBegin: CompleteTx in the caller's transaction
// completes the record Begin claimed for a non-ASCII key, with a result on
// either side of the inline limit.
func TestMySQLCompleteTxSameRowAsBegin(t *testing.T) {
	ctx := context.Background()
	raw0, _ := openMySQL(t, "")
	for _, params := range splitSessions {
		t.Run(params, func(t *testing.T) {
			raw, fdb := openMySQL(t, params)
			s := mustStore(t, fdb)
			prefix := fencetest.Name("split-c")
			for i, result := range [][]byte{[]byte("ré"), bytes.Repeat([]byte("é\xff"), 3000)} {
				key := prefix + "/café ü€😀 " + string(rune('a'+i))
				rec, _, err := s.Begin(ctx, key, "fp é", "me é", time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me é", Lease: time.Minute}); err != nil {
					t.Fatal(err)
				}
				err = sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return s.CompleteTx(ctx, tx, key, rec.Fence, result, time.Hour) })
				if err != nil {
					t.Errorf("CompleteTx %d-byte result: %v", len(result), err)
				}
				got, err := s.Get(ctx, key)
				if err != nil || got.State != idempotency.Completed || !bytes.Equal(got.Result, result) || got.Fingerprint != "fp é" {
					t.Errorf("Get after CompleteTx: %v %d-byte result (equal %v) %q, %v", got.State, len(got.Result), bytes.Equal(got.Result, result), got.Fingerprint, err)
				}
			}
			if rows := keyRows(t, raw0, "fence_idempotency", "key", prefix); len(rows) != 2 {
				t.Errorf("records: %v, want two", rows)
			}
		})
	}
}

// wideConnections are connection character sets MariaDB and MySQL accept for
// character_set_connection (not for the client) in which every character,
// ASCII included, takes two or four bytes: a string literal in a statement,
// such as a state name, reaches a BLOB column or a binary comparison as
// those wide bytes.
var wideConnections = []string{
	"character_set_connection=ucs2",
	"character_set_connection=utf16",
	"character_set_connection=utf32&maxAllowedPacket=4096",
}

// TestMySQLWideConnectionCharset: under a wide connection character set the
// writer, the acquirer with guards and the idempotency store (Do, CompleteTx)
// keep every key, name and value exact, as under the session matrix.
func TestMySQLWideConnectionCharset(t *testing.T) {
	for _, params := range wideConnections {
		t.Run(params, func(t *testing.T) {
			raw, fdb := openMySQL(t, params)
			w, err := sqlfence.NewWriter(fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Run("Writer", func(t *testing.T) { matrixWriterSizes(t, w) })
			t.Run("AcquirerAndGuards", func(t *testing.T) { matrixAcquirer(t, raw, fdb) })
			t.Run("Idempotency", func(t *testing.T) { matrixIdempotency(t, raw, fdb) })
		})
	}
}

// TestMySQLIdempotencyStateSharedAcrossConnectionCharsets: a record claimed
// and released on a session with a wide connection character set is seen,
// and claimed again, by a session with the default one, and the other way
// round: the state is the same bytes whichever session wrote it.
func TestMySQLIdempotencyStateSharedAcrossConnectionCharsets(t *testing.T) {
	ctx := context.Background()
	_, plainDB := openMySQL(t, "")
	_, wideDB := openMySQL(t, "character_set_connection=utf32")
	plain, wide := mustStore(t, plainDB), mustStore(t, wideDB)
	for _, order := range [][2]*sqlfence.IdempotencyStore{{wide, plain}, {plain, wide}} {
		first, second := order[0], order[1]
		key := fencetest.Name("wide-state")
		rec, _, err := first.Begin(ctx, key, "fp", "me", time.Minute)
		if err != nil {
			t.Fatalf("Begin: %v", err)
		}
		if got, err := second.Get(ctx, key); err != nil || got.State != idempotency.Claimed || got.Fence != rec.Fence {
			t.Errorf("the other session's Get of a claimed record: %+v, %v; want claimed at %d", got, err, rec.Fence)
		}
		if _, err := first.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Released, Fence: rec.Fence}); err != nil {
			t.Fatalf("release: %v", err)
		}
		again, _, err := second.Begin(ctx, key, "fp", "you", time.Minute)
		if err != nil || again.State != idempotency.Claimed || again.Owner != "you" || again.Fence <= rec.Fence {
			t.Errorf("the other session's Begin after a release: %+v, %v; want claimed by you above %d", again, err, rec.Fence)
		}
	}
}
