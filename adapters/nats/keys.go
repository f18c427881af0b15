package natsfence

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
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
// injective (two names never share a key: "a.b", "a=2Eb", "A.b"
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
	if err := leasekit.CheckContext(op, ctx); err != nil {
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

// ambiguous reports whether err from a request may hide one the server
// applied: anything but a JetStream API error (a definite answer) or an
// invalid request the client refused to send. A timeout, a closed or
// reconnecting connection, no responders during a leader election all are,
// and so is an API error 503 (the system temporarily unavailable, a stream
// without a leader): a proposal forwarded before an election may still be
// applied after that answer. Each caller waits it out within RetryFor, as a
// lost reply, and reports fence.ErrUnknown, never a definite failure, when
// a write may have landed.
func ambiguous(err error) bool {
	if err == nil {
		return false
	}
	var api *jetstream.APIError
	if errors.As(err, &api) {
		return api.Code == 503
	}
	switch {
	case errors.Is(err, jetstream.ErrInvalidKey), errors.Is(err, nats.ErrMaxPayload),
		errors.Is(err, nats.ErrBadSubject), errors.Is(err, nats.ErrInvalidContext):
		return false
	}
	return true
}

// errNotConnected is a request not sent because the client was not connected.
var errNotConnected = errors.New("not connected to the server (not sent)")

// disconnected reports a client that is not connected now. A write is not
// published then: the nats client keeps what is published while it
// reconnects and sends it after the reconnect, however late, so a write that
// returned fence.ErrUnknown, and that a read then showed had not landed,
// could land after all. A publish still in the write buffer of a
// connection that breaks after this check can be sent late all the same.
func disconnected(js jetstream.JetStream) bool {
	nc := js.Conn()
	return nc != nil && !nc.IsConnected()
}

// revisionMismatch reports a compare-and-set that found another revision.
func revisionMismatch(err error) bool {
	return errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch)
}

// attemptCtx bounds one request on js's connection by timeout within ctx,
// and ends it when that connection breaks (errConnBroken). The nats client
// does not fail a request whose connection broke: its reply, lost with the
// connection, would otherwise be awaited for the whole timeout, while a new
// connection is usually up within milliseconds. A request ended so is
// ambiguous (it may have been applied before the break) and is handled as
// any lost reply is.
func attemptCtx(ctx context.Context, js jetstream.JetStream, timeout time.Duration) (context.Context, context.CancelFunc) {
	actx, cancel := context.WithTimeout(ctx, timeout)
	nc := js.Conn()
	if nc == nil {
		return actx, cancel
	}
	bctx, bcancel := context.WithCancelCause(actx)
	stop := context.AfterFunc(breaksOf(nc).current(), func() { bcancel(errConnBroken) })
	return bctx, func() {
		stop()
		bcancel(context.Canceled)
		cancel()
	}
}

// errConnBroken ends a request whose connection broke before its reply came.
var errConnBroken = errors.New("natsfence: the connection broke before the reply came (the request may have been applied)")

// connBreaks holds, per client connection, a context that ends at the
// connection's next break (disconnected, reconnecting or closed), and a
// fresh one after each break.
type connBreaks struct {
	last   atomic.Int64 // when the last break was seen, in Unix ns
	mu     sync.Mutex
	cur    context.Context
	cancel context.CancelFunc
}

// breaks maps a *nats.Conn to its *connBreaks. An entry and the goroutine
// that serves it go when the connection is closed.
var breaks sync.Map

func (b *connBreaks) current() context.Context {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cur
}

// breaksOf returns nc's connBreaks, watching nc's status from the first call.
func breaksOf(nc *nats.Conn) *connBreaks {
	if v, ok := breaks.Load(nc); ok {
		return v.(*connBreaks)
	}
	b := &connBreaks{}
	b.cur, b.cancel = context.WithCancel(context.Background())
	if v, loaded := breaks.LoadOrStore(nc, b); loaded {
		b.cancel()
		return v.(*connBreaks)
	}
	ch := nc.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	if nc.IsClosed() {
		// Closed before the listener was in place: it may never hear it.
		nc.RemoveStatusListener(ch)
	}
	go func() {
		for s := range ch {
			b.last.Store(time.Now().UnixNano())
			b.mu.Lock()
			b.cancel()
			b.cur, b.cancel = context.WithCancel(context.Background())
			b.mu.Unlock()
			if s == nats.CLOSED {
				nc.RemoveStatusListener(ch)
			}
		}
		b.mu.Lock()
		b.cancel()
		b.mu.Unlock()
		breaks.Delete(nc)
	}()
	return b
}

// retryPause is the wait between two attempts of a request whose outcome was
// ambiguous: long enough not to spin on a closed connection, short next to a
// reconnect or a leader election.
const retryPause = 50 * time.Millisecond

// retryWait waits before the next attempt of a request on js's connection
// whose outcome was ambiguous: retryPause, or, when the connection broke
// within the last retryPause (the attempt most likely ended at the break),
// only until it is connected again (at most retryPause). It returns ctx's
// error when ctx ends first.
func retryWait(ctx context.Context, js jetstream.JetStream) error {
	nc := js.Conn()
	if nc != nil && nc.IsClosed() {
		return nats.ErrConnectionClosed // nothing more can be learned
	}
	if nc == nil || time.Since(time.Unix(0, breaksOf(nc).last.Load())) > retryPause {
		return pause(ctx, retryPause)
	}
	for giveUp := time.Now().Add(retryPause); !nc.IsConnected() && time.Now().Before(giveUp); {
		if err := pause(ctx, time.Millisecond); err != nil {
			return err
		}
	}
	return ctx.Err()
}

// retryWaitUntil is retryWait, or an error naming the retry time's end
// when giveUp has passed.
func retryWaitUntil(ctx context.Context, js jetstream.JetStream, giveUp time.Time) error {
	if time.Now().After(giveUp) {
		if err := context.Cause(ctx); err != nil {
			return err
		}
		return errRetryFor
	}
	if err := retryWait(ctx, js); err != nil {
		if cause := context.Cause(ctx); cause != nil {
			return cause
		}
		return err
	}
	return nil
}

var errRetryFor = errors.New("natsfence: no answer within RetryFor")

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
	if err := leasekit.CheckContext(op, ctx); err != nil {
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
	if cfg := stream.CachedInfo().Config; cfg.Mirror != nil || len(cfg.Sources) > 0 {
		// A mirror keeps its entries under the origin's subjects, where
		// the bucket's own reads never see them; sources write over the
		// bucket's keys from elsewhere. Either would lose fences and leases.
		return nil, nil, &fence.InvalidError{Op: op, Arg: "bucket", Reason: fmt.Sprintf("%q mirrors or sources other buckets: use a bucket of its own", bucket)}
	}
	if cfg := stream.CachedInfo().Config; cfg.Discard == jetstream.DiscardOld && (cfg.MaxMsgs > 0 || cfg.MaxBytes > 0) {
		// Full, it would drop its oldest entries: fences, leases and
		// idempotency records gone as with a TTL.
		return nil, nil, &fence.InvalidError{Op: op, Arg: "bucket", Reason: fmt.Sprintf("%q drops its oldest entries when it reaches its message or byte limit (discard old): use discard new, or no limit", bucket)}
	}
	return kv, stream, nil
}

// storedMsg is the last message on a subject, as the stream leader holds it.
type storedMsg struct {
	Subject  string    `json:"subject"`
	Sequence uint64    `json:"seq"`
	Header   []byte    `json:"hdrs"`
	Data     []byte    `json:"data"`
	Time     time.Time `json:"time"`
}

// lastMsg returns the last message on subj, nil when there is none. It asks
// the stream leader (STREAM.MSG.GET), not a direct get, which any replica may
// answer from behind: a lagging replica would show a released lock as held or
// an old fence as current.
func lastMsg(ctx context.Context, js jetstream.JetStream, stream, subj string, timeout time.Duration) (*storedMsg, error) {
	return getMsg(ctx, js, stream, map[string]any{"last_by_subj": subj}, timeout)
}

// seqMsg returns the message at sequence seq from the stream leader, nil when
// there is none (never stored, or replaced since).
func seqMsg(ctx context.Context, js jetstream.JetStream, stream string, seq uint64, timeout time.Duration) (*storedMsg, error) {
	return getMsg(ctx, js, stream, map[string]any{"seq": seq}, timeout)
}

// getMsg sends one STREAM.MSG.GET request to the stream leader.
func getMsg(ctx context.Context, js jetstream.JetStream, stream string, request map[string]any, timeout time.Duration) (*storedMsg, error) {
	actx, cancel := attemptCtx(ctx, js, timeout)
	defer cancel()
	req, _ := json.Marshal(request)
	resp, err := js.Conn().RequestWithContext(actx, "$JS.API.STREAM.MSG.GET."+stream, req)
	if err != nil {
		return nil, err
	}
	var r struct {
		Message *storedMsg `json:"message"`
		Error   *struct {
			Code        int    `json:"code"`
			ErrCode     uint16 `json:"err_code"`
			Description string `json:"description"`
		} `json:"error"`
	}
	if err := json.Unmarshal(resp.Data, &r); err != nil {
		return nil, fmt.Errorf("message get reply: %w", err)
	}
	if r.Error != nil {
		if r.Error.ErrCode == uint16(jetstream.JSErrCodeMessageNotFound) {
			return nil, nil
		}
		return nil, &jetstream.APIError{Code: r.Error.Code, ErrorCode: jetstream.ErrorCode(r.Error.ErrCode), Description: r.Error.Description}
	}
	if r.Message == nil {
		return nil, errors.New("message get reply without a message")
	}
	return r.Message, nil
}

// header returns the value of header name of m, "" when it has none.
func header(m *storedMsg, name string) string {
	for _, line := range strings.Split(string(m.Header), "\r\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok && strings.EqualFold(strings.TrimSpace(k), name) {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// isMarker reports a KV delete or purge marker, or a server limit marker (a
// key whose TTL ran out).
func isMarker(m *storedMsg) bool {
	for _, line := range strings.Split(string(m.Header), "\r\n") {
		name, _, ok := strings.Cut(line, ":")
		if ok && (strings.EqualFold(name, "KV-Operation") || strings.EqualFold(name, jetstream.MarkerReasonHeader)) {
			return true
		}
	}
	return false
}
