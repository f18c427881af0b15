package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestRingerStressSmallPools: four Acquirers (processes), each on its
// own small pool (SetMaxOpenConns 4 to 16: bell budgets of 1 to 4 pins), run
// Acquire loops on a few names at once, some with contexts that end at
// once or after a few milliseconds (heads that leave while a ringer's or a
// release's grant for them is in flight). Every grant must be exclusive (no
// two holders of a name at once), its token above every earlier token of
// the name, its Release must succeed, and afterwards nothing stays pinned or in use and no session holds a bell.
func TestRingerStressSmallPools(t *testing.T) {
	ringStress(t, false)
}

func ringStress(t *testing.T, idleStress bool) {
	ctx := context.Background()
	maxOpen := []int{4, 8, 12, 16}
	var (
		dbs []*sql.DB
		as  []*sqlfence.Acquirer
	)
	for i, m := range maxOpen {
		db, fdb := openMySQL(t, "")
		db.SetMaxOpenConns(m)
		dbs = append(dbs, db)
		var opts *sqlfence.AcquirerOptions
		if i%2 == 1 && idleStress {
			opts = &sqlfence.AcquirerOptions{Backoff: idleHead}
		}
		as = append(as, newAcquirerOn(t, fdb, opts))
	}
	check, _ := openMySQL(t, "")
	names := make([]string, 3)
	for i := range names {
		names[i] = fencetest.Name(fmt.Sprintf("ringrev-stress%d", i))
		bellFreshRow(t, as[0], names[i])
	}
	type state struct {
		mu      sync.Mutex
		holders int
		max     fence.Token
	}
	st := make([]*state, len(names))
	for i := range st {
		st[i] = &state{}
	}
	var (
		grants, gaveUp atomic.Int64
		failed         atomic.Bool
		wg             sync.WaitGroup
	)
	fail := func(format string, args ...any) {
		if failed.CompareAndSwap(false, true) {
			t.Errorf(format, args...)
		}
	}
	stop := time.Now().Add(4 * time.Second)
	for ai, a := range as {
		for g := 0; g < 3; g++ {
			wg.Add(1)
			go func(ai int, a *sqlfence.Acquirer, seed uint64) {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(seed, 7))
				for time.Now().Before(stop) && !failed.Load() {
					ni := rng.IntN(len(names))
					wait := 10 * time.Second
					switch rng.IntN(6) {
					case 0:
						wait = time.Duration(rng.IntN(20)) * time.Millisecond
					case 1:
						wait = time.Duration(20+rng.IntN(200)) * time.Millisecond
					}
					actx, cancel := context.WithTimeout(ctx, wait)
					l, err := a.Acquire(actx, names[ni], 3*time.Second)
					cancel()
					if err != nil {
						if errors.Is(err, fence.ErrHeld) && wait < 10*time.Second {
							gaveUp.Add(1)
							continue
						}
						fail("acquirer %d: Acquire(%s, wait %v): %v", ai, names[ni], wait, err)
						return
					}
					s := st[ni]
					s.mu.Lock()
					s.holders++
					h, prev := s.holders, s.max
					if l.Token() > s.max {
						s.max = l.Token()
					}
					s.mu.Unlock()
					if h != 1 {
						fail("acquirer %d: granted %s (token %d) while %d others hold it", ai, names[ni], l.Token(), h-1)
					}
					if l.Token() <= prev {
						fail("acquirer %d: granted %s token %d, not above the earlier %d", ai, names[ni], l.Token(), prev)
					}
					if l.Context().Err() != nil {
						fail("acquirer %d: granted %s token %d with its context already done: %v", ai, names[ni], l.Token(), context.Cause(l.Context()))
					}
					grants.Add(1)
					if rng.IntN(2) == 0 {
						time.Sleep(time.Duration(rng.IntN(3)) * time.Millisecond) // work under the lease
					}
					s.mu.Lock()
					s.holders--
					s.mu.Unlock()
					if err := l.Release(ctx); err != nil {
						fail("acquirer %d: release of %s token %d: %v", ai, names[ni], l.Token(), err)
						return
					}
				}
			}(ai, a, uint64(ai*10+g))
		}
	}
	wg.Wait()
	t.Logf("%d grants, %d waits given up", grants.Load(), gaveUp.Load())
	if failed.Load() {
		return
	}
	if grants.Load() < 50 {
		t.Fatalf("only %d grants: the test proves little", grants.Load())
	}
	keys := make([]string, len(names))
	for i, n := range names {
		keys[i] = sqlfence.BellKey(as[0], n)
	}
	bellNoLeak(t, dbs, as, check, keys...)
}

// TestRingerStressIdleWaiters: as TestRingerStressSmallPools, with
// two of the four Acquirers' Backoff an hour: their waiters are woken only
// by releases through their own Acquirer and by their ringer (the bell). A
// wait of 10s that runs out means a waiter nobody woke.
func TestRingerStressIdleWaiters(t *testing.T) {
	ringStress(t, true)
}
