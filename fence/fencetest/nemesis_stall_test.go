package fencetest

import (
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// TestStallCheckSplitVotes: with SplitVotes, refusals that overlap account
// for one another (contenders that split a majority's servers), while a
// refusal with no other call to account for it, or one after the other
// refusal's give-back, still fails the stall check; without it, overlapping
// refusals of a name nothing held all fail it.
func TestStallCheckSplitVotes(t *testing.T) {
	const ttl = 600 * time.Millisecond
	b := NemesisSuite{ShortTTL: ttl}.stallBounds()
	ms := time.Millisecond
	refused := func(client int, call, ret time.Duration) *nemOp {
		return &nemOp{client: client, kind: "TryAcquire", name: "n", call: call, ret: ret, err: fence.ErrHeld}
	}
	three := func() []*nemOp {
		return []*nemOp{refused(3, 0, 19*ms), refused(1, 1*ms, 19*ms), refused(2, 4*ms, 21*ms)}
	}
	after := 19*ms + b.latency + b.settle + 50*ms // past the first refusal's give-back
	for _, c := range []struct {
		name       string
		ops        []*nemOp
		splitVotes bool
		want       int
	}{
		{"three at once, split votes", three(), true, 0},
		{"three at once, one server", three(), false, 3},
		{"alone, split votes", []*nemOp{refused(0, 0, 19*ms)}, true, 1},
		{"after the other's give-back, split votes", []*nemOp{refused(0, 0, 19*ms), refused(1, after, after+10*ms)}, true, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHistory()
			h.ops = c.ops
			got := 0
			h.checkStalls(func(string, ...any) { got++ }, ttl, b, c.splitVotes)
			if got != c.want {
				t.Errorf("%d refusals reported, want %d", got, c.want)
			}
		})
	}
}
