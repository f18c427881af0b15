package fencetest_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/fence/internal/testbug"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// The in-memory backend: a correct FencedWriter (with Reader and Deleter) and
// an Acquirer on leasekit, each with one switch per realistic bug. The correct
// backend must pass the suites; TestMutantsKilled runs the suites on each bug
// in a child process and checks the case meant to catch it fails.

// mutantEnv selects the bug of the in-memory backend in a child process.
const mutantEnv = "FENCETEST_MUTANT"

// mutants are the bugs, each with the suite and case that must catch it.
var mutants = []struct {
	name, suite, kill, what string
}{
	{"renew-no-token", "Acquirer", "StaleRenewKeepsNewHolder", "Renew checks the expiry but not the holder's token"},
	{"renew-no-holder", "Acquirer", "RenewLostAfterDeletedState", "Renew checks the expiry but not the holder's token, sent only while the lease is live"},
	{"renew-recognised-late", "Acquirer", "LostReplyRenewThenRenew", "a Renew after one whose reply was lost finds the lease still its own and counts the local deadline from its own send, not the lost one's"},
	{"late-renew", "Acquirer", "LateRenewHoldsNothing", "Renew is sent after the lease's local deadline and extends it on the server"},
	{"ttl-round-down", "Acquirer", "NoGrantWhileHolderContextLive", "the server keeps a lease for 2/3 of its ttl (600ms becomes 400ms)"},
	{"late-after-deadline", "Acquirer", "AcquireGivesUpAtDeadline", "Acquire sleeps between tries until 500ms past its deadline"},
	{"ignore-ctx", "Acquirer", "AcquireCancelled", "Acquire ignores ctx until its own maximum wait"},
	{"done-ctx-bare", "Acquirer", "AcquireContextDone", "Acquire called with a done context returns the bare context error, not ErrHeld joined with it"},
	{"ctx-before-input", "Acquirer", "BadInput", "Acquire called with a done context gives up (ErrHeld) before it looks at its name and ttl"},
	{"held-as-lost", "Acquirer", "NoGrantWhileHolderContextLive", "TryAcquire on a held name answers ErrLost (a late grant given back) instead of ErrHeld"},
	{"try-waits", "Acquirer", "TryAcquireHeld", "TryAcquire on a held name waits a second before ErrHeld"},
	{"name-fold-case", "Acquirer", "NamesIndependent", "names compared case-insensitively (a _ci collation)"},
	{"name-pad-space", "Acquirer", "NamesIndependent", "trailing spaces ignored in names (PAD SPACE)"},
	{"name-utf8mb3", "Acquirer", "NamesIndependent", "4-byte characters in names stored as '?' (a 3-byte character set)"},
	{"token-wrap", "Acquirer", "TokensExhausted", "the counter goes past MaxToken"},
	{"delete-restarts", "Acquirer", "TokensSurviveDeletedState", "a lock whose state was deleted restarts its counter at 1 (no clock floor)"},
	{"delete-refuses", "Acquirer", "TokensSurviveDeletedState", "a lock whose state was deleted refuses every later grant with ErrHeld (stuck for good)"},
	{"delete-noop", "Acquirer", "TokensSurviveDeletedState", "the harness's DeleteState deletes nothing (a wrong table or key)"},
	{"write-alias", "Writer", "ValueNotAliased", "Write keeps the caller's buffer"},
	{"read-alias", "Writer", "ValueNotAliased", "Read returns the stored buffer"},
	{"key-fold-case", "Writer", "KeysIndependent", "keys compared case-insensitively (a _ci collation)"},
	{"key-pad-space", "Writer", "KeysIndependent", "trailing spaces ignored in keys (PAD SPACE)"},
	{"key-utf8mb3", "Writer", "KeysIndependent", "4-byte characters in keys stored as '?' (a 3-byte character set)"},
	{"refuse-valid", "EntryPoints", "valid", "Write refuses a valid key of 64 bytes with ErrInvalid"},
}

// memServer is the "server": its own clock, its locks and rows, one mutex for
// the atomic steps.
type memServer struct {
	bug string

	mu    sync.Mutex
	locks map[string]*memLock
	rows  map[string]*memRow
	// deleted: names whose state was deleted (the delete-refuses mutant).
	deleted map[string]bool
	// gone: per name and nonce, until when a grant request of that nonce is
	// refused (its sender left or gave the grant back: a copy still on its
	// way must not grant it when it lands).
	gone map[[2]string]time.Time
	// busyUntil: until then every request over TCP is answered BUSY, a
	// reply that says the step did not run (NemesisSuite.NotRun).
	busyUntil time.Time
}

type memLock struct {
	counter, holder fence.Token
	expires         time.Time
	// nonce: the grant request that made the holder's grant (over TCP); a
	// request of the same nonce sent again adopts it.
	nonce string
	// waiters: the waiting Acquires (over TCP) that found the name held, in
	// order; a release hands the name to the first that is still live.
	waiters []memWaiter
}

// memWaiter is a waiting Acquire's place at the server, kept live by its
// polls and taken out by its leave.
type memWaiter struct {
	nonce   string
	ttl     time.Duration
	expires time.Time
}

type memRow struct {
	value []byte
	token fence.Token
	dead  bool // a tombstone: the fence without a value
}

func newMemServer(bug string) *memServer {
	return &memServer{bug: bug, locks: map[string]*memLock{}, rows: map[string]*memRow{}}
}

// now is the server's clock.
func (s *memServer) now() time.Time { return time.Now() }

// fold is what a buggy collation or character set does to a name or key.
func (s *memServer) fold(kind, k string) string {
	if !strings.HasPrefix(s.bug, kind+"-") {
		return k
	}
	switch strings.TrimPrefix(s.bug, kind+"-") {
	case "fold-case":
		return strings.ToLower(k)
	case "pad-space":
		return strings.TrimRight(k, " ")
	case "utf8mb3":
		return strings.Map(func(r rune) rune {
			if utf8.RuneLen(r) == 4 {
				return '?'
			}
			return r
		}, k)
	}
	return k
}

// lock returns the state of name, created when there is none. A new lock's
// counter starts at the server's clock in microseconds, so that a lock whose
// state was deleted never grants a token below one it granted before (as long
// as it made fewer grants than microseconds passed since it was created); the
// delete-restarts mutant starts it at 0, so its first token is 1.
func (s *memServer) lock(name string) *memLock {
	name = s.fold("name", name)
	l := s.locks[name]
	if l == nil {
		l = &memLock{}
		if s.bug != "delete-restarts" {
			l.counter = fence.Token(s.now().UnixMicro())
		}
		s.locks[name] = l
	}
	return l
}

// deleteState removes every piece of state kept for name, as an operator's
// DELETE would, whoever holds it.
func (s *memServer) deleteState(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch s.bug {
	case "delete-noop":
		return
	case "delete-refuses":
		if s.deleted == nil {
			s.deleted = map[string]bool{}
		}
		s.deleted[s.fold("name", name)] = true
	}
	delete(s.locks, s.fold("name", name))
}

// grant takes a free or expired lock and advances its counter.
func (s *memServer) grant(name string, ttl time.Duration) (fence.Token, error) {
	tok, _, err := s.grantNonce(name, ttl, "", false)
	return tok, err
}

// grantNonce is grant for a request over TCP that carries nonce (when not
// ""): a request sent again adopts the grant an earlier copy made, a nonce
// that left or gave its grant back is refused, and a waiting Acquire's
// request (wait) that finds the name held takes or refreshes its place in
// the name's line for a ttl. It also returns how much of the grant's lease
// is left: less than ttl for a grant an earlier copy or a release made.
func (s *memServer) grantNonce(name string, ttl time.Duration, nonce string, wait bool) (fence.Token, time.Duration, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, now := s.lock(name), s.now()
	if nonce != "" {
		if until, ok := s.gone[[2]string{s.fold("name", name), nonce}]; ok && now.Before(until) {
			return 0, 0, fence.ErrHeld
		}
		if l.holder != 0 && now.Before(l.expires) && l.nonce == nonce {
			return l.holder, l.expires.Sub(now), nil
		}
	}
	// A free name goes to the first live waiter in line: another request
	// is refused (a waiter that left without its leave reaching the server
	// keeps its place, and the name, until its place expires).
	l.waiters = slices.DeleteFunc(l.waiters, func(w memWaiter) bool { return !now.Before(w.expires) })
	first := len(l.waiters) > 0 && l.waiters[0].nonce != nonce
	if l.holder != 0 && now.Before(l.expires) || s.deleted[s.fold("name", name)] || first {
		if wait && nonce != "" {
			l.waiters = slices.DeleteFunc(l.waiters, func(w memWaiter) bool { return w.nonce == nonce })
			l.waiters = append(l.waiters, memWaiter{nonce: nonce, ttl: ttl, expires: now.Add(ttl)})
		}
		return 0, 0, fence.ErrHeld
	}
	if l.counter >= fence.MaxToken && s.bug != "token-wrap" {
		return 0, 0, fmt.Errorf("mem: acquire %q: %w", name, fence.ErrTokensExhausted)
	}
	if s.bug == "ttl-round-down" {
		ttl -= ttl / 3
	}
	l.counter++
	l.holder, l.expires, l.nonce = l.counter, now.Add(ttl), nonce
	l.waiters = slices.DeleteFunc(l.waiters, func(w memWaiter) bool { return w.nonce == nonce })
	return l.counter, ttl, nil
}

// handOver grants l, just released, to its first live waiter, as a waiting
// line's release does; the waiter's next request adopts the grant.
func (s *memServer) handOver(l *memLock, now time.Time) {
	for len(l.waiters) > 0 {
		w := l.waiters[0]
		l.waiters = l.waiters[1:]
		if now.Before(w.expires) && l.counter < fence.MaxToken {
			l.counter++
			l.holder, l.expires, l.nonce = l.counter, now.Add(w.ttl), w.nonce
			return
		}
	}
}

// leave takes nonce out of name's line and releases a grant it holds. With
// tombstone, it also refuses the nonce's grant requests for a while, so that
// one still on its way does not grant it when it lands; without (the
// cleanup-gives-up mutant's request), only a grant that already landed is
// given back.
func (s *memServer) leave(name, nonce string, ttl time.Duration, tombstone bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l, now := s.lock(name), s.now()
	if tombstone {
		if s.gone == nil {
			s.gone = map[[2]string]time.Time{}
		}
		for k, until := range s.gone {
			if !now.Before(until) {
				delete(s.gone, k)
			}
		}
		s.gone[[2]string{s.fold("name", name), nonce}] = now.Add(4 * ttl)
	}
	l.waiters = slices.DeleteFunc(l.waiters, func(w memWaiter) bool { return w.nonce == nonce })
	if l.holder != 0 && now.Before(l.expires) && l.nonce == nonce {
		l.holder = 0
		s.handOver(l, now)
	}
}

// extend renews (ttl > 0) or releases (ttl 0) the lock if tok still holds it.
// The recreate-restarts mutant re-creates a name's deleted state here (an
// upsert in the renewal's statement) with its counter at 0: only the grant
// keeps the clock floor.
func (s *memServer) extend(name string, tok fence.Token, ttl time.Duration) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if k := s.fold("name", name); s.bug == "recreate-restarts" && s.locks[k] == nil {
		s.locks[k] = &memLock{}
	}
	l, now := s.lock(name), s.now()
	if !now.Before(l.expires) || (l.holder != tok && s.bug != "renew-no-token" && s.bug != "renew-no-holder") {
		return false
	}
	if ttl == 0 {
		if l.holder != tok {
			return false
		}
		l.holder = 0
		s.handOver(l, now)
		return true
	}
	l.expires = now.Add(ttl)
	return true
}

func (s *memServer) setCounter(name string, tok fence.Token) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.lock(name)
	l.counter, l.holder = tok, 0
}

// memAcquirer is a fence.Acquirer on memServer and leasekit: it calls the
// server directly, or through via (over TCP, for the Faulty harness).
type memAcquirer struct {
	s       *memServer
	via     *memClient
	maxWait time.Duration
	// defaultDrift: the lease's drift margin is leasekit's default (1% of
	// the ttl and 2ms), as a real adapter's, instead of a quarter of the ttl.
	defaultDrift bool
}

type memLease struct {
	*leasekit.Base
	s   *memServer
	via *memClient
	// unknown: the last Renew's outcome is unknown (its reply was lost).
	unknown bool
}

func (a memAcquirer) check(ctx context.Context, name string, ttl time.Duration) error {
	if err := leasekit.CheckContext("acquire", ctx); err != nil {
		return err
	}
	if err := leasekit.CheckName("acquire", name); err != nil {
		return err
	}
	return leasekit.CheckTTL("acquire", ttl, 0, 0)
}

// TryAcquire grants name or returns ErrHeld at once. Over TCP, a grant
// whose reply was lost is given back (settle).
func (a memAcquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check(ctx, name, ttl); err != nil {
		return nil, err
	}
	nonce := newMemNonce()
	l, err := a.try(ctx, name, ttl, nonce, false)
	if errors.Is(err, fence.ErrUnknown) {
		a.settle(name, nonce, ttl, "cleanup")
	}
	if errors.Is(err, fence.ErrHeld) && a.s.bug == "try-waits" {
		time.Sleep(time.Second)
	}
	if errors.Is(err, fence.ErrHeld) && a.s.bug == "held-as-lost" {
		return nil, fmt.Errorf("mem: acquire %q: granted past its local deadline: %w", name, fence.ErrLost)
	}
	return l, err
}

func (a memAcquirer) try(ctx context.Context, name string, ttl time.Duration, nonce string, wait bool) (fence.Lease, error) {
	sent := time.Now() // before the request: the local deadline counts from here
	var (
		tok fence.Token
		err error
	)
	if a.via != nil {
		var left time.Duration
		tok, left, err = a.via.grant(ctx, name, ttl, nonce, wait)
		// A grant made before this request (by an earlier copy, or
		// handed over by a release) has less than the ttl left: the
		// local deadline counts as if the request had been sent then.
		sent = sent.Add(left - ttl)
	} else {
		tok, err = a.s.grant(name, ttl)
	}
	if err != nil {
		return nil, err
	}
	// A wide drift margin (a quarter of the ttl) keeps the lease live on the
	// server for a while after its local deadline, so a Renew sent late
	// (the late-renew mutant) always lands inside that window.
	drift := ttl / 4
	if a.defaultDrift {
		drift = 0
	}
	return &memLease{Base: leasekit.New(name, tok, ttl, drift, sent), s: a.s, via: a.via}, nil
}

// Acquire waits for name until ctx is done or the maximum wait passed.
func (a memAcquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if a.s.bug == "ctx-before-input" && ctx != nil && ctx.Err() != nil {
		return nil, errors.Join(fence.ErrHeld, ctx.Err())
	}
	if err := a.check(ctx, name, ttl); err != nil {
		return nil, err
	}
	// Over TCP, every poll of one wait carries the same nonce: it keeps the
	// waiter's place in the name's line and adopts a grant an earlier poll
	// (or a release's handover) made. A poll the server did not run is a
	// poll that found the name held.
	nonce := ""
	if a.via != nil {
		nonce = newMemNonce()
	}
	try := func(ctx context.Context) (fence.Lease, error) {
		l, err := a.try(ctx, name, ttl, nonce, nonce != "")
		if errors.Is(err, errMemNotRun) {
			return nil, errors.Join(fence.ErrHeld, err)
		}
		return l, err
	}
	if err := ctx.Err(); err != nil && a.s.bug == "done-ctx-bare" {
		return nil, fmt.Errorf("mem: acquire %q: %w", name, err)
	}
	switch a.s.bug {
	case "late-after-deadline":
		// Near its deadline, sleeps without looking at ctx until 500ms past it.
		for attempt := 0; ; attempt++ {
			l, err := try(ctx)
			if !errors.Is(err, fence.ErrHeld) {
				return l, err
			}
			if ctx.Err() != nil {
				return nil, errors.Join(fence.ErrHeld, ctx.Err())
			}
			if d, ok := ctx.Deadline(); ok && time.Until(d) < time.Second {
				time.Sleep(time.Until(d) + 500*time.Millisecond)
				continue
			}
			_ = fence.Backoff{}.Sleep(ctx, attempt)
		}
	case "ignore-ctx":
		// Waits its own maximum wait, whatever ctx says.
		own, cancel := context.WithTimeout(context.Background(), a.maxWait)
		defer cancel()
		l, err := leasekit.Acquire(own, fence.Backoff{MaxWait: a.maxWait}, nil, try)
		if err != nil && ctx.Err() != nil {
			return nil, errors.Join(fence.ErrHeld, ctx.Err())
		}
		return l, err
	}
	l, err := leasekit.Acquire(ctx, fence.Backoff{MaxWait: a.maxWait}, nil, try)
	if err != nil {
		// A waiter that gives up leaves the line, which gives back a grant
		// made to it meanwhile.
		a.settle(name, nonce, ttl, "leave")
	}
	return l, err
}

// errMemNotRun is the error of a request the server answered BUSY: it did
// not run it.
var errMemNotRun = errors.New("mem: the server did not run the request (BUSY)")

var memNonces atomic.Uint64

// newMemNonce returns a nonce no other grant request of this process has.
func newMemNonce() string { return fmt.Sprintf("n%d", memNonces.Add(1)) }

// settle takes nonce out of name's line and gives back a grant that one of
// its requests made or may still make (the request may be held on its way),
// in the background: a leave (kind "leave", a waiter that gave up) or a
// cleanup (kind "cleanup", a TryAcquire whose reply was lost). It sends the
// request again, paced, until the server runs it, for up to a few ttls: a
// reply lost or a BUSY is not an answer. Two mutants: leave-busy-done takes
// a leave answered BUSY as done; cleanup-gives-up's cleanup first asks
// whether the server is there and gives up when no answer comes within an
// eighth of the ttl, then only releases a grant that has already landed (no
// refusal of the nonce's later requests), so that a grant request held in a
// partition longer than that lands after it.
func (a memAcquirer) settle(name, nonce string, ttl time.Duration, kind string) {
	if a.via == nil || nonce == "" {
		return
	}
	c := &memClient{addr: a.via.addr} // a connection of its own
	req := "C"
	patience := 4 * ttl
	if kind == "cleanup" && a.s.bug == "cleanup-gives-up" {
		req, patience = "K", ttl/8
	}
	go func() {
		defer c.close()
		if req == "K" {
			// Asks first whether the server is there, and gives up when
			// no answer comes within its patience.
			ctx, cancel := context.WithTimeout(context.Background(), patience)
			_, err := c.call(ctx, "H %x", name)
			cancel()
			if err != nil {
				return
			}
		}
		end := time.Now().Add(patience)
		for time.Now().Before(end) {
			ctx, cancel := context.WithTimeout(context.Background(), min(time.Until(end), max(ttl/4, 20*time.Millisecond)))
			r, err := c.call(ctx, "%s %x %s %d", req, name, nonce, int64(ttl))
			cancel()
			if err == nil && (r != "BUSY" || kind == "leave" && a.s.bug == "leave-busy-done") {
				return
			}
			time.Sleep(min(time.Until(end), ttl/10)) // pacing between sends

		}
	}()
}

// Renew extends the lease on the server by its ttl.
func (l *memLease) Renew(ctx context.Context) error { return l.extend("renew", ctx, l.TTL()) }

// Release gives the lease up, token-checked.
func (l *memLease) Release(ctx context.Context) error { return l.extend("release", ctx, 0) }

// extend renews the lease (ttl > 0) or releases it (ttl 0) on the server.
func (l *memLease) extend(op string, ctx context.Context, ttl time.Duration) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	// A lease that ended locally sends no renewal: it would hold the name for
	// nobody. The late-renew mutant sends it anyway; so does renew-no-token,
	// whose stale Renew stands for one sent in time and delayed on the network
	// past the expiry (the suite cannot delay a request, so it sends late).
	if ttl > 0 && l.Context().Err() != nil && l.s.bug != "late-renew" && l.s.bug != "renew-no-token" {
		return fence.ErrLost
	}
	sent := time.Now()
	var ok bool
	if l.via == nil {
		ok = l.s.extend(l.Name(), l.Token(), ttl)
	} else {
		recognised, err := l.recognise(ctx, ttl)
		if recognised {
			return err
		}
		ok, err = l.via.extend(ctx, l.Name(), l.Token(), ttl)
		if err != nil {
			if ttl == 0 {
				l.End(context.Canceled)
			} else {
				l.unknown = true
			}
			return fmt.Errorf("mem: %s %q: %w: %v", op, l.Name(), fence.ErrUnknown, err)
		}
		l.unknown = false
	}
	switch {
	case ttl == 0:
		l.End(context.Canceled)
	case !ok:
		l.End(fence.ErrLost)
	case !l.Extend(sent): // confirmed after the local deadline: stays lost
		ok = false
	}
	if !ok {
		return fence.ErrLost
	}
	return nil
}

// recognise is the renew-recognised-late mutant's Renew after one whose reply
// was lost: it asks whether the lease is still its own on the server and, if
// so, takes the lost Renew as done, counting the local deadline from its own
// send (the lost one's was earlier). The correct lease renews again instead.
func (l *memLease) recognise(ctx context.Context, ttl time.Duration) (bool, error) {
	if l.s.bug != "renew-recognised-late" || ttl == 0 || !l.unknown {
		return false, nil
	}
	sent := time.Now()
	held, err := l.via.holds(ctx, l.Name(), l.Token())
	if err != nil || !held {
		return false, nil
	}
	l.unknown = false
	if !l.Extend(sent) {
		return true, fence.ErrLost
	}
	return true, nil
}

// memWriter is a fence.FencedWriter with Read and Delete on memServer.
type memWriter struct{ s *memServer }

func (w memWriter) check(op string, ctx context.Context, key string) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	return leasekit.CheckText(op, "key", key, 0)
}

// Write stores value under key unless key holds a larger token.
func (w memWriter) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	return w.put("write", ctx, key, value, token, false)
}

// Delete leaves a tombstone under key unless key holds a larger token.
func (w memWriter) Delete(ctx context.Context, key string, token fence.Token) error {
	return w.put("delete", ctx, key, nil, token, true)
}

func (w memWriter) put(op string, ctx context.Context, key string, value []byte, token fence.Token, dead bool) error {
	if err := w.check(op, ctx, key); err != nil {
		return err
	}
	if err := leasekit.CheckToken(op, token); err != nil {
		return err
	}
	if w.s.bug == "refuse-valid" && len(key) >= 64 {
		return &fence.InvalidError{Op: op, Arg: "key", Reason: "too long"}
	}
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	k := w.s.fold("key", key)
	if r := w.s.rows[k]; r != nil && r.token > token {
		return &fence.StaleError{Key: key, Offered: token, Current: r.token}
	}
	if w.s.bug != "write-alias" {
		value = append([]byte{}, value...)
	}
	w.s.rows[k] = &memRow{value: value, token: token, dead: dead}
	return nil
}

// Read returns the value and token under key.
func (w memWriter) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	if err := w.check("read", ctx, key); err != nil {
		return nil, 0, err
	}
	w.s.mu.Lock()
	defer w.s.mu.Unlock()
	r := w.s.rows[w.s.fold("key", key)]
	if r == nil || r.dead {
		return nil, 0, fence.ErrNotFound
	}
	if w.s.bug == "read-alias" {
		return r.value, r.token, nil
	}
	return append([]byte{}, r.value...), r.token, nil
}

var (
	_ fence.FencedWriter = memWriter{}
	_ fence.Reader       = memWriter{}
	_ fence.Deleter      = memWriter{}
	_ fence.Acquirer     = memAcquirer{}
)

// memoryBug is the bug this process runs with: none unless a child of
// TestMutantsKilled.
func memoryBug(t *testing.T) string {
	bug := os.Getenv(mutantEnv)
	if bug != "" {
		t.Logf("running the in-memory backend with the bug %q", bug)
	}
	if bug == "hold-renews-after-panic" {
		testbug.HoldRenewsAfterPanic.Store(true)
	}
	return bug
}

// memShortTTL is the suite's ShortTTL for bug: the default but for the
// ttl-round-down mutant, whose server drops a lease at 2/3 of its ttl, which
// NoGrantWhileHolderContextLive sees only by a TryAcquire between then and
// the holder's local deadline: a window that on a loaded machine 50ms (of a
// 150ms lease) once missed.
func memShortTTL(bug string) time.Duration {
	if bug == "ttl-round-down" {
		return 600 * time.Millisecond
	}
	return 0
}

// TestMemoryAcquirer: the correct in-memory acquirer passes AcquirerSuite.
func TestMemoryAcquirer(t *testing.T) {
	srv := newMemServer(memoryBug(t))
	newAcq := func(*testing.T) fence.Acquirer { return memAcquirer{s: srv, maxWait: 3 * time.Second} }
	fencetest.AcquirerSuite{
		New:      newAcq,
		NewOther: newAcq,
		ShortTTL: memShortTTL(srv.bug),
		// Renewals are function calls here, with no server to fall
		// behind: 3s, so that each mutant's run stays short.
		RenewTTL:    3 * time.Second,
		SetCounter:  func(_ *testing.T, name string, tok fence.Token) { srv.setCounter(name, tok) },
		DeleteState: func(_ *testing.T, name string) { srv.deleteState(name) },
		Faulty: func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
			p := faultnet.Start(t, serveMem(t, srv))
			return memAcquirer{s: srv, via: &memClient{addr: p.Addr()}, maxWait: 3 * time.Second}, p
		},
	}.Run(t)
}

// TestMemoryWriter: the correct in-memory writer passes WriterSuite.
func TestMemoryWriter(t *testing.T) {
	srv := newMemServer(memoryBug(t))
	fencetest.WriterSuite{
		New:     func(*testing.T) fence.FencedWriter { return memWriter{s: srv} },
		BadKeys: []string{"nul\x00", "bad utf-8 \xff"},
		Faulty: func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			p := faultnet.Start(t, serveMem(t, srv))
			return memNetWriter{s: srv, via: &memClient{addr: p.Addr()}}, p
		},
	}.Run(t)
}

// TestMutantsKilled runs each mutant's suite in a child process (this test
// binary, with the bug chosen by FENCETEST_MUTANT) and checks that the suite
// failed, in the case meant to catch the bug.
func TestMutantsKilled(t *testing.T) {
	if os.Getenv(mutantEnv) != "" {
		t.Skip("a child process runs the suites only")
	}
	if testing.Short() {
		t.Skip("runs the suites once per mutant")
	}
	for _, m := range mutants {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			top := "TestMemory" + m.suite
			cmd := exec.Command(os.Args[0], "-test.run=^"+top+"$", "-test.count=1", "-test.timeout=5m")
			cmd.Env = append(os.Environ(), mutantEnv+"="+m.name)
			out, err := cmd.CombinedOutput()
			var ee *exec.ExitError
			if !errors.As(err, &ee) {
				t.Fatalf("mutant %q (%s): the suite passed (err %v):\n%s", m.name, m.what, err, out)
			}
			failed := regexp.MustCompile(`--- FAIL: `+top+`/(\S+)`).FindAllStringSubmatch(string(out), -1)
			var cases []string
			killed := false
			for _, f := range failed {
				cases = append(cases, f[1])
				killed = killed || f[1] == m.kill
			}
			if !killed {
				t.Fatalf("mutant %q (%s): %s did not fail (failed: %v):\n%s", m.name, m.what, m.kill, cases, out)
			}
			t.Logf("mutant %q (%s) killed by %s (all failing cases: %v)", m.name, m.what, m.kill, cases)
		})
	}
}

// TestMemoryEntryPoints: EntryPoints accepts the correct in-memory backend's
// answers to valid and invalid input.
func TestMemoryEntryPoints(t *testing.T) {
	srv := newMemServer(memoryBug(t))
	e := &fencetest.EntryPoints{Writer: memWriter{s: srv}, Acquirer: memAcquirer{s: srv, maxWait: time.Second},
		Refuses: func(s string) bool { return leasekit.CheckText("", "", s, 0) != nil }}
	for _, c := range []struct {
		name, key, lock string
		ttl             time.Duration
		token           uint64
	}{
		{"valid", strings.Repeat("k", 100), "n", time.Second, 1},
		{"invalid", "nul\x00", "", 0, 0},
	} {
		t.Run(c.name, func(t *testing.T) { e.Check(t, c.key, c.lock, int64(c.ttl), c.token, []byte("v")) })
	}
}
