package natsfence

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrFenceGone is matched by a write, delete or read of a key whose entry was
// deleted or purged in the bucket by something other than the Writer (kv del,
// kv purge): its fence went with it, so the Writer cannot tell a stale token
// from a current one and refuses every write to the key. An
// operator who knows that no holder of an older token is alive removes the
// marker with a stream purge of the key's subject; the key then starts afresh.
var ErrFenceGone = errors.New("natsfence: the key's entry was deleted or purged outside the writer: its fence is gone")

// WriterOptions configures a Writer. A nil *WriterOptions means the defaults.
type WriterOptions struct {
	// Timeout bounds each request to the server: at least MinTimeout.
	// Default: 2s.
	Timeout time.Duration
	// RetryFor bounds how long a write whose reply was lost (a timeout, a
	// dropped connection, a leader election) is retried before it returns
	// fence.ErrUnknown. Default: 10s.
	RetryFor time.Duration
}

// MinTimeout is the shortest Timeout a Writer, an IdempotencyStore or an
// Acquirer accepts (zero is the default), and an Acquirer's shortest MaxWait
// and Recheck: a shorter one (2 meant as seconds is 2ns) would end every
// request before the server's reply and make every step fail.
const MinTimeout = 10 * time.Millisecond

func (o *WriterOptions) withDefaults(op string) (WriterOptions, error) {
	var w WriterOptions
	if o != nil {
		w = *o
	}
	if w.Timeout < 0 || (w.Timeout > 0 && w.Timeout < MinTimeout) {
		return w, &fence.InvalidError{Op: op, Arg: "Timeout", Reason: fmt.Sprintf("%v is negative or under MinTimeout (%v)", w.Timeout, MinTimeout)}
	}
	if w.RetryFor < 0 {
		return w, &fence.InvalidError{Op: op, Arg: "RetryFor", Reason: "negative"}
	}
	if w.Timeout == 0 {
		w.Timeout = 2 * time.Second
	}
	if w.RetryFor == 0 {
		w.RetryFor = 10 * time.Second
	}
	return w, nil
}

// Writer is a fence.FencedWriter, fence.Reader and fence.Deleter on a NATS
// JetStream key-value bucket. A key's value and fence live in one entry (the KV
// key is EncodeKey(key)), and each write is one compare-and-set on the entry's
// revision: the writer reads the entry, refuses a lower token with a
// *fence.StaleError, and publishes the new entry expecting the revision it
// read, so a concurrent change makes the publish fail and the writer look
// again. Every entry carries a random write id, so a write whose reply was lost
// is recognised when it landed (nil) and otherwise, when the key still holds
// the entry it expected to replace (the same revision and write id: a bucket
// deleted and re-created numbers its revisions from 1 again), sent again with
// the same expected revision, which can land at most once; when neither
// settles it within RetryFor, or the entry changed, Write returns an error
// matching fence.ErrUnknown. It is safe for concurrent use.
type Writer struct {
	kv         jetstream.KeyValue
	stream     jetstream.Stream
	js         jetstream.JetStream
	streamName string
	subj       string // the subject prefix of the bucket's keys
	o          WriterOptions
}

var (
	_ fence.FencedWriter = (*Writer)(nil)
	_ fence.Reader       = (*Writer)(nil)
	_ fence.Deleter      = (*Writer)(nil)
)

// NewWriter returns a Writer on the existing KV bucket named bucket of js. It
// reads the bucket's configuration once and refuses, with an error matching
// fence.ErrInvalid naming the bucket, one whose entries expire (a bucket TTL):
// an expired entry takes its fence with it, and a stale writer could then
// write again. A bucket that drops its oldest entries at a message or byte
// limit (discard old), a mirror or a bucket with sources is refused likewise,
// and a negative option or a Timeout under MinTimeout (naming it). A missing
// bucket returns an error matching jetstream.ErrBucketNotFound.
func NewWriter(ctx context.Context, js jetstream.JetStream, bucket string, opts *WriterOptions) (*Writer, error) {
	const op = "new writer"
	o, err := opts.withDefaults(op)
	if err != nil {
		return nil, err
	}
	kv, stream, err := openBucket(ctx, op, js, bucket)
	if err != nil {
		return nil, err
	}
	if ttl := stream.CachedInfo().Config.MaxAge; ttl != 0 {
		return nil, &fence.InvalidError{Op: op, Arg: "bucket", Reason: fmt.Sprintf("%q expires its entries after %v, and a fence must outlive every holder of an older token: use a bucket without TTL", bucket, ttl)}
	}
	return &Writer{kv: kv, stream: stream, js: js, streamName: "KV_" + bucket, subj: "$KV." + bucket + ".", o: o}, nil
}

// The entry layout: version, flags, token (big-endian), write id, value.
const (
	entryVersion = 1
	flagDeleted  = 1
	widLen       = 16
	headerLen    = 2 + 8 + widLen
)

type entry struct {
	deleted bool
	token   fence.Token
	wid     [widLen]byte
	value   []byte
}

func (e entry) encode() []byte {
	b := make([]byte, headerLen, headerLen+len(e.value))
	b[0] = entryVersion
	if e.deleted {
		b[1] = flagDeleted
	}
	binary.BigEndian.PutUint64(b[2:10], uint64(e.token))
	copy(b[10:headerLen], e.wid[:])
	return append(b, e.value...)
}

func decodeEntry(b []byte) (entry, error) {
	if len(b) < headerLen || b[0] != entryVersion || b[1]&^flagDeleted != 0 {
		return entry{}, errors.New("not an entry written by natsfence")
	}
	var e entry
	e.deleted = b[1]&flagDeleted != 0
	e.token = fence.Token(binary.BigEndian.Uint64(b[2:10]))
	copy(e.wid[:], b[10:headerLen])
	e.value = append([]byte{}, b[headerLen:]...)
	return e, nil
}

// Write stores value under key unless key holds a larger token. See
// fence.FencedWriter. A value is bounded by the server's max_payload less 26
// bytes of entry header.
func (w *Writer) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	return w.put(ctx, "write", key, entry{token: token, value: value})
}

// Delete drops the value under key and keeps the fence at token, unless key
// holds a larger token. See fence.Deleter.
func (w *Writer) Delete(ctx context.Context, key string, token fence.Token) error {
	return w.put(ctx, "delete", key, entry{token: token, deleted: true})
}

func (w *Writer) put(ctx context.Context, op, key string, e entry) error {
	if err := checkKey(ctx, op, "key", key); err != nil {
		return err
	}
	if err := leasekit.CheckToken(op, e.token); err != nil {
		return err
	}
	if _, err := rand.Read(e.wid[:]); err != nil {
		return fmt.Errorf("natsfence: %s %q: write id: %w", op, key, err)
	}
	kvKey := EncodeKey(key)
	data := e.encode()
	giveUp := time.Now().Add(w.o.RetryFor)
	var lastErr error  // the last ambiguous failure, if any
	var sentRev uint64 // the revision that attempt expected
	// sentWid is the write id of the entry that attempt expected to
	// replace (zero: none). A revision names an entry only within one
	// bucket: one deleted and re-created starts its revisions at 1 again.
	var sentWid [widLen]byte
	unknown := func(err error) error {
		return fmt.Errorf("natsfence: %s %q token %d: %w: %w", op, key, e.token, fence.ErrUnknown, err)
	}
	// connected waits until the client is connected: a publish is not sent
	// while it is not, since the client would send it after the reconnect,
	// however late (after this write returned).
	connected := func() error {
		for disconnected(w.js) {
			if time.Now().After(giveUp) || retryWait(ctx, w.js) != nil {
				err := errors.Join(errNotConnected, context.Cause(ctx))
				if lastErr != nil {
					return unknown(errors.Join(lastErr, err))
				}
				return fmt.Errorf("natsfence: %s %q: %w", op, key, err)
			}
		}
		return nil
	}
	for {
		if lastErr != nil {
			// Read again once connected, as the attempt would be sent.
			if err := connected(); err != nil {
				return err
			}
		}
		cur, rev, err := w.get(ctx, op, key, kvKey)
		if err != nil {
			if lastErr != nil && !errors.Is(err, ErrFenceGone) {
				return unknown(errors.Join(lastErr, err))
			}
			return err
		}
		if cur != nil && cur.wid == e.wid {
			return nil // an earlier attempt, whose reply was lost, landed
		}
		if cur != nil && cur.token > e.token {
			stale := &fence.StaleError{Key: key, Offered: e.token, Current: cur.token}
			if lastErr != nil {
				// An earlier attempt may have landed before the larger token
				// replaced it: not stale (which says nothing changed) but unknown.
				return unknown(errors.Join(lastErr, stale))
			}
			return stale
		}
		var curWid [widLen]byte
		if cur != nil {
			curWid = cur.wid
		}
		if lastErr != nil && (rev != sentRev || curWid != sentWid) {
			// The entry changed since an attempt that may have landed
			// (also at the same revision, in a re-created bucket):
			// publishing again could apply it twice, over a later write.
			return unknown(lastErr)
		}
		// Publish, expecting rev. After an ambiguous failure the entry is
		// read again (above) before the same entry is sent with the same
		// expectation, which lands at most once: the entry must still be
		// the one that attempt expected to replace, by its write id as well
		// as its revision, or ours.
		if err := connected(); err != nil {
			return err
		}
		actx, cancel := attemptCtx(ctx, w.js, w.o.Timeout)
		_, err = w.kv.Update(actx, kvKey, data, rev)
		cancel()
		if err == nil {
			return nil
		}
		if ambiguous(err) {
			lastErr, sentRev, sentWid = err, rev, curWid
			if time.Now().After(giveUp) || retryWait(ctx, w.js) != nil {
				return unknown(errors.Join(err, context.Cause(ctx)))
			}
			continue // look again: landed, or the entry it expected
		}
		if !revisionMismatch(err) {
			if lastErr != nil {
				return unknown(errors.Join(lastErr, err))
			}
			return fmt.Errorf("natsfence: %s %q: %w", op, key, err)
		}
		// The entry changed (or an earlier attempt landed): look again.
	}
}

// get returns key's entry and revision; nil and 0 when the key was never
// written. Ambiguous read failures are retried within RetryFor.
func (w *Writer) get(ctx context.Context, op, key, kvKey string) (*entry, uint64, error) {
	giveUp := time.Now().Add(w.o.RetryFor)
	for {
		m, err := lastMsg(ctx, w.js, w.streamName, w.subj+kvKey, w.o.Timeout)
		switch {
		case err == nil && m == nil:
			return nil, 0, nil
		case err == nil && isMarker(m):
			return nil, 0, fmt.Errorf("natsfence: %s %q: %w", op, key, ErrFenceGone)
		case err == nil:
			e, derr := decodeEntry(m.Data)
			if derr != nil {
				return nil, 0, fmt.Errorf("natsfence: %s %q: revision %d: %w", op, key, m.Sequence, derr)
			}
			return &e, m.Sequence, nil
		}
		if !ambiguous(err) || time.Now().After(giveUp) || retryWait(ctx, w.js) != nil {
			return nil, 0, fmt.Errorf("natsfence: %s %q: %w", op, key, errors.Join(err, context.Cause(ctx)))
		}
	}
}

// Read returns the value stored under key and the token that wrote it;
// fence.ErrNotFound for a key never written or deleted, ErrFenceGone for one
// deleted outside the Writer.
func (w *Writer) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	if err := checkKey(ctx, "read", "key", key); err != nil {
		return nil, 0, err
	}
	e, _, err := w.get(ctx, "read", key, EncodeKey(key))
	if err != nil {
		return nil, 0, err
	}
	if e == nil || e.deleted {
		return nil, 0, fence.ErrNotFound
	}
	return e.value, e.token, nil
}
