package redislua

import (
	"context"
	"fmt"
	"strconv"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/redis/go-redis/v9"
)

// FencedScript runs a Lua body of yours only when a fencing token passes: the
// general form of "the same check in a Lua script when the data is in Redis". The
// check, the body and the fence update run as one script, atomically.
//
// The body sees KEYS and ARGV as its own keys and arguments, and its return
// value is returned by Run. The fence is a string key holding the largest token
// accepted; on Redis Cluster the fence key and the body's keys must share a hash
// tag.
//
// The fence is raised to the token before the body runs. Redis does not roll
// back a script that fails half-way: a body that raises an error keeps the
// writes it made before the error, and Run returns the error. Those writes are
// fenced like any other: the fence already holds the token, so no lower token
// can run over them, and the same token may run again to finish the work.
type FencedScript struct {
	s *redis.Script
}

// NewFencedScript wraps body, the text of a Lua function body (it may return a value).
func NewFencedScript(body string) *FencedScript {
	return &FencedScript{s: redis.NewScript(fencedBody(body))}
}

// Run raises the fence at fenceKey to token and runs the body with keys and args,
// if token is not lower than the token the fence holds. A lower token returns a
// *fence.StaleError (matching fence.ErrStale) and the body does not run.
//
// The body runs at most once per call: the script is sent once, never again
// by go-redis after a network error (equal tokens pass the fence, so a resent
// INCR would count twice). A call whose reply was lost returns an error
// matching fence.ErrUnknown: the body may have run. c must be a go-redis
// client (it needs Process or Pipelined to send the script once); a
// pipeline or transaction (redis.Pipeliner), which would only queue the
// script and run it at Exec, after Run has returned, and another
// redis.Scripter get fence.ErrInvalid.
func (f *FencedScript) Run(ctx context.Context, c redis.Scripter, fenceKey string, token fence.Token, keys []string, args ...any) (any, error) {
	if err := leasekit.CheckContext("fenced script", ctx); err != nil {
		return nil, err
	}
	if err := checkClient("fenced script", c); err != nil {
		return nil, err
	}
	if _, ok := c.(redis.Pipeliner); ok {
		return nil, &fence.InvalidError{Op: "fenced script", Arg: "client", Reason: "a pipeline only queues the script, which would run at Exec after Run returned"}
	}
	if sender(c) == nil {
		return nil, &fence.InvalidError{Op: "fenced script", Arg: "client", Reason: errNoProcess.Error()}
	}
	if fenceKey == "" {
		return nil, &fence.InvalidError{Op: "fenced script", Arg: "fence key", Reason: "empty"}
	}
	if err := leasekit.CheckToken("fenced script", token); err != nil {
		return nil, err
	}
	allKeys := append([]string{fenceKey}, keys...)
	allArgs := append([]any{strconv.FormatUint(uint64(token), 10)}, args...)
	res, err := runOnceSlice(ctx, c, f.s, allKeys, allArgs...)
	if err != nil {
		return nil, fmt.Errorf("redislua: fenced script: %w", scriptError(err))
	}
	if len(res) >= 1 && res[0] == int64(1) {
		if len(res) == 1 {
			return nil, nil // the body returned nil
		}
		return res[1], nil
	}
	if len(res) != 2 {
		return nil, fmt.Errorf("redislua: fenced script: unexpected reply %v", res)
	}
	cur, err := strconv.ParseUint(fmt.Sprint(res[1]), 10, 64)
	if err != nil {
		return nil, fmt.Errorf("redislua: fenced script: unexpected reply %v", res)
	}
	return nil, &fence.StaleError{Key: fenceKey, Offered: token, Current: fence.Token(cur)}
}
