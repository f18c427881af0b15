package idempotency_test

import (
	"context"
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/go-sql-driver/mysql"
)

// An arm that waits on MariaDB for a row lock (another transaction holds the
// record's row) is not stopped by the caller leaving: the driver closes its
// connection, but the server runs the statement once the lock is free. Do
// then reads the record (a consistent read: still claimed), and releases the
// claim; that release queues behind the orphaned arm, which lands first, so
// the release is refused. The effect never started, yet the key stays armed
// for nobody, and once the lease ends the next caller finds it unknown.
func TestArmLandingAfterCallerLeftDoesNotLeaveKeyArmed(t *testing.T) {
	const lease = 300 * time.Millisecond
	mcfg, err := mysql.ParseDSN(testenv.MySQLDSN())
	if err != nil {
		t.Fatal(err)
	}
	if err := testenv.Dial(mcfg.Addr); err != nil {
		testenv.Missing(t, "MariaDB", err)
	}
	open := func() *sql.DB {
		db, err := sql.Open("mysql", mcfg.FormatDSN())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		return db
	}
	const table = "idem_arm_lockwait"
	db, admin := open(), open()
	s, err := sqlfence.NewIdempotencyStore(sqlfence.MySQL(db), &sqlfence.IdempotencyOptions{Table: table})
	if err == nil {
		err = s.CreateTable(context.Background())
	}
	if err != nil {
		t.Fatal(err)
	}
	poll := func(cond func() bool, d time.Duration) bool {
		for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
			if cond() {
				return true
			}
		}
		return cond()
	}

	for name, completeTimeout := range map[string]time.Duration{
		"re-read answered":  0,                      // Do reads the record and releases the claim itself
		"re-read timed out": 100 * time.Millisecond, // Do gives up reading it: settleArm releases it in the background
	} {
		t.Run(name, func(t *testing.T) {
			armLandingAfterCallerLeft(t, s, admin, table, lease, completeTimeout, poll)
		})
	}
}

// armLandingAfterCallerLeft runs one Do whose arm waits for a row lock held
// by admin on table until after the caller left and Do sent its release.
func armLandingAfterCallerLeft(t *testing.T, s *sqlfence.IdempotencyStore, admin *sql.DB, table string, lease, completeTimeout time.Duration, poll func(func() bool, time.Duration) bool) {
	k := key()
	ctx, cancel := context.WithCancel(ctxT(t))
	defer cancel()
	var arms atomic.Int32
	blockerDone := make(chan struct{})
	var sawBoth atomic.Bool
	releaseSent := make(chan struct{}, 8)
	hs := &hookedStore{Store: s}
	hs.beforeUpdate = func(n int, from idempotency.State, ch idempotency.Change) {
		if ch.State == idempotency.Released {
			releaseSent <- struct{}{}
		}
		if from != idempotency.Claimed || ch.State != idempotency.Armed || arms.Add(1) != 1 {
			return
		}
		// Another transaction holds the record's row while the arm is sent.
		tx, err := admin.BeginTx(context.Background(), nil)
		if err != nil {
			t.Error(err)
			close(blockerDone)
			return
		}
		var f int64
		if err := tx.QueryRow("SELECT fence FROM "+table+" WHERE `key` = ? FOR UPDATE", k).Scan(&f); err != nil {
			t.Error(err)
		}
		go func() {
			defer close(blockerDone)
			// The arm cannot return before the commit below: give it
			// time to reach the server and wait there for the row (the
			// test user cannot read INNODB_TRX to see it waiting).
			time.Sleep(300 * time.Millisecond)
			cancel() // the caller leaves while its arm waits
			// Do's release (in Do or in the background) queues behind the
			// orphaned arm.
			select {
			case <-releaseSent:
				sawBoth.Store(true)
				time.Sleep(300 * time.Millisecond) // as for the arm
			case <-time.After(15 * time.Second):
			}
			if err := tx.Commit(); err != nil {
				t.Error(err)
			}
		}()
	}
	started := false
	_, err := idempotency.Do(ctx, hs, k, "fp", func(context.Context, string) ([]byte, error) {
		started = true
		return []byte("ran"), nil
	}, &idempotency.Options{Lease: lease, CompleteTimeout: completeTimeout})
	<-blockerDone
	if started {
		t.Fatal("the effect started after the caller left")
	}
	t.Logf("Do: %v (a release was sent while the row was locked: %v)", err, sawBoth.Load())
	// Whatever Do left running in the background has its time to settle.
	var rec idempotency.Record
	var gerr error
	settledOK := poll(func() bool {
		rec, gerr = s.Get(context.Background(), k)
		return errors.Is(gerr, fence.ErrNotFound) || (gerr == nil && rec.State == idempotency.Released)
	}, lease+2*time.Second)
	if !settledOK {
		t.Errorf("record after Do gave up before the effect: %s fence %d (%v); want released: the effect never started", rec.State, rec.Fence, gerr)
	}
	// The next caller, once the lease is over, must run the effect, not
	// be told that it may have happened.
	poll(func() bool {
		rec, gerr = s.Get(context.Background(), k)
		return gerr != nil || rec.LeaseLeft <= 0
	}, 2*lease)
	var l ledger
	res, err := idempotency.Do(ctxT(t), s, k, "fp", l.effect(k), &idempotency.Options{Lease: lease})
	if err != nil || l.count(k) != 1 {
		t.Fatalf("the next caller: %+v, %v, runs %d; want the effect run once (it never started before)", res, err, l.count(k))
	}
}
