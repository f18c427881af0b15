package redislua

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/handoff"
	"github.com/redis/go-redis/v9"
)

// ErrNotReplicated is returned by an acquirer with WaitReplicas set when a grant
// did not reach that many replicas in time. The grant was released; it is safe to
// try again.
var ErrNotReplicated = errors.New("redislua: grant not acknowledged by enough replicas")

// AcquirerOptions configures an Acquirer. A nil *AcquirerOptions means the defaults.
type AcquirerOptions struct {
	// Prefix starts every key, and may not contain braces. Default: "fence:".
	Prefix string
	// Backoff paces Acquire's attempts while the lease is held. Default: Min
	// 20ms, Max 200ms, since a release wakes a waiter at once and polling only
	// covers a missed notification; with DisableNotify, the zero fence.Backoff
	// (Min 1ms, Max 100ms).
	Backoff fence.Backoff
	// Drift is taken off each lease's local deadline. Default: 1% of the ttl plus 2ms.
	Drift time.Duration
	// TokenFloor makes every token at least the server's clock in microseconds,
	// so tokens keep growing after a failover loses the counter (see the
	// package documentation). Default: false.
	TokenFloor bool
	// WaitReplicas, when positive, runs WAIT for that many replicas after each
	// grant and refuses a grant they did not acknowledge within WaitTimeout
	// (ErrNotReplicated). Not available on Redis Cluster clients. Default: 0.
	WaitReplicas int
	// WaitTimeout bounds the WAIT. It must be shorter than the client's
	// ReadTimeout, since the WAIT is pipelined with the grant. Default: 100ms.
	WaitTimeout time.Duration
	// DisableNotify turns off waking waiters by pub/sub; they then only poll.
	// Default: false.
	DisableNotify bool
}

// Acquirer grants leases from Redis. A grant is one script: it checks the lock
// key, advances the name's token counter and sets the lock key with the ttl
// (expiry on Redis's clock). It is safe for concurrent use.
type Acquirer struct {
	c       Client
	o       AcquirerOptions
	channel string
	notify  *listener
	delex   atomic.Int32 // 0 unknown, 1 DELEX IFEQ works, 2 it does not (use the script)

	// Waiters in this process, by name, in arrival order: a Release hands the
	// lease straight to the first of them (one script: the grant moves from the
	// old holder to the waiter), at most handoff.MaxStreak times in a row.
	line handoff.Line
}

// notifiedBackoff is the default pacing of waiters that are woken by
// notifications: polling is only the fallback.
var notifiedBackoff = fence.Backoff{Min: 20 * time.Millisecond, Max: 200 * time.Millisecond}

// NewAcquirer returns an Acquirer on c. It returns an error matching fence.ErrInvalid
// for a prefix with braces, negative options, or WaitReplicas on a Cluster client.
func NewAcquirer(c Client, opts *AcquirerOptions) (*Acquirer, error) {
	if err := checkClient("new acquirer", c); err != nil {
		return nil, err
	}
	var o AcquirerOptions
	if opts != nil {
		o = *opts
	}
	if o.Prefix == "" {
		o.Prefix = DefaultPrefix
	}
	if err := checkPrefix("new acquirer", o.Prefix); err != nil {
		return nil, err
	}
	if o.Drift < 0 || o.WaitReplicas < 0 || o.WaitTimeout < 0 {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "options", Reason: "Drift, WaitReplicas and WaitTimeout may not be negative"}
	}
	if err := o.Backoff.Check("new acquirer"); err != nil {
		return nil, err
	}
	if o.WaitTimeout == 0 {
		o.WaitTimeout = 100 * time.Millisecond
	}
	if o.Backoff == (fence.Backoff{}) && !o.DisableNotify {
		o.Backoff = notifiedBackoff
	}
	if _, ok := c.(*redis.ClusterClient); ok && o.WaitReplicas > 0 {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "WaitReplicas", Reason: "WAIT cannot be routed with the grant on a Cluster client"}
	}
	if rc, ok := c.(*redis.Client); ok && o.WaitReplicas > 0 {
		if rt := rc.Options().ReadTimeout; rt > 0 && rt <= o.WaitTimeout {
			return nil, &fence.InvalidError{Op: "new acquirer", Arg: "WaitTimeout",
				Reason: fmt.Sprintf("%v is not below the client's ReadTimeout %v", o.WaitTimeout, rt)}
		}
	}
	a := &Acquirer{c: c, o: o, channel: o.Prefix + "released"}
	if !o.DisableNotify {
		a.notify = newListener(c, a.channel)
	}
	return a, nil
}

func newNonce() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// minTTL is the shortest lease: PX takes whole milliseconds.
const minTTL = time.Millisecond

func checkLease(ctx context.Context, name string, ttl time.Duration) error {
	if err := checkTagged(ctx, "acquire", "name", name); err != nil {
		return err
	}
	return fence.CheckTTL("acquire", ttl, minTTL, MaxTTL)
}

// ttlMs rounds ttl up to whole milliseconds, without overflowing.
func ttlMs(ttl time.Duration) int64 { return fence.CeilDiv(ttl, time.Millisecond) }

// TryAcquire grants the lease on name for ttl, or returns fence.ErrHeld at once.
// ttl must be at least 1ms; name may not contain braces.
func (a *Acquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := checkLease(ctx, name, ttl); err != nil {
		return nil, err
	}
	l, err := a.grant(ctx, name, ttl, "")
	if err != nil {
		return nil, err
	}
	return l, nil
}

// errMoved reports a hand-over that found the lock no longer the releasing
// holder's.
var errMoved = errors.New("redislua: lock no longer held by the releasing holder")

// grant runs the grant script: a plain grant when from is empty, else a
// hand-over from the holder whose lock value is from.
func (a *Acquirer) grant(ctx context.Context, name string, ttl time.Duration, from string) (*lease, error) {
	lock, counter := lockKeys(a.o.Prefix, name)
	nonce := newNonce()
	floor := "0"
	if a.o.TokenFloor {
		floor = "1"
	}
	sent := time.Now()
	keys, args := []string{lock, counter}, []any{nonce, ttlMs(ttl), floor, from}
	var (
		res      any
		err      error
		replicas int64 = -1
	)
	if a.o.WaitReplicas > 0 {
		res, replicas, err = a.grantAndWait(ctx, keys, args)
	} else {
		res, err = acquireScript.Run(ctx, a.c, keys, args...).Result()
	}
	if err != nil {
		return nil, fmt.Errorf("redislua: acquire %q: %w", name, scriptError(err))
	}
	flag, tok, err := parsePair(res)
	if err != nil {
		return nil, fmt.Errorf("redislua: acquire %q: %w", name, err)
	}
	switch flag {
	case 0:
		return nil, fence.ErrHeld
	case -1:
		return nil, errMoved
	}
	l := &lease{Base: leasekit.New(name, fence.Token(tok), ttl, a.o.Drift, sent), a: a, lock: lock,
		value: nonce + ":" + strconv.FormatUint(tok, 10)}
	if a.o.WaitReplicas > 0 && replicas < int64(a.o.WaitReplicas) {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		_ = l.release(rctx, false)
		cancel()
		return nil, fmt.Errorf("redislua: acquire %q: %d of %d replicas acknowledged token %d within %v: %w",
			name, replicas, a.o.WaitReplicas, tok, a.o.WaitTimeout, ErrNotReplicated)
	}
	return l, nil
}

// grantAndWait sends the grant script and WAIT in one pipeline on one
// connection, so that WAIT covers the grant.
func (a *Acquirer) grantAndWait(ctx context.Context, keys []string, args []any) (any, int64, error) {
	run := func() ([]redis.Cmder, error) {
		return a.c.Pipelined(ctx, func(p redis.Pipeliner) error {
			acquireScript.EvalSha(ctx, p, keys, args...)
			p.Do(ctx, "WAIT", a.o.WaitReplicas, a.o.WaitTimeout.Milliseconds())
			return nil
		})
	}
	cmds, err := run()
	if err != nil && redis.HasErrorPrefix(cmds[0].Err(), "NOSCRIPT") {
		if err := acquireScript.Load(ctx, a.c).Err(); err != nil {
			return nil, 0, err
		}
		cmds, err = run()
	}
	if err != nil {
		if e := cmds[0].Err(); e != nil {
			return nil, 0, e
		}
		return nil, 0, err
	}
	res, _ := cmds[0].(*redis.Cmd).Result()
	n, err := cmds[1].(*redis.Cmd).Int64()
	if err != nil {
		return nil, 0, fmt.Errorf("WAIT: %w", err)
	}
	return res, n, nil
}

// Acquire waits until the lease on name is granted. A Release of name in this
// process hands the lease straight to the longest-waiting Acquire here (one
// script, one round trip); a release elsewhere wakes a waiter here through
// pub/sub; between those, attempts are paced by the acquirer's Backoff. See
// fence.Acquirer.
func (a *Acquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := checkLease(ctx, name, ttl); err != nil {
		return nil, err
	}
	// Wait in line before the first attempt, so that a Release between a failed
	// attempt and the wait still finds this waiter.
	w := a.line.Join(name, ttl)
	defer a.line.Leave(name, w)

	l, err := a.grant(ctx, name, ttl, "")
	if err == nil || !errors.Is(err, fence.ErrHeld) {
		return lOrNil(l), err
	}
	if a.notify != nil {
		unsubscribe := a.notify.SubscribeChan(name, w.Wake)
		defer unsubscribe()
	}
	return a.o.Backoff.Retry(ctx, w.Wake, func(ctx context.Context) (fence.Lease, error) {
		if l := a.line.Take(w); l != nil {
			return l, nil
		}
		l, err := a.grant(ctx, name, ttl, "")
		return lOrNil(l), err
	})
}

// lOrNil keeps a nil *lease from becoming a non-nil fence.Lease.
func lOrNil(l *lease) fence.Lease {
	if l == nil {
		return nil
	}
	return l
}

// parsePair reads a script's {flag, number} reply.
func parsePair(res any) (int64, uint64, error) {
	arr, ok := res.([]any)
	if !ok || len(arr) != 2 {
		return 0, 0, fmt.Errorf("unexpected script reply %v", res)
	}
	flag, _ := arr[0].(int64)
	var n uint64
	switch v := arr[1].(type) {
	case int64:
		if v < 0 { // PTTL of a key without expiry (-1)
			v = 0
		}
		n = uint64(v)
	case string:
		var err error
		if n, err = strconv.ParseUint(v, 10, 64); err != nil {
			return 0, 0, fmt.Errorf("unexpected number %q in script reply", v)
		}
	default:
		return 0, 0, fmt.Errorf("unexpected script reply %v", res)
	}
	return flag, n, nil
}

// scriptError turns the scripts' own error replies into package errors.
func scriptError(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "fencekit: token counter") && strings.Contains(msg, "exhausted"):
		return fmt.Errorf("%w (%s)", fence.ErrTokensExhausted, msg)
	case strings.Contains(msg, "fencekit: "):
		return &CorruptError{Msg: msg[strings.Index(msg, "fencekit: "):], Err: err}
	}
	return err
}

// CorruptError reports a key this package uses that holds something it did not
// write (for example a token counter that is not a number): someone else wrote it.
type CorruptError struct {
	Msg string
	Err error
}

// Error says which key holds what.
func (e *CorruptError) Error() string { return "redislua: " + strings.TrimPrefix(e.Msg, "fencekit: ") }

// Unwrap returns the server's error reply.
func (e *CorruptError) Unwrap() error { return e.Err }

// lease is one grant from an Acquirer.
type lease struct {
	*leasekit.Base
	a     *Acquirer
	lock  string
	value string // nonce:token, unique to this grant even if a counter is lost
}

// Renew extends the lease by its ttl on Redis's clock if this grant still holds it.
func (l *lease) Renew(ctx context.Context) error {
	if err := fence.CheckContext("renew", ctx); err != nil {
		return err
	}
	sent := time.Now()
	n, err := renewScript.Run(ctx, l.a.c, []string{l.lock}, l.value, ttlMs(l.TTL())).Int64()
	if err != nil {
		return fmt.Errorf("redislua: renew %q: %w", l.Name(), err)
	}
	if n == 0 {
		l.End(fence.ErrLost)
		return l.lost()
	}
	if !l.Extend(sent) {
		return l.lost()
	}
	return nil
}

// Release gives the lease up if this grant still holds it. When another Acquire
// of this process waits for the name, the lease is handed straight to it in one
// script; otherwise the lock key is deleted (DELEX IFEQ on Redis 8.4 and newer,
// a compare-and-delete script before) and waiters everywhere are told by pub/sub.
func (l *lease) Release(ctx context.Context) error {
	if err := fence.CheckContext("release", ctx); err != nil {
		return err
	}
	return l.release(ctx, true)
}

func (l *lease) release(ctx context.Context, handoff bool) error {
	defer l.End(context.Canceled)
	if handoff {
		if w := l.a.line.Next(l.Name()); w != nil {
			next, err := l.a.grant(ctx, l.Name(), w.TTL, l.value)
			l.a.line.Finish(w, lOrNil(next))
			switch {
			case err == nil:
				return nil
			case errors.Is(err, errMoved):
				return l.lost()
			case errors.Is(err, ErrNotReplicated):
				// The lock moved to the waiter and was freed again (grant
				// refused them both): it is released; the waiter tries itself.
				return nil
			default:
				return fmt.Errorf("redislua: release %q: %w", l.Name(), err)
			}
		}
	}
	n, err := l.a.release(ctx, l.lock, l.value, l.Name())
	if err != nil {
		return fmt.Errorf("redislua: release %q: %w", l.Name(), err)
	}
	if n == 0 {
		return l.lost()
	}
	return nil
}

func (a *Acquirer) release(ctx context.Context, lock, value, name string) (int64, error) {
	if a.delex.Load() != 2 {
		var del *redis.Cmd
		_, err := a.c.Pipelined(ctx, func(p redis.Pipeliner) error {
			del = p.Do(ctx, "DELEX", lock, "IFEQ", value)
			p.Publish(ctx, a.channel, name)
			return nil
		})
		if err == nil || del == nil || !isUnknownCommand(del.Err()) {
			if err == nil {
				a.delex.Store(1)
				return del.Int64()
			}
			return 0, err
		}
		a.delex.Store(2) // an older server: use the script from now on
	}
	return releaseScript.Run(ctx, a.c, []string{lock}, value, a.channel, name).Int64()
}

func isUnknownCommand(err error) bool {
	return err != nil && (strings.Contains(err.Error(), "unknown command") || strings.Contains(err.Error(), "syntax error"))
}

func (l *lease) lost() error {
	return fmt.Errorf("redislua: lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}
