package sqlfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
)

// TestMySQLIdempotencyUpdateReadBackNotSent (HAZARDS 3): on MySQL an
// idempotency Update is a compare-and-set and then a read of the record it
// wrote, each on a connection of the pool. When the compare-and-set lands
// and the read gets no connection (another caller takes the pool's only
// connection in between, and the context ends while the read waits for it),
// the change was made: Update must return the record, or an error matching
// fence.ErrUnknown; never a definite "not sent" for a change that landed.
func TestMySQLIdempotencyUpdateReadBackNotSent(t *testing.T) {
	_, direct := openMySQL(t, "")
	ds := idemStore(t, direct)
	px := faultnet.Start(t, mysqlAddr(t))
	db := proxiedMySQL(t, px)
	db.SetMaxOpenConns(1)
	s, err := sqlfence.NewIdempotencyStore(sqlfence.MySQL(db), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := fencetest.Name("idem-readback")
	rec, claimed, err := s.Begin(ctx, key, "fp", "me", time.Minute)
	if err != nil || !claimed {
		t.Fatalf("Begin: %+v, %v, %v", rec, claimed, err)
	}

	// Every chunk takes 300ms each way: the compare-and-set is in flight
	// long enough for another caller to queue for the pool's connection.
	px.Latency(300*time.Millisecond, 300*time.Millisecond)
	uctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	type result struct {
		rec idempotency.Record
		err error
	}
	done := make(chan result, 1)
	waits := db.Stats().WaitCount
	go func() {
		r, err := s.Update(uctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
		done <- result{r, err}
	}()
	for db.Stats().InUse == 0 { // the compare-and-set has the connection
		select {
		case r := <-done:
			t.Fatalf("Update returned before it took a connection: %+v, %v", r.rec, r.err)
		case <-time.After(time.Millisecond): // polling the pool's state
		}
	}
	held := make(chan func(), 1)
	go func() {
		c, err := db.Conn(ctx) // queues for the connection the compare-and-set holds
		if err != nil {
			t.Error(err)
			held <- func() {}
			return
		}
		held <- func() { c.Close() }
	}()
	for db.Stats().WaitCount == waits {
		select {
		case r := <-done:
			t.Fatalf("Update returned before another caller queued for the pool: %+v, %v (the test did not test it)", r.rec, r.err)
		case <-time.After(time.Millisecond): // polling the pool's state
		}
	}
	r := <-done
	(<-held)()
	px.Latency(0, 0)

	got, gerr := ds.Get(ctx, key)
	if gerr != nil || got.State != idempotency.Armed {
		t.Fatalf("the record after Update: %+v, %v; want armed (the test did not test a change that landed)", got, gerr)
	}
	if r.err != nil && !errors.Is(r.err, fence.ErrUnknown) {
		t.Errorf("Update whose compare-and-set landed (the record is armed) and whose read-back got no connection: %v; want the record or an error matching fence.ErrUnknown", r.err)
	}
}
