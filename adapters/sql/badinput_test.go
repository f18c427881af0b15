package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"math"
	"net/url"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestNilHandlesAndBadOptions: constructors refuse nil handles and negative
// options with ErrInvalid instead of panicking later.
func TestNilHandlesAndBadOptions(t *testing.T) {
	var nilPool *pgxpool.Pool
	for what, db := range map[string]*sqlfence.DB{
		"nil *DB": nil, "SQLite(nil)": sqlfence.SQLite(nil), "Postgres(nil)": sqlfence.Postgres(nil),
		"Pgx(nil)": sqlfence.Pgx(nil), "Pgx(nil pool)": sqlfence.Pgx(nilPool),
	} {
		if _, err := sqlfence.NewWriter(db, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewWriter(%s): %v", what, err)
		}
		if _, err := sqlfence.NewAcquirer(db, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewAcquirer(%s): %v", what, err)
		}
		if _, err := sqlfence.NewIdempotencyStore(db, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewIdempotencyStore(%s): %v", what, err)
		}
		if _, err := sqlfence.NewGuards(db, nil); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewGuards(%s): %v", what, err)
		}
	}
	_, fdb := openSQLite(t)
	for _, b := range []fence.Backoff{{Min: -1}, {Max: -time.Second}, {MaxWait: -time.Second}} {
		if _, err := sqlfence.NewAcquirer(fdb, &sqlfence.AcquirerOptions{Backoff: b}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewAcquirer with Backoff %+v: %v", b, err)
		}
	}
}

// TestNilContextLeavesHandleUsable: a nil context used to panic inside
// database/sql and leave the SQLite handle's mutex locked, so Close hung. Now it
// is refused before the handle is touched, and the handle still works and
// closes.
func TestNilContextLeavesHandleUsable(t *testing.T) {
	db, fdb := openSQLite(t)
	w, a := newSQLiteWriter(t, fdb), newSQLiteAcquirer(t, fdb)
	var nilCtx context.Context
	if err := w.Write(nilCtx, "k", []byte("v"), 1); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("Write with a nil context: %v", err)
	}
	if _, err := a.TryAcquire(nilCtx, "n", time.Second); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("TryAcquire with a nil context: %v", err)
	}
	g, err := sqlfence.NewGuards(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Guard(nilCtx, nil, "n", 1); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("Guard with a nil context: %v", err)
	}
	if err := w.Write(context.Background(), "k", []byte("v"), 1); err != nil {
		t.Fatalf("Write after the refused calls: %v", err)
	}
	closed := make(chan error, 1)
	go func() { closed <- db.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("db.Close hung: the handle was left locked")
	}
}

// TestLongestKeys: a key and a lock name of exactly MaxKeyBytes, in multi-byte
// characters that do not compress, are stored on both dialects.
func TestLongestKeys(t *testing.T) {
	// 1012 bytes of 3-byte characters and one ASCII byte, then 12 unique ones.
	var b strings.Builder
	for i := 0; i < 337; i++ {
		b.WriteRune(rune(0x4e00 + (i*7919)%20000))
	}
	b.WriteString("y")
	_, sq := openSQLite(t)
	handles := map[string]*sqlfence.DB{"sqlite": sq}
	for style, fdb := range pgHandles(t) {
		handles["postgres/"+style] = fdb
	}
	ctx := context.Background()
	for what, fdb := range handles {
		w := newWriterOn(t, fdb, nil)
		if err := w.CreateTable(ctx); err != nil {
			t.Fatal(err)
		}
		key := b.String() + fencetest.Name("")[1:]
		if len(key) != sqlfence.MaxKeyBytes {
			t.Fatalf("built a key of %d bytes", len(key))
		}
		if err := w.Write(ctx, key, []byte("v"), 1); err != nil {
			t.Errorf("%s: Write with a %d-byte key: %v", what, len(key), err)
		}
		a := newAcquirerOn(t, fdb, nil)
		if err := a.CreateTable(ctx); err != nil {
			t.Fatal(err)
		}
		l, err := a.TryAcquire(ctx, key, time.Second)
		if err != nil {
			t.Errorf("%s: TryAcquire with a %d-byte name: %v", what, len(key), err)
			continue
		}
		_ = l.Release(ctx)
	}
}

// TestRunTxBadInput: RunTx and RunPgxTx refuse a nil context, handle or
// function with ErrInvalid instead of panicking.
func TestRunTxBadInput(t *testing.T) {
	db, _ := openSQLite(t)
	p := pgPool(t, pgOpts{})
	ok := func(*sql.Tx) error { return nil }
	okPgx := func(pgx.Tx) error { return nil }
	var nilPool *pgxpool.Pool
	var nilCtx context.Context // the nil context is the input under test
	for name, err := range map[string]error{
		"RunTx nil ctx":    sqlfence.RunTx(nilCtx, db, nil, ok),
		"RunTx nil db":     sqlfence.RunTx(context.Background(), nil, nil, ok),
		"RunTx nil f":      sqlfence.RunTx(context.Background(), db, nil, nil),
		"RunPgxTx nil ctx": sqlfence.RunPgxTx(nilCtx, p, nil, okPgx),
		"RunPgxTx nil db":  sqlfence.RunPgxTx(context.Background(), nilPool, nil, okPgx),
		"RunPgxTx nil f":   sqlfence.RunPgxTx(context.Background(), p, nil, nil),
	} {
		if !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
}

// TestRunTxBadOptions (inputs at the limits): a negative MaxAttempts, an isolation
// level that database/sql does not define and pgx transaction modes that pgx
// does not define are refused with ErrInvalid naming the option, before a
// transaction begins (f never runs); a MaxAttempts of math.MaxInt is a bound
// like any other.
func TestRunTxBadOptions(t *testing.T) {
	ctx := context.Background()
	db, _ := openSQLite(t)
	p := pgPool(t, pgOpts{})
	runs := 0
	f := func(*sql.Tx) error { runs++; return nil }
	fPgx := func(pgx.Tx) error { runs++; return nil }
	for _, c := range []struct {
		name, arg string
		run       func() error
	}{
		{"RunTx MaxAttempts -1", "MaxAttempts", func() error { return sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{MaxAttempts: -1}, f) }},
		{"RunTx MaxAttempts MinInt", "MaxAttempts", func() error { return sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{MaxAttempts: math.MinInt}, f) }},
		{"RunTx Isolation 99", "Isolation", func() error { return sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{Isolation: 99}, f) }},
		{"RunTx Isolation -1", "Isolation", func() error { return sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{Isolation: -1}, f) }},
		{"RunPgxTx MaxAttempts -1", "MaxAttempts", func() error { return sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{MaxAttempts: -1}, fPgx) }},
		{"RunPgxTx IsoLevel", "TxOptions.IsoLevel", func() error {
			return sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{TxOptions: pgx.TxOptions{IsoLevel: "snapshot"}}, fPgx)
		}},
		{"RunPgxTx AccessMode", "TxOptions.AccessMode", func() error {
			return sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{TxOptions: pgx.TxOptions{AccessMode: "read only; SELECT 1"}}, fPgx)
		}},
		{"RunPgxTx DeferrableMode", "TxOptions.DeferrableMode", func() error {
			return sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{TxOptions: pgx.TxOptions{DeferrableMode: "later"}}, fPgx)
		}},
	} {
		runs = 0
		err := c.run()
		var inv *fence.InvalidError
		if !errors.As(err, &inv) || inv.Arg != c.arg {
			t.Errorf("%s: %v, want ErrInvalid naming %s", c.name, err, c.arg)
		}
		if runs != 0 {
			t.Errorf("%s: f ran %d times, want 0", c.name, runs)
		}
	}
	runs = 0
	if err := sqlfence.RunTx(ctx, db, &sqlfence.TxOptions{MaxAttempts: math.MaxInt}, f); err != nil || runs != 1 {
		t.Errorf("RunTx MaxAttempts MaxInt: %v after %d runs, want nil after 1", err, runs)
	}
	runs = 0
	if err := sqlfence.RunPgxTx(ctx, p, &sqlfence.PgxTxOptions{MaxAttempts: math.MaxInt, TxOptions: pgx.TxOptions{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadOnly, DeferrableMode: pgx.Deferrable}}, fPgx); err != nil || runs != 1 {
		t.Errorf("RunPgxTx MaxAttempts MaxInt, serializable read only deferrable: %v after %d runs, want nil after 1", err, runs)
	}
}

// TestTTLNotAboveDrift: a ttl that a Drift of the acquirer's would use up
// entirely is refused, instead of granting a lease whose context is already
// done with a nil error.
func TestTTLNotAboveDrift(t *testing.T) {
	_, fdb := openSQLite(t)
	newSQLiteAcquirer(t, fdb)
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Drift: time.Second})
	fencetest.DriftRefusesShortTTL(t, a, time.Second, "ttl")
}

// TestBadOwner (inputs at the limits): an Owner the lease table cannot store (a NUL
// byte, invalid UTF-8) is refused by NewAcquirer with fence.ErrInvalid naming
// it, on every dialect, rather than failing every grant.
func TestBadOwner(t *testing.T) {
	ctx := context.Background()
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			for _, owner := range []string{"a\x00b", "a\xffb", strings.Repeat("o", 70000)} {
				a, err := sqlfence.NewAcquirer(d.db, &sqlfence.AcquirerOptions{Owner: owner})
				if err != nil {
					var ie *fence.InvalidError
					if !errors.As(err, &ie) || ie.Arg != "owner" {
						t.Errorf("NewAcquirer with owner %.20q: %v, want an InvalidError naming owner", owner, err)
					}
					continue
				}
				// Accepted: then it must work, and be recognised.
				name := fencetest.Name("bad-owner")
				l, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Errorf("owner %.20q (%d bytes) accepted by NewAcquirer, then TryAcquire: %.300v", owner, len(owner), err)
					continue
				}
				info, err := a.Inspect(ctx, name)
				if err != nil || info.Owner != owner {
					t.Errorf("owner %.20q (%d bytes) accepted, Inspect shows %.20q (%d bytes), %v", owner, len(owner), info.Owner, len(info.Owner), err)
				}
				_ = l.Release(ctx)
			}
		})
	}
}

// mysqlSessions are DSN parameters a user may give the MySQL driver that
// change how text reaches the server: the connection character set (utf8 is
// utf8mb3, which has no 4-byte characters), a non-strict sql_mode that turns
// what it cannot convert into '?', client-side interpolation, and MariaDB's
// EMPTY_STRING_IS_NULL.
var mysqlSessions = []string{
	"",
	"charset=utf8",
	"charset=utf8&sql_mode=" + url.QueryEscape("''"),
	"charset=latin1",
	"charset=latin1&sql_mode=" + url.QueryEscape("''"),
	"charset=utf8&sql_mode=" + url.QueryEscape("''") + "&interpolateParams=true",
	"sql_mode=" + url.QueryEscape("'STRICT_TRANS_TABLES,EMPTY_STRING_IS_NULL'"), // MariaDB only
}

// collisionPairs are names that a conversion on the way (a character set, a
// collation, normalisation, padding) could make one. Each pair must stay two
// independent keys, locks and idempotency records.
var collisionPairs = []struct{ what, a, b string }{
	{"case", "Key", "key"},
	{"trailing space", "k", "k "},
	{"tab", "k", "k\t"},
	{"4-byte vs ????", "X\U0001F600", "X????"},
	{"two 4-byte", "X\U0001F600", "X\U0001F601"},
	{"question mark", "X?", "X\U0001F600"},
	{"NFC vs NFD", "caf\u00e9", "cafe\u0301"},
	{"ss vs sharp s", "strasse", "stra\u00dfe"},
	{"1024 bytes, last differs", strings.Repeat("n", sqlfence.MaxKeyBytes-1) + "a", strings.Repeat("n", sqlfence.MaxKeyBytes-1) + "b"},
}

// unique makes the pair fresh on a shared server, keeping its difference at
// the end and the names within MaxKeyBytes.
func unique(a, b string) (string, string) {
	p := fencetest.Name("c") + "/"
	if len(a) >= sqlfence.MaxKeyBytes {
		return p + a[len(p):], p + b[len(p):]
	}
	return p + a, p + b
}

// TestNamesNeverCollide: on every dialect and MySQL session setting, each
// collision pair is two writer keys, two locks and two idempotency keys.
func TestNamesNeverCollide(t *testing.T) {
	ctx := context.Background()
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			w, acq, store := d.parts(t)
			for _, c := range collisionPairs {
				t.Run(c.what, func(t *testing.T) {
					a, b := unique(c.a, c.b)
					checkWriterPair(t, ctx, w, a, b)
					checkLockPair(t, ctx, acq, a, b)
					checkIdemPair(t, ctx, store, a, b)
				})
			}
		})
	}
}

func checkWriterPair(t *testing.T, ctx context.Context, w *sqlfence.Writer, a, b string) {
	t.Helper()
	if err := w.Write(ctx, a, []byte("A"), 5); err != nil {
		t.Fatalf("Write %q: %v", a, err)
	}
	if err := w.Write(ctx, b, []byte("B"), 3); err != nil {
		t.Fatalf("Write %q after %q: %v (one row?)", b, a, err)
	}
	if err := w.Write(ctx, a, []byte("A2"), 5); err != nil {
		t.Fatalf("second Write %q: %v", a, err)
	}
	for _, k := range []struct {
		key, val string
		tok      fence.Token
	}{{a, "A2", 5}, {b, "B", 3}} {
		v, tok, err := w.Read(ctx, k.key)
		if err != nil || string(v) != k.val || tok != k.tok {
			t.Errorf("Read %q = %q, %d, %v; want %q, %d", k.key, v, tok, err, k.val, k.tok)
		}
	}
	if err := w.Delete(ctx, b, 3); err != nil {
		t.Fatalf("Delete %q: %v", b, err)
	}
	if v, _, err := w.Read(ctx, a); err != nil || string(v) != "A2" {
		t.Errorf("Read %q after deleting %q = %q, %v", a, b, v, err)
	}
}

func checkLockPair(t *testing.T, ctx context.Context, acq *sqlfence.Acquirer, a, b string) {
	t.Helper()
	la, err := acq.TryAcquire(ctx, a, time.Minute)
	if err != nil {
		t.Fatalf("TryAcquire %q: %v", a, err)
	}
	lb, err := acq.TryAcquire(ctx, b, 30*time.Second)
	if err != nil {
		t.Fatalf("TryAcquire %q while %q is held: %v (one row?)", b, a, err)
	}
	for _, l := range []fence.Lease{la, lb} {
		if err := l.Renew(ctx); err != nil {
			t.Fatalf("Renew %q: %v", l.Name(), err)
		}
	}
	for _, l := range []struct {
		name     string
		tok      fence.Token
		min, max time.Duration
	}{{a, la.Token(), 50 * time.Second, time.Minute}, {b, lb.Token(), 20 * time.Second, 30 * time.Second}} {
		info, err := acq.Inspect(ctx, l.name)
		if err != nil || !info.Held || info.Token != l.tok || info.TimeLeft < l.min || info.TimeLeft > l.max {
			t.Errorf("Inspect %q = %+v, %v; want held by token %d with %v..%v left", l.name, info, err, l.tok, l.min, l.max)
		}
	}
	if err := lb.Release(ctx); err != nil {
		t.Fatalf("Release %q: %v", b, err)
	}
	if _, err := acq.TryAcquire(ctx, a, time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("TryAcquire %q after releasing %q: %v, want ErrHeld", a, b, err)
	}
	if err := la.Release(ctx); err != nil {
		t.Errorf("Release %q: %v", a, err)
	}
}

func checkIdemPair(t *testing.T, ctx context.Context, s *sqlfence.IdempotencyStore, a, b string) {
	t.Helper()
	ra, claimed, err := s.Begin(ctx, a, "fa", "owner-\U0001F600", time.Minute)
	if err != nil || !claimed {
		t.Fatalf("Begin %q = %v, %v", a, claimed, err)
	}
	rb, claimed, err := s.Begin(ctx, b, "fb", "owner-b", time.Minute)
	if err != nil || !claimed {
		t.Fatalf("Begin %q after %q = %+v, %v, %v (one record?)", b, a, rb, claimed, err)
	}
	for _, r := range []idempotency.Record{ra, rb} {
		armed, err := s.Update(ctx, r.Key, idempotency.Claimed, r.Fence, idempotency.Change{State: idempotency.Armed, Fence: r.Fence, Owner: r.Owner, Lease: time.Minute})
		if err != nil || armed.State != idempotency.Armed || armed.Owner != r.Owner {
			t.Fatalf("arm %q = %+v, %v", r.Key, armed, err)
		}
	}
	done, err := s.Update(ctx, b, idempotency.Armed, rb.Fence, idempotency.Change{State: idempotency.Completed, Fence: rb.Fence, Owner: rb.Owner, Result: []byte("rb"), Retention: time.Hour})
	if err != nil || string(done.Result) != "rb" {
		t.Fatalf("complete %q = %+v, %v", b, done, err)
	}
	got, err := s.Get(ctx, a)
	if err != nil || got.State != idempotency.Armed || got.Fingerprint != "fa" || got.Fence != ra.Fence || got.Owner != ra.Owner {
		t.Errorf("Get %q after completing %q = %+v, %v; want armed, fa, fence %d, owner %q", a, b, got, err, ra.Fence, ra.Owner)
	}
}
