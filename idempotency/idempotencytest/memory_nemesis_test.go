package idempotencytest_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
	"github.com/fencekit/fencekit/internal/nemesisrun"
)

// The nemesis's mutants: bugs that need faults in combination (a pause past
// the lease, a lost reply, a second caller at the right moment).
const (
	// Begin takes a claimed record with the same fingerprint for the client
	// library's resend of this very claim (it should compare the owner), and
	// answers it as created: two callers own the key at once.
	bugClaimByFingerprint = "claim-by-fingerprint"
	// The store's client answers a renewal (armed -> armed) as done without
	// sending it, as a Do that skips its renewals would: the lease runs out
	// at the store while the effect runs.
	bugRenewNotSent = "renew-not-sent"
	// The store's client answers a completion whose reply it did not get
	// (a cut connection, a timeout) as done, as a Do that takes a lost
	// completion reply for success would.
	bugCompleteLostAsDone = "complete-lost-as-done"
	// Do leaves a claim whose effect never started held, instead of giving
	// it back, when the caller's context ends before the arm: the key is in
	// progress for nobody until the claim's lease ends (the switch is
	// testbug.ClaimLeftHeld, set by mutantFromEnv).
	bugClaimLeftHeld = "claim-left-held"
)

// nemesisMutants are the bugs TestNemesisMutantsKilled shows the nemesis
// catches, each within seeds seeds.
var nemesisMutants = []struct {
	bug   string
	seeds int
}{
	{bugClaimByFingerprint, 12},
	{bugRenewNotSent, 10},
	{bugCompleteLostAsDone, 16},
	{bugClaimLeftHeld, 4},
}

// The in-memory store over TCP, one JSON request line and one JSON reply line
// at a time, so that a faultnet proxy between it and a netStore can lose a
// reply, drop a request or hold both in a partition.

type netReq struct {
	Op          string // begin, update, get, purge
	Key         string
	Fingerprint string
	Owner       string
	Lease       time.Duration
	From        idempotency.State
	FromFence   fence.Token
	Change      idempotency.Change
}

type netRep struct {
	Rec     idempotency.Record
	Created bool
	N       int
	Err     string // "", invalid, notfound, stale, state, other
	Msg     string
	Current fence.Token
	Got     idempotency.State
}

// serveMemStore serves st on a loopback port until t ends and returns its
// address: one JSON request and one JSON reply a line.
func serveMemStore(t *testing.T, st *memStore) string {
	t.Helper()
	return nemesisrun.ServeLines(t, func(line []byte) []byte {
		var req netReq
		rep := netRep{Err: "other", Msg: "malformed request"}
		if json.Unmarshal(line, &req) == nil {
			rep = st.answer(req)
		}
		b, err := json.Marshal(rep)
		if err != nil {
			return []byte(`{"Err":"other","Msg":"unencodable reply"}`)
		}
		return b
	})
}

// answer runs one request on s.
func (s *memStore) answer(req netReq) netRep {
	ctx := context.Background()
	var (
		rep netRep
		err error
	)
	switch req.Op {
	case "begin":
		rep.Rec, rep.Created, err = s.Begin(ctx, req.Key, req.Fingerprint, req.Owner, req.Lease)
	case "update":
		rep.Rec, err = s.Update(ctx, req.Key, req.From, req.FromFence, req.Change)
	case "get":
		rep.Rec, err = s.Get(ctx, req.Key)
	case "purge":
		rep.N, err = s.Purge(ctx)
	default:
		err = fmt.Errorf("unknown op %q", req.Op)
	}
	var (
		se *fence.StaleError
		st *idempotency.StateError
	)
	switch {
	case err == nil:
	case errors.Is(err, fence.ErrInvalid):
		rep.Err, rep.Msg = "invalid", err.Error()
	case errors.Is(err, fence.ErrNotFound):
		rep.Err = "notfound"
	case errors.As(err, &se):
		rep.Err, rep.Current = "stale", se.Current
	case errors.As(err, &st):
		rep.Err, rep.Got = "state", st.Got
	default:
		rep.Err, rep.Msg = "other", err.Error()
	}
	return rep
}

// netStore is an idempotency.Store that reaches a served memStore over TCP,
// on connections of its own, with the client-side bug its switch names.
type netStore struct {
	addr string
	bug  string

	mu   sync.Mutex
	idle []*netConn
}

type netConn struct {
	net.Conn
	r *bufio.Reader
}

var _ idempotency.Store = (*netStore)(nil)

// call sends req and reads its reply. A connection that failed is closed.
func (c *netStore) call(ctx context.Context, req netReq) (netRep, error) {
	if err := check("netstore "+req.Op, ctx, req.Key); err != nil && req.Op != "purge" {
		return netRep{}, err
	}
	if err := ctx.Err(); err != nil {
		return netRep{}, err
	}
	c.mu.Lock()
	var conn *netConn
	if n := len(c.idle); n > 0 {
		conn, c.idle = c.idle[n-1], c.idle[:n-1]
	}
	c.mu.Unlock()
	if conn == nil {
		nc, err := (&net.Dialer{}).DialContext(ctx, "tcp", c.addr)
		if err != nil {
			return netRep{}, err
		}
		conn = &netConn{Conn: nc, r: bufio.NewReader(nc)}
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	b, _ := json.Marshal(req)
	_, err := conn.Write(append(b, '\n'))
	var line []byte
	if err == nil {
		line, err = conn.r.ReadBytes('\n')
	}
	if !stop() || err != nil {
		conn.Close()
		if ctx.Err() != nil {
			return netRep{}, fmt.Errorf("netstore %s: %w (%v)", req.Op, ctx.Err(), err)
		}
		if err == nil {
			err = errors.New("cancelled")
		}
		return netRep{}, fmt.Errorf("netstore %s: %w", req.Op, err)
	}
	var rep netRep
	if err := json.Unmarshal(line, &rep); err != nil {
		conn.Close()
		return netRep{}, fmt.Errorf("netstore %s: %w", req.Op, err)
	}
	c.mu.Lock()
	c.idle = append(c.idle, conn)
	c.mu.Unlock()
	switch rep.Err {
	case "":
		return rep, nil
	case "invalid":
		return rep, &fence.InvalidError{Op: "netstore " + req.Op, Arg: "request", Reason: rep.Msg}
	case "notfound":
		return rep, fence.ErrNotFound
	case "stale":
		return rep, &fence.StaleError{Key: req.Key, Offered: req.FromFence, Current: rep.Current}
	case "state":
		return rep, &idempotency.StateError{Key: req.Key, Want: req.From, Got: rep.Got}
	}
	return rep, fmt.Errorf("netstore %s: %s", req.Op, rep.Msg)
}

func (c *netStore) Begin(ctx context.Context, key, fingerprint, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	rep, err := c.call(ctx, netReq{Op: "begin", Key: key, Fingerprint: fingerprint, Owner: owner, Lease: lease})
	return rep.Rec, rep.Created, err
}

func (c *netStore) Update(ctx context.Context, key string, from idempotency.State, fromFence fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	done := idempotency.Record{Key: key, State: ch.State, Fence: ch.Fence, Owner: ch.Owner, LeaseLeft: ch.Lease, Result: ch.Result, ResultDropped: ch.ResultDropped}
	if c.bug == bugRenewNotSent && from == idempotency.Armed && ch.State == idempotency.Armed {
		return done, nil
	}
	rep, err := c.call(ctx, netReq{Op: "update", Key: key, From: from, FromFence: fromFence, Change: ch})
	if c.bug == bugCompleteLostAsDone && ch.State == idempotency.Completed && err != nil && rep.Err == "" {
		return done, nil // no answer came: taken as done
	}
	return rep.Rec, err
}

func (c *netStore) Get(ctx context.Context, key string) (idempotency.Record, error) {
	rep, err := c.call(ctx, netReq{Op: "get", Key: key})
	return rep.Rec, err
}

func (c *netStore) Purge(ctx context.Context) (int, error) {
	rep, err := c.call(ctx, netReq{Op: "purge"})
	return rep.N, err
}

// TestMemoryNemesis: the in-memory store, served over TCP behind a proxy per
// client, passes the nemesis; in a child process of TestNemesisMutantsKilled,
// a mutant of it (mutantEnv) must fail.
func TestMemoryNemesis(t *testing.T) {
	bug, err := mutantFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	st := newMemStore(bug)
	addr := serveMemStore(t, st)
	idempotencytest.NemesisSuite{
		Store: func(t *testing.T) (idempotency.Store, *faultnet.Proxy) {
			p := faultnet.Start(t, addr)
			return &netStore{addr: p.Addr(), bug: bug}, p
		},
		Direct: func(*testing.T) idempotency.Store { return st },
	}.Run(t)
}

// TestNemesisMutantsKilled runs the nemesis on each of nemesisMutants in a
// child process, which stops at the first seed that fails, and checks that
// one did within the mutant's seeds; it logs that seed, how many passed
// before it, how long it took and the first check that failed.
func TestNemesisMutantsKilled(t *testing.T) {
	if os.Getenv(mutantEnv) != "" {
		t.Skip("inside a mutant's child process")
	}
	if testing.Short() {
		t.Skip("runs the nemesis once per mutant")
	}
	for _, m := range nemesisMutants {
		t.Run(m.bug, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			cmd := exec.Command(os.Args[0], "-test.run=^TestMemoryNemesis$", "-test.count=1", "-test.v", "-test.failfast", "-test.timeout=5m")
			cmd.Env = append(os.Environ(), mutantEnv+"="+m.bug, fencetest.NemesisSeedsEnv+"="+strconv.Itoa(m.seeds))
			out, err := cmd.CombinedOutput()
			var ee *exec.ExitError
			if err != nil && !errors.As(err, &ee) {
				t.Fatalf("mutant %q: %v", m.bug, err)
			}
			seeds := regexp.MustCompile(`--- FAIL: TestMemoryNemesis/seed=(\d+)`).FindAllStringSubmatch(string(out), -1)
			if err == nil || len(seeds) == 0 {
				t.Fatalf("mutant %q: the nemesis passed %d seeds (%v):\n%s", m.bug, m.seeds, time.Since(start).Round(time.Millisecond), out)
			}
			passed := len(regexp.MustCompile(`--- PASS: TestMemoryNemesis/seed=`).FindAllString(string(out), -1))
			first := "?"
			for _, l := range regexp.MustCompile(`nemesis(?:_history|_stall)?\.go:\d+: (.*)`).FindAllStringSubmatch(string(out), -1) {
				if !strings.HasPrefix(l[1], "nemesis seed ") && !strings.HasPrefix(l[1], "history (") {
					first = l[1]
					break
				}
			}
			t.Logf("mutant %q: the nemesis failed seed %s after %d passed, in %v, first with: %s",
				m.bug, seeds[0][1], passed, time.Since(start).Round(time.Millisecond), first)
		})
	}
}
