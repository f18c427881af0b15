package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/base64"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
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
				w := newWriterOn(t, fdb, opts)
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
		l := mustGrant(t, ctx, acq, name, time.Minute)
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
		next := mustGrant(t, ctx, acq, name, time.Minute)
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
			w := newWriterOn(t, fdb, nil)
			key := fencetest.Name("split") + "/café ü€😀 "
			if err := w.Write(ctx, key, []byte("small"), 100); err != nil {
				t.Fatal(err)
			}
			big := bytes.Repeat([]byte("é\xff\x00€"), 1250) // 5000+ bytes, past the inline limit
			err := w.Write(ctx, key, big, 50)
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
			old := mustGrant(t, ctx, a, name, time.Minute)
			if err := old.Release(ctx); err != nil {
				t.Fatal(err)
			}
			cur := mustGrant(t, ctx, a, name, time.Minute)
			defer cur.Release(ctx)
			err := sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, old.Token()) })
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
			w := newWriterOn(t, fdb, nil)
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

// Inlined arguments (mysqlInline): the package's MySQL statements carry
// their arguments as literals. These tests check, against the real server,
// that a literal means what the bound parameter meant: byte-exact round
// trips of names, keys, values and results (around the 4096-byte inline
// limit) under session settings that change how text reaches the server;
// tokens at MaxToken; the bell's GET_LOCK; the guard advance in the
// package's own transaction; that nothing is prepared any more for small
// arguments; and that a statement whose arguments fit the connection's
// packet limit as parameters still runs once they are inlined.

// inlineSessions are DSN parameters under which a literal could be read
// differently from a parameter: character sets, backslash escapes, double
// quotes as identifiers, MariaDB's EMPTY_STRING_IS_NULL, padding of CHAR.
var inlineSessions = []string{
	"",
	"charset=latin1",
	"charset=utf8",
	"charset=binary",
	"charset=latin1&sql_mode=" + url.QueryEscape("''"),
	"sql_mode=" + url.QueryEscape("'NO_BACKSLASH_ESCAPES,ANSI_QUOTES,STRICT_ALL_TABLES'"),
	"sql_mode=" + url.QueryEscape("'ANSI'"),
	"sql_mode=" + url.QueryEscape("'STRICT_TRANS_TABLES,EMPTY_STRING_IS_NULL'"),
	"sql_mode=" + url.QueryEscape("'PAD_CHAR_TO_FULL_LENGTH,NO_BACKSLASH_ESCAPES'"),
	"interpolateParams=true&sql_mode=" + url.QueryEscape("'NO_BACKSLASH_ESCAPES'"),
	"sql_mode=" + url.QueryEscape("'ORACLE'"),
	"sql_mode=" + url.QueryEscape("'MSSQL,IGNORE_SPACE,HIGH_NOT_PRECEDENCE'"),
}

// inlinePattern is n bytes that hold every byte value, the ones a string
// literal escapes first ('\"?` NUL), and a trailing space.
func inlinePattern(n int) []byte {
	head := []byte("'\\\"?`\x00\xff\xfe?' ")
	b := make([]byte, n)
	for i := range b {
		if i < len(head) {
			b[i] = head[i]
		} else {
			b[i] = byte(i * 7)
		}
	}
	if n > 0 {
		b[n-1] = ' '
	}
	return b
}

// inlineNames are names, keys and owners with the bytes a literal could
// mangle. Each is made unique by a prefix.
var inlineNames = []string{
	"q'uote", `back\slash`, `back\`, "what?", "a??b", "\u00ff\u00fe-latin1", "trail  ", "MiXeD", "pct%_", "`tick`", `dq"x"`,
	"emoji\U0001F600", "x'41'", "0x41", "NULL", "", // "" becomes just the prefix
}

// inlineSizes straddle the 4096-byte inline limit.
var inlineSizes = []int{0, 1, 4095, 4096, 4097, 9000}

// TestMySQLInlineRoundTrips: under every session setting, Writer values,
// idempotency results, fingerprints and owners, and lease owners come back
// byte for byte, and names and keys address their own rows.
func TestMySQLInlineRoundTrips(t *testing.T) {
	ctx := context.Background()
	for _, params := range inlineSessions {
		t.Run("params="+params, func(t *testing.T) {
			raw, fdb := openMySQL(t, params)
			if strings.Contains(params, "EMPTY_STRING_IS_NULL") {
				var mode string
				if err := raw.QueryRowContext(ctx, "SELECT @@SESSION.sql_mode").Scan(&mode); err != nil || !strings.Contains(mode, "EMPTY_STRING_IS_NULL") {
					t.Skipf("no EMPTY_STRING_IS_NULL: %q %v", mode, err)
				}
			}
			w := newWriterOn(t, fdb, nil)
			s, err := sqlfence.NewIdempotencyStore(fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			p := fencetest.Name("inl") + "/"
			t.Run("writer", func(t *testing.T) {
				for i, n := range inlineNames {
					key := p + "w/" + n
					for j, size := range inlineSizes {
						v := inlinePattern(size + i) // vary with the key too
						tok := fence.Token(10 * (j + 1))
						if err := w.Write(ctx, key, v, tok); err != nil {
							t.Fatalf("Write %q (%d bytes) token %d: %v", key, len(v), tok, err)
						}
						got, gt, err := w.Read(ctx, key)
						if err != nil || string(got) != string(v) || gt != tok {
							t.Fatalf("Read %q after writing %d bytes at %d: %d bytes (equal %v), token %d, %v", key, len(v), tok, len(got), string(got) == string(v), gt, err)
						}
						// Same token, new bytes: an equal token writes.
						v2 := append(append([]byte(nil), v...), 'z')
						if err := w.Write(ctx, key, v2, tok); err != nil {
							t.Fatalf("rewrite at the same token: %v", err)
						}
						if got, _, _ := w.Read(ctx, key); string(got) != string(v2) {
							t.Fatalf("Read after an equal-token write: %d bytes, want %d", len(got), len(v2))
						}
						var se *fence.StaleError
						if err := w.Write(ctx, key, []byte("stale"), tok-1); !errors.As(err, &se) || se.Current != tok {
							t.Fatalf("Write %q below %d: %v, want a StaleError at %d", key, tok, err, tok)
						}
					}
					if err := w.Delete(ctx, key, 1000); err != nil {
						t.Fatal(err)
					}
					if _, _, err := w.Read(ctx, key); !errors.Is(err, fence.ErrNotFound) {
						t.Fatalf("Read %q after Delete: %v, want ErrNotFound", key, err)
					}
				}
				// Every name is its own row: read back what each was given.
				for i, n := range inlineNames {
					key := p + "w2/" + n
					if err := w.Write(ctx, key, []byte(fmt.Sprint(i)), 1); err != nil {
						t.Fatal(err)
					}
				}
				for i, n := range inlineNames {
					key := p + "w2/" + n
					if got, _, err := w.Read(ctx, key); err != nil || string(got) != fmt.Sprint(i) {
						t.Fatalf("Read %q: %q, %v; want %d", key, got, err, i)
					}
				}
				var n int
				if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM fence_values WHERE `key` LIKE CAST(? AS BINARY)", []byte(p+"w2/%")).Scan(&n); err != nil || n != len(inlineNames) {
					t.Fatalf("rows for %d distinct keys: %d, %v", len(inlineNames), n, err)
				}
				// A stored key holds the exact bytes given.
				for _, name := range inlineNames {
					key := p + "w2/" + name
					var c int
					if err := raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM fence_values WHERE HEX(`key`) = ?", fmt.Sprintf("%X", key)).Scan(&c); err != nil || c != 1 {
						t.Fatalf("key %q is not stored as its bytes: %d rows, %v", key, c, err)
					}
				}
			})
			t.Run("idempotency", func(t *testing.T) {
				for i, n := range inlineNames {
					if !validUTF8NoNUL(n) {
						continue // fingerprints and owners must be valid text
					}
					for _, size := range inlineSizes {
						key := fmt.Sprintf("%si%d-%d/%s", p, i, size, n)
						fp, owner := "fp"+n, "own"+n
						if n == "" {
							fp, owner = "", ""
						}
						rec, claimed, err := s.Begin(ctx, key, fp, owner, time.Minute)
						if err != nil || !claimed {
							t.Fatalf("Begin %q: %v %v", key, claimed, err)
						}
						if rec.Fingerprint != fp || rec.Owner != owner {
							t.Fatalf("Begin %q: record %+v", key, rec)
						}
						got, err := s.Get(ctx, key)
						if err != nil || got.Fingerprint != fp || got.Owner != owner || got.State != idempotency.Claimed || got.Fence != rec.Fence {
							t.Fatalf("Get %q after Begin: %+v %v; want fingerprint %q owner %q", key, got, err, fp, owner)
						}
						armed, err := s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: owner, Lease: time.Minute})
						if err != nil || armed.State != idempotency.Armed || armed.Owner != owner {
							t.Fatalf("arm %q: %+v %v", key, armed, err)
						}
						res := inlinePattern(size)
						if size == 0 {
							res = []byte{}
						}
						done, err := s.Update(ctx, key, idempotency.Armed, rec.Fence, idempotency.Change{State: idempotency.Completed, Fence: rec.Fence, Result: res, Retention: time.Hour})
						if err != nil || done.State != idempotency.Completed || string(done.Result) != string(res) {
							t.Fatalf("complete %q with %d bytes: state %q, %d bytes back (equal %v), %v", key, len(res), done.State, len(done.Result), string(done.Result) == string(res), err)
						}
						got, err = s.Get(ctx, key)
						if err != nil || string(got.Result) != string(res) || got.Fingerprint != fp || got.ResultDropped {
							t.Fatalf("Get %q: %d bytes (equal %v), %v", key, len(got.Result), string(got.Result) == string(res), err)
						}
						// A second Begin sees the completed record, not a claim.
						again, claimed, err := s.Begin(ctx, key, fp, "other", time.Minute)
						if err != nil || claimed || again.State != idempotency.Completed || string(again.Result) != string(res) {
							t.Fatalf("Begin %q on a completed record: %v %v %v", key, claimed, again.State, err)
						}
					}
				}
			})
			t.Run("idempotency-do", func(t *testing.T) {
				for _, size := range inlineSizes {
					key := fmt.Sprintf("%sdo%d", p, size)
					want := inlinePattern(size)
					runs := 0
					eff := func(context.Context, string) ([]byte, error) { runs++; return want, nil }
					r, err := idempotency.Do(ctx, s, key, "fp'?\\", eff, &idempotency.Options{Lease: 5 * time.Second})
					if err != nil || string(r.Value) != string(want) {
						t.Fatalf("Do %d bytes: %d bytes (equal %v), %v", size, len(r.Value), string(r.Value) == string(want), err)
					}
					r, err = idempotency.Do(ctx, s, key, "fp'?\\", eff, &idempotency.Options{Lease: 5 * time.Second})
					if err != nil || string(r.Value) != string(want) || runs != 1 {
						t.Fatalf("replayed Do %d bytes: %d bytes (equal %v), runs %d, %v", size, len(r.Value), string(r.Value) == string(want), runs, err)
					}
				}
			})
			t.Run("locks", func(t *testing.T) {
				for i, n := range inlineNames {
					if !validUTF8NoNUL(n) {
						continue // owners must be valid text
					}
					owner := "own" + n
					a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Owner: owner})
					name := fmt.Sprintf("%sl%d/%s", p, i, n)
					l, err := a.TryAcquire(ctx, name, time.Minute)
					if err != nil {
						t.Fatalf("TryAcquire %q: %v", name, err)
					}
					info, err := a.Inspect(ctx, name)
					if err != nil || !info.Held || info.Owner != owner || info.Token != l.Token() {
						t.Fatalf("Inspect %q: %+v %v; want held by %q at %d", name, info, err, owner, l.Token())
					}
					if _, err := a.TryAcquire(ctx, name, time.Minute); !errors.Is(err, fence.ErrHeld) {
						t.Fatalf("second TryAcquire %q: %v, want ErrHeld", name, err)
					}
					if err := l.Renew(ctx); err != nil {
						t.Fatalf("Renew %q: %v", name, err)
					}
					if err := l.Release(ctx); err != nil {
						t.Fatalf("Release %q: %v", name, err)
					}
					if info, err := a.Inspect(ctx, name); err != nil || info.Held {
						t.Fatalf("Inspect %q after release: %+v %v", name, info, err)
					}
					// Bump to MaxToken: the next grant is MaxToken itself.
					if err := a.Bump(ctx, name, fence.MaxToken-1); err != nil {
						t.Fatalf("Bump %q: %v", name, err)
					}
					l, err = a.TryAcquire(ctx, name, time.Minute)
					if err != nil || l.Token() != fence.MaxToken {
						t.Fatalf("grant after Bump to MaxToken-1: %v %v", l, err)
					}
					_ = l.Release(ctx)
				}
			})
		})
	}
}

func validUTF8NoNUL(s string) bool {
	return strings.ToValidUTF8(s, "\ufffd") == s && !strings.ContainsRune(s, 0)
}

// TestMySQLInlineTokensAtMax: fences at MaxToken through the Writer, the
// Bump of a new name at MaxToken, and an exhausted name.
func TestMySQLInlineTokensAtMax(t *testing.T) {
	ctx := context.Background()
	_, fdb := openMySQL(t, "")
	w, _ := sqlfence.NewWriter(fdb, nil)
	key := fencetest.Name("inl-max")
	if err := w.Write(ctx, key, []byte("a"), fence.MaxToken-1); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("b"), fence.MaxToken); err != nil {
		t.Fatal(err)
	}
	var se *fence.StaleError
	if err := w.Write(ctx, key, []byte("c"), fence.MaxToken-1); !errors.As(err, &se) || se.Current != fence.MaxToken {
		t.Fatalf("stale write below MaxToken: %v", err)
	}
	if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "b" || tok != fence.MaxToken {
		t.Fatalf("Read: %q %d %v", v, tok, err)
	}
	a, _ := sqlfence.NewAcquirer(fdb, nil)
	name := fencetest.Name("inl-max-bump")
	if err := a.Bump(ctx, name, fence.MaxToken); err != nil {
		t.Fatalf("Bump of a new name to MaxToken: %v", err)
	}
	if info, err := a.Inspect(ctx, name); err != nil || info.Counter != fence.MaxToken {
		t.Fatalf("Inspect after Bump to MaxToken: %+v %v", info, err)
	}
	if l, err := a.TryAcquire(ctx, name, time.Minute); err == nil {
		t.Fatalf("grant past MaxToken: token %d", l.Token())
	}
	if info, err := a.Inspect(ctx, name); err != nil || info.Counter != fence.MaxToken || info.Held {
		t.Fatalf("Inspect after a refused grant: %+v %v", info, err)
	}
}

// TestMySQLInlineAdvanceGuards: the grant and the guard advance run in the
// package's own transaction, inlined; the guard row holds the grant's token
// under the exact name, in every session setting.
func TestMySQLInlineAdvanceGuards(t *testing.T) {
	ctx := context.Background()
	for _, params := range inlineSessions {
		t.Run("params="+params, func(t *testing.T) {
			raw, fdb := openMySQL(t, params)
			g, err := sqlfence.NewGuards(fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{AdvanceGuards: g})
			for i, n := range inlineNames {
				name := fmt.Sprintf("%s/g%d/%s", fencetest.Name("inl-g"), i, n)
				l, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatalf("TryAcquire %q: %v", name, err)
				}
				var f int64
				if err := raw.QueryRowContext(ctx, "SELECT fence FROM fence_guards WHERE HEX(name) = ?", fmt.Sprintf("%X", name)).Scan(&f); err != nil || fence.Token(f) != l.Token() {
					t.Fatalf("guard row of %q: %d, %v; want %d", name, f, err, l.Token())
				}
				err = sqlfence.RunTx(ctx, raw, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, l.Token()-1) })
				var se *fence.StaleError
				if !errors.As(err, &se) || se.Current != l.Token() {
					t.Fatalf("Guard %q below the grant's token: %v", name, err)
				}
				_ = l.Release(ctx)
			}
		})
	}
}

// TestMySQLInlineBellTaken: with bells, the grant's inlined GET_LOCK takes
// the name's bell (held by a session other than ours), and the release lets
// it go, under session settings that change how literals read.
func TestMySQLInlineBellTaken(t *testing.T) {
	ctx := context.Background()
	for _, params := range inlineSessions {
		t.Run("params="+params, func(t *testing.T) {
			_, fdb := openMySQL(t, params)
			check, _ := openMySQL(t, "")
			a := newAcquirerOn(t, fdb, nil)
			name := fencetest.Name("inl-bell") + "/q'?\\"
			// The bell is taken by a grant that takes over an expired row.
			l := mustGrant(t, ctx, a, name, 200*time.Millisecond)
			time.Sleep(400 * time.Millisecond)
			_ = l.Release(ctx)
			l = mustGrant(t, ctx, a, name, time.Minute)
			if sqlfence.BellPinned(a) < 0 {
				t.Skip("no bells")
			}
			key := sqlfence.BellKey(a, name)
			var holder sql.NullInt64
			if err := check.QueryRowContext(ctx, "SELECT IS_USED_LOCK(?)", key).Scan(&holder); err != nil {
				t.Fatal(err)
			}
			if !holder.Valid {
				t.Fatalf("the bell %q is not held after a takeover grant (pinned %d)", key, sqlfence.BellPinned(a))
			}
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(3 * time.Second)
			for {
				if err := check.QueryRowContext(ctx, "SELECT IS_USED_LOCK(?)", key).Scan(&holder); err != nil {
					t.Fatal(err)
				}
				if !holder.Valid || time.Now().After(deadline) {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if holder.Valid {
				t.Fatalf("the bell %q is still held by session %d after the release", key, holder.Int64)
			}
		})
	}
}

// TestMySQLInlineNoPrepare: the change's claim, each of the package's
// statements with small arguments is one round trip (nothing prepared), for
// every operation of the Writer, the Acquirer (with AdvanceGuards, in the
// package's own transaction) and the idempotency store; a value over the
// inline limit still goes as a parameter (prepared), which shows the
// counter counts.
func TestMySQLInlineNoPrepare(t *testing.T) {
	ctx := context.Background()
	db, fdb := openMySQL(t, "")
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	w, _ := sqlfence.NewWriter(fdb, nil)
	g, _ := sqlfence.NewGuards(fdb, nil)
	a, _ := sqlfence.NewAcquirer(fdb, &sqlfence.AcquirerOptions{DisableNotify: true})
	ag, _ := sqlfence.NewAcquirer(fdb, &sqlfence.AcquirerOptions{DisableNotify: true, AdvanceGuards: g})
	s, _ := sqlfence.NewIdempotencyStore(fdb, nil)
	p := fencetest.Name("inl-prep")
	prepared := func(what string, want int64, f func() error) {
		t.Helper()
		before := sessionStatus(t, db, "Com_stmt_prepare")
		if err := f(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if n := sessionStatus(t, db, "Com_stmt_prepare") - before; n != want {
			t.Errorf("%s prepared %d statements, want %d", what, n, want)
		}
	}
	key := p + "/k"
	prepared("Write (new key)", 0, func() error { return w.Write(ctx, key, []byte("v"), 2) })
	prepared("Write (existing key)", 0, func() error { return w.Write(ctx, key, []byte("v2"), 3) })
	prepared("Write (stale)", 0, func() error {
		if err := w.Write(ctx, key, []byte("x"), 1); !errors.Is(err, fence.ErrStale) {
			return fmt.Errorf("stale write: %v", err)
		}
		return nil
	})
	prepared("Read", 0, func() error { _, _, err := w.Read(ctx, key); return err })
	prepared("Delete", 0, func() error { return w.Delete(ctx, key, 4) })
	prepared("Write (4097 bytes)", 1, func() error { return w.Write(ctx, key, inlinePattern(4097), 5) })
	var l fence.Lease
	name := p + "/n"
	prepared("TryAcquire", 0, func() (err error) { l, err = a.TryAcquire(ctx, name, time.Minute); return err })
	prepared("Renew", 0, func() error { return l.Renew(ctx) })
	prepared("Inspect", 0, func() error { _, err := a.Inspect(ctx, name); return err })
	prepared("Release", 0, func() error { return l.Release(ctx) })
	prepared("Bump", 0, func() error { return a.Bump(ctx, name, 1<<52) })
	prepared("TryAcquire with AdvanceGuards", 0, func() (err error) { l, err = ag.TryAcquire(ctx, p+"/g", time.Minute); return err })
	prepared("Release with AdvanceGuards", 0, func() error { return l.Release(ctx) })
	ik := p + "/i"
	var rec idempotency.Record
	prepared("Begin", 0, func() (err error) { rec, _, err = s.Begin(ctx, ik, "fp", "owner", time.Minute); return err })
	prepared("Update (arm)", 0, func() error {
		_, err := s.Update(ctx, ik, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "owner", Lease: time.Minute})
		return err
	})
	prepared("Update (complete)", 0, func() error {
		_, err := s.Update(ctx, ik, idempotency.Armed, rec.Fence, idempotency.Change{State: idempotency.Completed, Fence: rec.Fence, Result: []byte("r"), Retention: time.Hour})
		return err
	})
	prepared("Get", 0, func() error { _, err := s.Get(ctx, ik); return err })
}

// TestMySQLInlinePacketLimit: the connection's max_allowed_packet
// (maxAllowedPacket in the DSN, or the server's when it is 0) bounds one
// packet. A parameter the driver sends in parts (COM_STMT_SEND_LONG_DATA)
// when it is large; a value inlined as hex doubles in size and must fit in
// the one COM_QUERY packet. A write of 3000 bytes, a result of 3000 bytes
// and a lock name of MaxKeyBytes all fit as parameters on a 4096-byte (and
// 2048-byte) packet limit; they must still work once inlined.
func TestMySQLInlinePacketLimit(t *testing.T) {
	ctx := context.Background()
	t.Run("writer-4096", func(t *testing.T) {
		_, fdb := openMySQL(t, "maxAllowedPacket=4096")
		w, _ := sqlfence.NewWriter(fdb, nil)
		key := fencetest.Name("inl-pkt")
		for _, size := range []int{1500, 2100, 3000, 4096} {
			v := inlinePattern(size)
			if err := w.Write(ctx, key, v, fence.Token(size)); err != nil {
				t.Errorf("Write of %d bytes with maxAllowedPacket=4096: %v", size, err)
				continue
			}
			if got, _, err := w.Read(ctx, key); err != nil || string(got) != string(v) {
				t.Errorf("Read of %d bytes: %d bytes, %v", size, len(got), err)
			}
		}
	})
	t.Run("idempotency-4096", func(t *testing.T) {
		_, fdb := openMySQL(t, "maxAllowedPacket=4096")
		s, _ := sqlfence.NewIdempotencyStore(fdb, nil)
		want := inlinePattern(3000)
		r, err := idempotency.Do(ctx, s, fencetest.Name("inl-pkt-do"), "fp", func(context.Context, string) ([]byte, error) { return want, nil }, nil)
		if err != nil || string(r.Value) != string(want) {
			t.Errorf("Do with a 3000-byte result, maxAllowedPacket=4096: %d bytes, %v", len(r.Value), err)
		}
	})
	t.Run("lock-2048", func(t *testing.T) {
		_, fdb := openMySQL(t, "maxAllowedPacket=2048")
		a, _ := sqlfence.NewAcquirer(fdb, nil)
		p := fencetest.Name("inl-pkt-l") + "/"
		name := p + strings.Repeat("n", sqlfence.MaxKeyBytes-len(p))
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatalf("TryAcquire of a %d-byte name, maxAllowedPacket=2048: %v", len(name), err)
		}
		if err := l.Release(ctx); err != nil {
			t.Errorf("Release: %v", err)
		}
	})
}

// TestMySQLInlineLostReplyAtLimit: a Write whose reply is lost reports
// fence.ErrUnknown and landed, on both sides of the inline limit (4096
// bytes: one inlined COM_QUERY; 4097: prepared with the key inlined, the
// value in the execute), for a new key and an existing one; the lost reply
// is the request that carries the value (in hex inlined, or in base64 as a
// parameter), the one that runs the statement.
func TestMySQLInlineLostReplyAtLimit(t *testing.T) {
	ctx := context.Background()
	_, direct := openMySQL(t, "")
	px := faultnet.Start(t, mysqlAddr(t))
	w, _ := sqlfence.NewWriter(sqlfence.MySQL(proxiedMySQL(t, px)), nil)
	check, _ := sqlfence.NewWriter(direct, nil)
	for _, size := range []int{4096, 4097} {
		key := fencetest.Name("inl-lost")
		if err := w.Write(ctx, key, []byte("old"), 1); err != nil {
			t.Fatal(err)
		}
		v := inlinePattern(size)
		b64 := []byte(base64.StdEncoding.EncodeToString(v))
		carriesValue := func(b []byte) bool { return faultnet.Carries(b, string(v)) || bytes.Contains(b, b64) }
		wantUnknown(t, fmt.Sprintf("Write of %d bytes", size), lose(t, px, carriesValue, func() error { return w.Write(ctx, key, v, 5) }))
		got, tok, err := check.Read(ctx, key)
		if err != nil || string(got) != string(v) || tok != 5 {
			t.Errorf("%d bytes: the key after the lost write: %d bytes, %d, %v; want the write (it landed)", size, len(got), tok, err)
		}
		// And an exact retry recognises its own write (equal token, equal bytes).
		if err := w.Write(ctx, key, v, 5); err != nil {
			t.Errorf("%d bytes: retry of the lost write: %v", size, err)
		}
	}
}
