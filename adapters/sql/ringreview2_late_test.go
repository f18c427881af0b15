package sqlfence_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestRingerLateHeadYieldsToLine (HAZARDS 6, wakeup.ErrYield's
// promise: "a head whose grants keep coming back late neither spins nor
// keeps a free lock from the waiters behind it"): B's line has a head W1
// whose ttl (150ms) is shorter than a round trip on B's slow connections
// (100ms each way), so every grant made for it comes back late, and behind
// it W2, whose ttl is a minute. A releases; B's ringer grants W1, the grant
// comes back late, is given back and the offer withdrawn (ringLate): W1
// "keeps its own pace". Were it to never yield its place, as its own late
// attempt does (wakeup.ErrYield moves it to the back), the ringer would
// grant W1 again and again (pausing up to 1s) and W2, which tries only when
// the head stalls in one attempt for a second, would wait while the name is
// free nearly all the time. It passes today only because the give-back's
// release pokes W1 (Line.Poke) and W1 takes the poke after the ringer's
// Withdraw: a poke taken while the offer is still in flight is swallowed
// (beginTry refuses, errOffered), and W1 then does not try.
func TestRingerLateHeadYieldsToLine(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("rr2-latehead")
	rp := newRingPair(t, name)
	a, b, la, pb, grants := rp.a, rp.b, rp.la, rp.pb, rp.grants
	wctx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	ch1 := goAcquire(wctx, b, name, 150*time.Millisecond)
	waitHeadIdle(t, b, name)
	waitPinned(t, b, 1) // B's ringer
	ch2 := goAcquire(wctx, b, name, time.Minute)
	bellWaitFor(t, 5*time.Second, "W2 in B's line behind W1", func() bool { return sqlfence.LineLen(b, name) == 2 })
	sent := grants.Load()
	pb.Latency(100*time.Millisecond, 100*time.Millisecond)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	select {
	case r := <-ch2:
		if r.err != nil {
			t.Fatalf("W2: %v", r.err)
		}
		t.Logf("W2 granted %v after A's release; %d grants sent by B", time.Since(start), grants.Load()-sent)
		r.l.Release(ctx)
	case r := <-ch1:
		t.Fatalf("W1 (every grant late) returned: %v, %v", r.l, r.err)
	case <-time.After(10 * time.Second):
		info, _ := a.Inspect(ctx, name)
		t.Fatalf("W2 (ttl 1m) not granted within 10s of A's release, behind W1 whose every grant comes back late: "+
			"%d grant statements sent by B meanwhile (the ringer's for W1, each given back); the name now %s; W1 never yields its place",
			grants.Load()-sent, fmt.Sprintf("held=%v counter=%d", info.Held, info.Counter))
	}
	cancel()
	within(t, ch1, 5*time.Second, "W1 after its context ended")
}
