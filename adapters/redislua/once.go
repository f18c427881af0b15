package redislua

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/redis/go-redis/v9"
)

// go-redis sends a command again after a network error (MaxRetries, 3 by
// default), EVALSHA included: a script whose reply was lost after it ran runs
// a second time. Steps that are not safe to repeat (a fenced write, a fenced
// script, an idempotency record's change, a release) are sent by runOnce,
// which go-redis never resends, and a lost reply is reported as
// fence.ErrUnknown.

// onceCmd is a command that go-redis must not send again after a network
// error.
type onceCmd struct{ *redis.Cmd }

// NoRetry tells go-redis not to resend the command.
func (onceCmd) NoRetry() bool { return true }

// processor is the part of a go-redis client (or pipeline) that sends a
// command as it is given.
type processor interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// errNoProcess is returned for a client that can neither Process a command
// nor run a pipeline: runOnce cannot send through it.
var errNoProcess = errors.New("client has no Process or Pipelined method to send a command once")

// runOnce runs s with keys and args, and sends it at most once: a NOSCRIPT
// reply (the script did not run) loads it and sends it again; a request that
// was never sent (a failed dial, a pool timeout) is sent again within ctx, and
// one that Redis refused without running it (see notRun) is sent again, paced,
// until it runs or ctx ends (then the error matches ErrNotRun).
// A network error after the request may have reached Redis is returned
// matching fence.ErrUnknown.
func runOnce(ctx context.Context, c redis.Scripter, s *redis.Script, keys []string, args ...any) (any, error) {
	send := sender(c)
	if send == nil {
		return nil, errNoProcess
	}
	args = append([]any{"evalsha", s.Hash(), len(keys)}, append(anys(keys), args...)...)
	loaded := false
	var refused error // the last reply that said the script did not run
	for unsent, notRuns := 0, 0; ; {
		if err := ctx.Err(); err != nil {
			if refused != nil {
				return nil, notRunError(ctx, refused)
			}
			return nil, err // not sent
		}
		cmd := onceCmd{redis.NewCmd(ctx, args...)}
		start := time.Now()
		err := bounded(ctx, func() error {
			if err := send(ctx, cmd); err != nil {
				return err
			}
			return cmd.Err()
		})
		if errors.Is(err, errNoReply) {
			return nil, inFlight(ambiguous(err), refused)
		}
		switch {
		case err == nil || errors.Is(err, redis.Nil):
			return cmd.Val(), nil
		case !loaded && redis.HasErrorPrefix(err, "NOSCRIPT"):
			if err := bounded(ctx, func() error { return s.Load(ctx, c).Err() }); err != nil {
				return nil, err
			}
			loaded = true
		case notSent(err) && unsent < maxUnsent:
			unsent++
		case notRun(err):
			refused = err
			if !timeForAnother(ctx, time.Since(start)) || notRunDelay.Sleep(ctx, notRuns) != nil {
				return nil, notRunError(ctx, err)
			}
			notRuns++
		default:
			return nil, ambiguous(err)
		}
	}
}

// maxUnsent is how many times runOnce sends again a request that never left
// the client, as go-redis's default MaxRetries would.
const maxUnsent = 3

// runOnceSlice is runOnce for a script that returns an array.
func runOnceSlice(ctx context.Context, c redis.Scripter, s *redis.Script, keys []string, args ...any) ([]any, error) {
	res, err := runOnce(ctx, c, s, keys, args...)
	if err != nil {
		return nil, err
	}
	arr, ok := res.([]any)
	if !ok {
		return nil, fmt.Errorf("unexpected script reply %v", res)
	}
	return arr, nil
}

// sender returns how to send one command through c, or nil.
func sender(c redis.Scripter) func(ctx context.Context, cmd redis.Cmder) error {
	if p, ok := c.(processor); ok {
		return p.Process
	}
	if p, ok := c.(interface {
		Pipelined(ctx context.Context, fn func(redis.Pipeliner) error) ([]redis.Cmder, error)
	}); ok {
		return func(ctx context.Context, cmd redis.Cmder) error {
			_, err := p.Pipelined(ctx, func(pl redis.Pipeliner) error { return pl.Process(ctx, cmd) })
			return err
		}
	}
	return nil
}

func anys(s []string) []any {
	a := make([]any, len(s))
	for i, v := range s {
		a[i] = v
	}
	return a
}

// errNoReply: the caller's context ended before Redis answered.
var errNoReply = errors.New("no reply before the context ended (the request may still land)")

// bounded runs call and returns its error, or returns when ctx ends first
// (errNoReply joined with ctx's cause). A go-redis client without
// ContextTimeoutEnabled (the default) does not stop at ctx's deadline: it
// waits for its ReadTimeout, then sends the command again. The call then
// goes on in the background until the client's own timeouts, and may still
// land; callers that write report that as fence.ErrUnknown.
func bounded(ctx context.Context, call func() error) error {
	if ctx.Done() == nil {
		return call()
	}
	done := make(chan error, 1)
	go func() { done <- call() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		select {
		case err := <-done:
			return err
		default:
		}
		return fmt.Errorf("%w: %w", errNoReply, context.Cause(ctx))
	}
}

// isReply reports whether err is a reply from Redis (the request was
// handled and answered), rather than a network or client error.
func isReply(err error) bool {
	var re redis.Error
	return errors.As(err, &re)
}

// notSent reports whether err shows that the request never left the client.
func notSent(err error) bool {
	var op *net.OpError
	return errors.Is(err, redis.ErrPoolTimeout) || (errors.As(err, &op) && op.Op == "dial")
}

// ErrNotRun is matched by the error of a step that Redis refused without
// running it (BUSY while another client's script runs, LOADING, OOM,
// READONLY, MASTERDOWN, TRYAGAIN, CLUSTERDOWN, NOREPLICAS, MISCONF) every time
// it was sent until the caller's context ended: that step changed nothing.
// The error also matches the context's error and holds Redis's reply.
var ErrNotRun = errors.New("redislua: Redis did not run the step")

// notRunCodes are the error codes with which Redis refuses a command, or a
// script's first write, before it changed anything.
var notRunCodes = []string{"BUSY", "LOADING", "OOM", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "READONLY", "NOREPLICAS", "MISCONF"}

// notRun reports whether err holds a reply of Redis that says the step did not
// run: it changed nothing and is safe to send again.
func notRun(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	code, _, _ := strings.Cut(strings.TrimPrefix(re.Error(), "ERR "), " ")
	return slices.Contains(notRunCodes, code)
}

// notRunDelay paces a step sent again after Redis did not run it.
var notRunDelay = fence.Backoff{Min: 5 * time.Millisecond, Max: 100 * time.Millisecond}

// retryNotRun calls step until Redis runs it: a reply that says it did not run
// is sent again, paced by notRunDelay, while ctx lasts. When ctx ends first,
// the error matches ErrNotRun and ctx's cause. step must return when ctx ends.
func retryNotRun(ctx context.Context, step func() error) error {
	var refused error
	for attempt := 0; ; attempt++ {
		start := time.Now()
		err := step()
		if errors.Is(err, errNoReply) {
			return inFlight(err, refused)
		}
		if !notRun(err) {
			return err
		}
		refused = err
		if !timeForAnother(ctx, time.Since(start)) || notRunDelay.Sleep(ctx, attempt) != nil {
			return notRunError(ctx, err)
		}
	}
}

// timeForAnother reports whether ctx leaves time for one more send, given
// that the last one took took: a send cut off by the deadline may land, and
// would turn a step Redis refused to run into an unknown outcome, so the
// last send is one that has time to be answered.
func timeForAnother(ctx context.Context, took time.Duration) bool {
	d, ok := ctx.Deadline()
	return !ok || time.Until(d) > 2*took+notRunDelay.Max
}

// inFlight is the error of a step whose context ended while it was sent
// again after Redis had not run it: err (that send may still land), holding
// the earlier reply too.
func inFlight(err, refused error) error {
	if refused == nil {
		return err
	}
	return fmt.Errorf("%w (sent again after %w)", err, refused)
}

// notRunError is the error of a step that Redis did not run before ctx ended.
func notRunError(ctx context.Context, reply error) error {
	if errors.Is(reply, ErrNotRun) {
		return reply
	}
	cause := context.Cause(ctx)
	if cause == nil {
		// Stopped with too little time left for another send's answer.
		return fmt.Errorf("%w (%w) with too little time left for another send: %w", ErrNotRun, reply, context.DeadlineExceeded)
	}
	return fmt.Errorf("%w (%w) before the context ended: %w", ErrNotRun, reply, cause)
}

// ambiguous wraps err so that it matches fence.ErrUnknown when it is not a
// reply from Redis and not a request that was never sent: the request may
// have been applied, its reply lost. A send cut off by the context
// (errNoReply) is one, also when it holds an earlier send's reply that said
// the step did not run (inFlight).
func ambiguous(err error) error {
	if err == nil || errors.Is(err, fence.ErrUnknown) {
		return err
	}
	if !errors.Is(err, errNoReply) && (isReply(err) || notSent(err)) {
		return err
	}
	return fmt.Errorf("%w (applied or not): %w", fence.ErrUnknown, err)
}
