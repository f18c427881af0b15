package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestRingerFIFOTwoAcquirers: A holds a name with its bell; B and C
// (other processes, Backoff of an hour) each have three waiters, joined in
// order. A's release is granted by a ringer to the head of its line; each
// holder releases as soon as it holds. Within each Acquirer the waiters
// must be granted in the order they joined, every waiter must be granted
// promptly (only bells and handoffs wake them), tokens grow by one per
// grant, and afterwards nothing leaks.
func TestRingerFIFOTwoAcquirers(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	dbC, fdbC := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	c := newAcquirerOn(t, fdbC, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("ringrev-fifo")
	bellFreshRow(t, a, name)
	la, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if bellHolderID(t, dbA, sqlfence.BellKey(a, name)) == 0 {
		t.Fatal("A's takeover grant took no bell")
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	type got struct {
		who string
		tok fence.Token
		err error
	}
	out := make(chan got, 6)
	start := func(x *sqlfence.Acquirer, who string, n int) {
		go func() {
			l, err := x.Acquire(wctx, name, time.Minute)
			if err != nil {
				out <- got{who, 0, err}
				return
			}
			tok := l.Token()
			err = l.Release(ctx)
			out <- got{who, tok, err}
		}()
		for sqlfence.LineLen(x, name) < n {
			time.Sleep(time.Millisecond) // polling the line
		}
	}
	for i, who := range []string{"b1", "b2", "b3"} {
		start(b, who, i+1)
	}
	for i, who := range []string{"c1", "c2", "c3"} {
		start(c, who, i+1)
	}
	waitHeadIdle(t, b, name)
	waitHeadIdle(t, c, name)
	waitPinned(t, b, 1)
	waitPinned(t, c, 1)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var seq []got
	deadline := time.After(10 * time.Second)
	for len(seq) < 6 {
		select {
		case g := <-out:
			if g.err != nil {
				t.Fatalf("%s: %v (so far %v)", g.who, g.err, seq)
			}
			seq = append(seq, g)
		case <-deadline:
			t.Fatalf("only %d of 6 waiters granted within 10s: %v (B's line %d, C's line %d)", len(seq), seq, sqlfence.LineLen(b, name), sqlfence.LineLen(c, name))
		}
	}
	var bs, cs []string
	prev := la.Token()
	var order []string
	for _, g := range seq {
		order = append(order, g.who)
		if strings.HasPrefix(g.who, "b") {
			bs = append(bs, g.who)
		} else {
			cs = append(cs, g.who)
		}
		_ = prev
	}
	if strings.Join(bs, ",") != "b1,b2,b3" || strings.Join(cs, ",") != "c1,c2,c3" {
		t.Fatalf("grant order %v: not the join order within each Acquirer", order)
	}
	// The outcomes arrive in release order; tokens by grant order.
	toks := map[fence.Token]string{}
	for _, g := range seq {
		if w, dup := toks[g.tok]; dup {
			t.Fatalf("token %d granted to %s and %s", g.tok, w, g.who)
		}
		toks[g.tok] = g.who
	}
	for i := 1; i <= 6; i++ {
		if _, ok := toks[la.Token()+fence.Token(i)]; !ok {
			t.Fatalf("tokens %v: not A's %d + 1..6, one per grant", toks, la.Token())
		}
	}
	t.Logf("order %v", order)
	bellNoLeak(t, []*sql.DB{dbA, dbB, dbC}, []*sqlfence.Acquirer{a, b, c}, dbA, sqlfence.BellKey(a, name))
}

// TestRingerDroppedTable: the lease table is dropped while A holds
// (with its bell) and B's head waits (Backoff of an hour). A's release
// fails (no table) and closes its connection, which lets the bell go: B's
// ringer's grant fails on the missing table. B's head must then either learn
// it promptly (a *TableError) or wait on and be granted promptly once the
// table is back, with a token above A's; nothing may leak.
func TestRingerDroppedTable(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB, _, inserts := bellProxied(t)
	table := "ringrev_drop_" + strings.ReplaceAll(fencetest.Name("t"), "-", "_")
	t.Cleanup(func() { _, _ = dbA.Exec("DROP TABLE IF EXISTS " + table) })
	a := newAcquirerOn(t, fdbA, &sqlfence.AcquirerOptions{Table: table})
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Table: table, Backoff: idleHead})
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("ringrev-drop")
	bellFreshRow(t, a, name)
	la, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	key := sqlfence.BellKey(a, name)
	if bellHolderID(t, dbA, key) == 0 {
		t.Fatal("A's takeover grant took no bell")
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	waitPinned(t, b, 1)
	if _, err := dbA.Exec("DROP TABLE " + table); err != nil {
		t.Fatal(err)
	}
	sent := inserts.Load()
	var te *sqlfence.TableError
	if err := la.Release(ctx); !errors.As(err, &te) {
		t.Fatalf("A's release without the table: %v, want a *TableError", err)
	}
	bellWaitFor(t, 5*time.Second, "B's ringer's grant sent against the missing table", func() bool { return inserts.Load() > sent })
	select {
	case r := <-ch:
		if r.err == nil || !errors.As(r.err, &te) || te.Table != table {
			t.Fatalf("B's Acquire while the table was missing: %v, %v; want a *TableError naming %s, or a wait", r.l, r.err, table)
		}
		t.Logf("B's head was told: %v", r.err)
	case <-time.After(300 * time.Millisecond):
		// B waits on: it must be granted once the table is back.
		if err := a.CreateTable(ctx); err != nil {
			t.Fatal(err)
		}
		l := bellGranted(t, ch, 5*time.Second, "after the table was recreated")
		if l.Token() <= la.Token() {
			t.Fatalf("B's token %d after the table was recreated, not above A's %d", l.Token(), la.Token())
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, key)
}
