package natsfence

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// MaxKeyBytes is the longest lock name or protected key, in bytes. A name is
// escaped into a NATS KV key (up to three bytes for one), and the key is part
// of the subject in the client's PUB control line, which the server bounds
// (max_control_line, 4096 bytes by default).
const MaxKeyBytes = 1024

// EncodeKey returns the NATS KV key that holds name. KV keys may only hold
// A-Z a-z 0-9 - _ / = and dots between tokens; EncodeKey keeps the letters,
// digits, '-', '_' and '/' of name as they are and writes every other byte,
// '=' included, as '=' and two upper-case hex digits. The encoding is
// injective (two names never share a key, HAZARDS 4: "a.b", "a=2Eb", "A.b"
// and "a.b " are four keys) and byte-exact: no case folding, no Unicode
// normalisation, invalid UTF-8 kept as bytes.
func EncodeKey(name string) string {
	var b strings.Builder
	b.Grow(len(name))
	const hex = "0123456789ABCDEF"
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '-', c == '_', c == '/':
			b.WriteByte(c)
		default:
			b.WriteByte('=')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&15])
		}
	}
	return b.String()
}

// checkKey refuses a nil context, an empty key or one over MaxKeyBytes, naming arg.
func checkKey(ctx context.Context, op, arg, key string) error {
	if err := fence.CheckContext(op, ctx); err != nil {
		return err
	}
	if key == "" {
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "empty"}
	}
	if len(key) > MaxKeyBytes {
		return &fence.InvalidError{Op: op, Arg: arg, Reason: fmt.Sprintf("%d bytes, over this backend's limit of %d (a NATS subject is bounded by the server's max_control_line)", len(key), MaxKeyBytes)}
	}
	return nil
}

// ambiguous reports whether err from a publish may hide a request the server
// applied: anything but a JetStream API error (a definite answer) or an
// invalid request the client refused to send. A timeout, a closed or
// reconnecting connection, no responders during a leader election all are.
func ambiguous(err error) bool {
	if err == nil {
		return false
	}
	var api *jetstream.APIError
	if errors.As(err, &api) {
		return false
	}
	switch {
	case errors.Is(err, jetstream.ErrInvalidKey), errors.Is(err, nats.ErrMaxPayload),
		errors.Is(err, nats.ErrBadSubject), errors.Is(err, nats.ErrInvalidContext):
		return false
	}
	return true
}

// revisionMismatch reports a compare-and-set that found another revision.
func revisionMismatch(err error) bool {
	return errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch)
}

// attemptCtx bounds one request by timeout within ctx.
func attemptCtx(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, timeout)
}

// retryPause is the wait between two attempts of a request whose outcome was
// ambiguous: long enough not to spin on a closed connection, short next to a
// reconnect or a leader election.
const retryPause = 50 * time.Millisecond

// pause waits d, or returns ctx's error when it ends first.
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// openBucket opens the KV bucket named bucket and its stream.
func openBucket(ctx context.Context, op string, js jetstream.JetStream, bucket string) (jetstream.KeyValue, jetstream.Stream, error) {
	if err := fence.CheckContext(op, ctx); err != nil {
		return nil, nil, err
	}
	if js == nil {
		return nil, nil, &fence.InvalidError{Op: op, Arg: "js", Reason: "nil"}
	}
	if bucket == "" {
		return nil, nil, &fence.InvalidError{Op: op, Arg: "bucket", Reason: "empty"}
	}
	kv, err := js.KeyValue(ctx, bucket)
	if err != nil {
		if errors.Is(err, jetstream.ErrInvalidBucketName) {
			return nil, nil, &fence.InvalidError{Op: op, Arg: "bucket", Reason: fmt.Sprintf("%q: %v", bucket, err)}
		}
		return nil, nil, fmt.Errorf("natsfence: %s: bucket %q: %w", op, bucket, err)
	}
	stream, err := js.Stream(ctx, "KV_"+bucket)
	if err != nil {
		return nil, nil, fmt.Errorf("natsfence: %s: stream of bucket %q: %w", op, bucket, err)
	}
	return kv, stream, nil
}

// lastMsg returns the last message on subj, nil when there is none.
func lastMsg(ctx context.Context, s jetstream.Stream, subj string, timeout time.Duration) (*jetstream.RawStreamMsg, error) {
	actx, cancel := attemptCtx(ctx, timeout)
	defer cancel()
	m, err := s.GetLastMsgForSubject(actx, subj)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, nil
	}
	return m, err
}

// isMarker reports a KV delete or purge marker, or a server limit marker (a
// key whose TTL ran out).
func isMarker(m *jetstream.RawStreamMsg) bool {
	return m.Header.Get("KV-Operation") != "" || m.Header.Get(jetstream.MarkerReasonHeader) != ""
}
