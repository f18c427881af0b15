package redislua

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/redis/go-redis/v9"
)

// inspectScript reads the lock value, its time left and the counter at once.
var inspectScript = redis.NewScript(`return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1]), redis.call('GET', KEYS[2])}`)

var (
	_ fence.Inspector = (*Acquirer)(nil)
	_ fence.Bumper    = (*Acquirer)(nil)
)

// Inspect reports name's holder (its owner is the grant's nonce), time left and
// counter, read in one script.
func (a *Acquirer) Inspect(ctx context.Context, name string) (fence.LockInfo, error) {
	if err := checkTagged(ctx, "inspect", "name", name); err != nil {
		return fence.LockInfo{}, err
	}
	lock, counter := lockKeys(a.o.Prefix, name)
	var res []any
	err := retryNotRun(ctx, func() (err error) {
		res, err = inspectScript.Run(ctx, a.c, []string{lock, counter}).Slice()
		return err
	})
	if err != nil {
		return fence.LockInfo{}, fmt.Errorf("redislua: inspect %q: %w", name, err)
	}
	info := fence.LockInfo{Name: name}
	if res[2] == nil && res[0] == nil {
		return info, fmt.Errorf("redislua: inspect %q: %w", name, fence.ErrNotFound)
	}
	if s, ok := res[2].(string); ok {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return info, &CorruptError{Msg: fmt.Sprintf("token counter %s holds %q, not a token", counter, s)}
		}
		info.Counter = fence.Token(n)
	}
	if v, ok := res[0].(string); ok {
		nonce, tok, found := strings.Cut(v, ":")
		n, err := strconv.ParseUint(tok, 10, 64)
		if !found || err != nil {
			return info, &CorruptError{Msg: fmt.Sprintf("lock %s holds %q, not a lease", lock, v)}
		}
		pttl, _ := res[1].(int64)
		info.Held, info.Token, info.Owner, info.TimeLeft = true, fence.Token(n), nonce, time.Duration(pttl)*time.Millisecond
	}
	return info, nil
}

// Bump raises name's counter to to (the holder, if any, keeps its lease). A
// counter already at or above to is refused with fence.ErrInvalid. A Bump
// whose reply was lost returns an error matching fence.ErrUnknown (raised or
// not: Inspect tells).
func (a *Acquirer) Bump(ctx context.Context, name string, to fence.Token) error {
	if err := checkTagged(ctx, "bump", "name", name); err != nil {
		return err
	}
	if err := leasekit.CheckToken("bump", to); err != nil {
		return err
	}
	_, counter := lockKeys(a.o.Prefix, name)
	// Sent once: sent again after it ran, it would find the counter at to
	// and refuse.
	res, err := runOnce(ctx, a.c, bumpScript, []string{counter}, strconv.FormatUint(uint64(to), 10))
	if err != nil {
		return fmt.Errorf("redislua: bump %q: %w", name, scriptError(err))
	}
	flag, cur, err := parsePair(res)
	if err != nil {
		return fmt.Errorf("redislua: bump %q: %w", name, err)
	}
	if flag != 1 {
		return &fence.InvalidError{Op: "bump", Arg: "to", Reason: fmt.Sprintf("%d would not raise the counter, already at %d", to, cur)}
	}
	return nil
}
