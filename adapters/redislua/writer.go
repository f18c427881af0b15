package redislua

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// WriterOptions configures a Writer. A nil *WriterOptions means the defaults.
type WriterOptions struct {
	// Prefix starts every key, and may not contain braces. Default: "fence:".
	Prefix string
}

// Writer is a fence.FencedWriter, fence.Reader and fence.Deleter on Redis. A key's
// value and fence live in one hash, prefix + "{key}" (fields v and f), and each
// write or delete is one script that compares and writes atomically. It is safe
// for concurrent use.
//
// A key may not begin with "idem:" (fence.ErrInvalid): the IdempotencyStore
// keeps key k's record at prefix + "{idem:k}", which is where the Writer would
// keep "idem:k", and with one prefix the two would share a hash (a Begin
// would wipe the Writer's fence, and a stale write would be accepted).
type Writer struct {
	c      Client
	prefix string
}

var (
	_ fence.FencedWriter = (*Writer)(nil)
	_ fence.Reader       = (*Writer)(nil)
	_ fence.Deleter      = (*Writer)(nil)
)

// NewWriter returns a Writer on c, or an error matching fence.ErrInvalid for a
// prefix with braces.
func NewWriter(c Client, opts *WriterOptions) (*Writer, error) {
	if err := checkClient("new writer", c); err != nil {
		return nil, err
	}
	prefix := DefaultPrefix
	if opts != nil && opts.Prefix != "" {
		prefix = opts.Prefix
	}
	if err := checkPrefix("new writer", prefix); err != nil {
		return nil, err
	}
	return &Writer{c: c, prefix: prefix}, nil
}

// Key returns the Redis key that holds key's value and fence.
func (w *Writer) Key(key string) string { return w.prefix + "{" + key + "}" }

// Write stores value under key unless key holds a larger token. See
// fence.FencedWriter. The script is sent once (go-redis does not send it
// again after a network error): a write whose reply was lost returns an error
// matching fence.ErrUnknown, applied or not; read the key, or write again
// with the same token, to settle it.
func (w *Writer) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	return w.run(ctx, "write", key, value, token, "0")
}

// Delete drops the value under key and keeps the fence at token, unless key holds
// a larger token. See fence.Deleter. Like Write, it is sent once, and a lost
// reply returns an error matching fence.ErrUnknown.
func (w *Writer) Delete(ctx context.Context, key string, token fence.Token) error {
	return w.run(ctx, "delete", key, nil, token, "1")
}

// idemKeyPrefix starts the hash tag of an IdempotencyStore record.
const idemKeyPrefix = "idem:"

// checkWriterKey is checkTagged, and refuses a key that would name an
// IdempotencyStore record.
func checkWriterKey(ctx context.Context, op, key string) error {
	if err := checkTagged(ctx, op, "key", key); err != nil {
		return err
	}
	if strings.HasPrefix(key, idemKeyPrefix) {
		return &fence.InvalidError{Op: op, Arg: "key", Reason: `begins with "idem:", which names an IdempotencyStore record`}
	}
	return nil
}

func (w *Writer) run(ctx context.Context, op, key string, value []byte, token fence.Token, del string) error {
	if err := checkWriterKey(ctx, op, key); err != nil {
		return err
	}
	if err := leasekit.CheckToken(op, token); err != nil {
		return err
	}
	if value == nil {
		value = []byte{}
	}
	res, err := runOnceSlice(ctx, w.c, writeScript, []string{w.Key(key)}, value, strconv.FormatUint(uint64(token), 10), del)
	if err != nil {
		return fmt.Errorf("redislua: %s %q: %w", op, key, scriptError(err))
	}
	if len(res) == 1 {
		return nil
	}
	cur, err := strconv.ParseUint(fmt.Sprint(res[1]), 10, 64)
	if err != nil {
		return fmt.Errorf("redislua: %s %q: unexpected reply %v", op, key, res)
	}
	return &fence.StaleError{Key: key, Offered: token, Current: fence.Token(cur)}
}

// Read returns the value stored under key and the token that wrote it;
// fence.ErrNotFound for a key never written or deleted.
func (w *Writer) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	if err := checkWriterKey(ctx, "read", key); err != nil {
		return nil, 0, err
	}
	var res []any
	err := retryNotRun(ctx, func() error {
		return bounded(ctx, func() (err error) {
			res, err = readScript.Run(ctx, w.c, []string{w.Key(key)}).Slice()
			return err
		})
	})
	if err != nil {
		return nil, 0, fmt.Errorf("redislua: read %q: %w", key, err)
	}
	if len(res) != 2 || res[0] == nil {
		return nil, 0, fence.ErrNotFound
	}
	v, _ := res[0].(string)
	tok, err := strconv.ParseUint(fmt.Sprint(res[1]), 10, 64)
	if err != nil {
		return nil, 0, fmt.Errorf("redislua: read %q: fence %v is not a token", key, res[1])
	}
	return []byte(v), fence.Token(tok), nil
}
