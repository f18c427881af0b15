package redislua

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/idempotency"
)

// IdempotencyOptions configures an IdempotencyStore. A nil pointer means the defaults.
type IdempotencyOptions struct {
	// Prefix starts every key, and may not contain braces. Default: "fence:".
	Prefix string
	// ReleasedRetention is how long a released record (and its fence) is kept.
	// Default: 24h.
	ReleasedRetention time.Duration
}

// IdempotencyStore is an idempotency.Store in Redis: one hash per key,
// prefix + "{idem:key}", changed only by scripts that compare and set on the
// server's clock (TIME). Records past their retention are removed by Redis
// itself (PEXPIRE), so Purge has nothing to do. It is also an
// idempotency.Notifier: a change that ends an owner's hold publishes the key.
type IdempotencyStore struct {
	c       Client
	o       IdempotencyOptions
	channel string
	notify  *listener
}

var (
	_ idempotency.Store    = (*IdempotencyStore)(nil)
	_ idempotency.Notifier = (*IdempotencyStore)(nil)
)

// NewIdempotencyStore returns a store on c. It returns an error matching
// fence.ErrInvalid for a nil client, a *redis.Ring (its notifications would
// be published on another shard than the one it listens on), a prefix with
// braces or a negative ReleasedRetention.
func NewIdempotencyStore(c Client, opts *IdempotencyOptions) (*IdempotencyStore, error) {
	if err := checkClient("new idempotency store", c); err != nil {
		return nil, err
	}
	if err := checkNotRing("new idempotency store", c); err != nil {
		return nil, err
	}
	var o IdempotencyOptions
	if opts != nil {
		o = *opts
	}
	if o.Prefix == "" {
		o.Prefix = DefaultPrefix
	}
	if err := checkPrefix("new idempotency store", o.Prefix); err != nil {
		return nil, err
	}
	if o.ReleasedRetention < 0 {
		return nil, &fence.InvalidError{Op: "new idempotency store", Arg: "ReleasedRetention", Reason: "negative"}
	}
	if o.ReleasedRetention == 0 {
		o.ReleasedRetention = 24 * time.Hour
	}
	s := &IdempotencyStore{c: c, o: o, channel: o.Prefix + "idem"}
	s.notify = newListener(c, s.channel)
	return s, nil
}

func (s *IdempotencyStore) key(k string) string { return s.o.Prefix + "{" + idemKeyPrefix + k + "}" }

// parseRecord reads the eight record fields of the scripts.
func parseRecord(key string, f []any) (idempotency.Record, error) {
	if len(f) != 8 {
		return idempotency.Record{}, fmt.Errorf("redislua: idempotency record %q: unexpected reply %v", key, f)
	}
	str := func(v any) string { s, _ := v.(string); return s }
	num := func(v any) (int64, error) { return strconv.ParseInt(str(v), 10, 64) }
	r := idempotency.Record{Key: key, Fingerprint: str(f[0]), State: idempotency.State(str(f[1])), Owner: str(f[3])}
	fv, err := strconv.ParseUint(str(f[2]), 10, 64)
	if err != nil {
		return r, fmt.Errorf("redislua: idempotency record %q: fence %v", key, f[2])
	}
	r.Fence = fence.Token(fv)
	lease, err1 := num(f[4])
	prog, err2 := num(f[5])
	if err1 != nil || err2 != nil {
		return r, fmt.Errorf("redislua: idempotency record %q: malformed times %v %v", key, f[4], f[5])
	}
	r.LeaseLeft, r.InProgressFor = time.Duration(lease)*time.Millisecond, time.Duration(prog)*time.Millisecond
	if f[6] != nil {
		r.Result = []byte(str(f[6]))
	}
	r.ResultDropped = str(f[7]) == "1"
	return r, nil
}

// Begin claims key, or returns its record; a lease that is not positive is
// fence.ErrInvalid. One script, one round trip, sent
// once: a Begin whose reply was lost returns an error matching
// fence.ErrUnknown (the key may be claimed for owner: Get tells).
func (s *IdempotencyStore) Begin(ctx context.Context, key, fingerprint, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	if err := checkTagged(ctx, "idempotency begin", "key", key); err != nil {
		return idempotency.Record{}, false, err
	}
	if lease <= 0 {
		return idempotency.Record{}, false, &fence.InvalidError{Op: "idempotency begin", Arg: "lease", Reason: "not positive"}
	}
	res, err := runOnceSlice(ctx, s.c, idemBeginScript, []string{s.key(key)}, fingerprint, owner, lease.Milliseconds())
	if err != nil {
		return idempotency.Record{}, false, fmt.Errorf("redislua: idempotency begin %q: %w", key, err)
	}
	if len(res) != 9 {
		return idempotency.Record{}, false, fmt.Errorf("redislua: idempotency begin %q: unexpected reply %v", key, res)
	}
	rec, err := parseRecord(key, res[1:])
	return rec, res[0] == int64(1), err
}

// Get returns key's record, or fence.ErrNotFound. It returns once ctx
// ends, also when the client would wait its ReadTimeout: a read whose
// request may have reached Redis unanswered then returns an error matching
// fence.ErrUnknown and the context's error.
func (s *IdempotencyStore) Get(ctx context.Context, key string) (idempotency.Record, error) {
	if err := checkTagged(ctx, "idempotency get", "key", key); err != nil {
		return idempotency.Record{}, err
	}
	// res is read only when the call returned: after errNoReply it goes on
	// in the background.
	var res []any
	err := retryNotRun(ctx, func() error {
		return bounded(ctx, func() (err error) {
			res, err = idemGetScript.Run(ctx, s.c, []string{s.key(key)}).Slice()
			return err
		})
	})
	if err != nil {
		return idempotency.Record{}, fmt.Errorf("redislua: idempotency get %q: %w", key, ambiguous(err))
	}
	if len(res) == 0 {
		return idempotency.Record{}, fence.ErrNotFound
	}
	return parseRecord(key, res)
}

// Update is the compare-and-set on state and fence. See idempotency.Store.
// The script is sent once: an Update whose reply was lost returns an error
// matching fence.ErrUnknown (applied or not: Get tells), never the
// ErrStateChanged or stale error a resend would find after its own change.
func (s *IdempotencyStore) Update(ctx context.Context, key string, from idempotency.State, fromFence fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if err := checkTagged(ctx, "idempotency update", "key", key); err != nil {
		return idempotency.Record{}, err
	}
	if ch.Lease < 0 || ch.Retention < 0 {
		return idempotency.Record{}, &fence.InvalidError{Op: "idempotency update", Arg: "change", Reason: "negative lease or retention"}
	}
	flag := func(b bool) string {
		if b {
			return "1"
		}
		return "0"
	}
	res, err := runOnceSlice(ctx, s.c, idemUpdateScript, []string{s.key(key)},
		string(from), strconv.FormatUint(uint64(fromFence), 10), string(ch.State), strconv.FormatUint(uint64(ch.Fence), 10),
		ch.Owner, ch.Lease.Milliseconds(), flag(ch.Restart), ch.Retention.Milliseconds(), ch.Result,
		flag(ch.ResultDropped), flag(ch.Result != nil), s.channel, key, s.o.ReleasedRetention.Milliseconds())
	if err != nil {
		return idempotency.Record{}, fmt.Errorf("redislua: idempotency update %q: %w", key, err)
	}
	switch {
	case len(res) == 9 && res[0] == int64(1):
		return parseRecord(key, res[1:])
	case len(res) == 1 && res[0] == int64(-1):
		return idempotency.Record{}, fence.ErrNotFound
	case len(res) == 2 && res[0] == int64(-2):
		cur, _ := strconv.ParseUint(fmt.Sprint(res[1]), 10, 64)
		return idempotency.Record{}, &fence.StaleError{Key: key, Offered: fromFence, Current: fence.Token(cur)}
	case len(res) == 2 && res[0] == int64(-3):
		return idempotency.Record{}, &idempotency.StateError{Key: key, Want: from, Got: idempotency.State(fmt.Sprint(res[1]))}
	}
	return idempotency.Record{}, fmt.Errorf("redislua: idempotency update %q: unexpected reply %v", key, res)
}

// Purge returns 0: Redis removes records past their retention itself.
func (s *IdempotencyStore) Purge(ctx context.Context) (int, error) {
	return 0, leasekit.CheckContext("idempotency purge", ctx)
}

// Subscribe wakes a waiting Do when key's record leaves its owner's hands.
func (s *IdempotencyStore) Subscribe(key string) (<-chan struct{}, func()) {
	return s.notify.Subscribe(key)
}
