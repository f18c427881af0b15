package sqlfence_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
)

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
