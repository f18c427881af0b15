package natsfence

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// IdempotencyOptions configures an IdempotencyStore. A nil *IdempotencyOptions
// means the defaults.
type IdempotencyOptions struct {
	// Timeout bounds each request to the server: at least MinTimeout.
	// Default: 2s.
	Timeout time.Duration
	// RetryFor bounds how long a request whose reply was lost (a timeout, a
	// dropped connection, a leader election) is retried before the step
	// returns an error matching fence.ErrUnknown. Default: 10s.
	RetryFor time.Duration
}

// IdempotencyStore is an idempotency.Store on a NATS JetStream key-value
// bucket: one entry per key (the KV key is EncodeKey(key)), each step one
// compare-and-set on the entry's revision, decided on the server's clock.
//
// # Clock
//
// Leases, retentions and in-progress times count from the server's timestamp
// of the message that set them (the stream leader's clock when it stored
// it), and are compared with the server's time read from a stream info
// request (the leader's clock again). A claim of a key without a record, or
// over a released or expired one, gets the fence max(the previous fence + 1,
// the server's timestamp of the claim in microseconds). So a key whose record
// was removed (Purge, a kv del or kv purge, or the bucket deleted and made
// again) starts above every fence it had, as long as the server's clock (on
// a cluster: the clocks of the nodes that lead the stream) does not step back
// by more than the time since that fence was granted.
//
// Leases are wall-clock differences, so at most once also assumes the
// clock does not jump forward: a lease ends early at the store
// by as much as the leader's clock steps forward while it runs, or as a new
// leader's clock runs ahead of the old one's after a leader change, while
// the owner's effect is cancelled only at its local deadline (the lease less
// 1% + 2ms, on the owner's monotonic clock). A jump larger than that margin
// lets a waiting Do take the key over, and run the effect again, while the
// owner's effect still runs. Keep the nodes' clocks slewed (NTP), not
// stepped, and their skew well under 1% of the shortest lease.
//
// # Lost replies
//
// Every entry carries a random write id. A step whose reply was lost is
// recognised when it landed, and otherwise, when the key still holds the
// record it expected to replace (the same revision and write id: a bucket
// deleted and re-created numbers its revisions from 1 again), sent again
// expecting the same revision, which can land at most once. A claim sent
// over a purge or delete marker (no record) is also sent again when the
// key holds no record still, with nothing or another marker in its place:
// the first claim expects the old marker's revision, which the key never
// holds again, so it cannot land any more. When that does
// not settle within RetryFor, or the record changed meanwhile, the step
// returns an error matching fence.ErrUnknown (read the record to know). So
// does a claim whose revision, read back for its fence, holds another
// message: the bucket was re-created after the claim. A step is published
// only while the client is connected, so that the client's reconnect buffer
// cannot send it after the step returned; a connection that breaks while the
// step is still in its write buffer can deliver it after the reconnect, and
// a read then may not yet show it.
//
// # What it cannot keep
//
// A record removed by hand while armed (kv del, kv purge, the bucket deleted)
// takes with it the fact that its effect may have run: a later Do runs the
// effect again. NewIdempotencyStore refuses a bucket whose entries expire (a
// bucket TTL) or drop out at a limit (discard old) for that reason.
//
// A bucket restored from a backup (a stream restore keeps the messages'
// timestamps) brings back records as they were: a completed key completed
// after the backup runs again, and a claimed or armed one that a later Do
// takes over gets the old fence + 1 (idempotency.Do's takeover), which can
// be below fences handed out after the backup. Restore only a
// bucket that no caller used after the backup was taken.
type IdempotencyStore struct {
	js         jetstream.JetStream
	kv         jetstream.KeyValue
	stream     jetstream.Stream
	streamName string
	subj       string
	marker     time.Duration // the bucket's marker TTL, 0 without markers
	o          IdempotencyOptions
}

var _ idempotency.Store = (*IdempotencyStore)(nil)

// NewIdempotencyStore returns an IdempotencyStore on the existing KV bucket
// named bucket of js (History 1 is enough; a bucket made with LockBucket also
// lets Purge's markers age out). Give it a bucket of its own: a lock name or a
// Writer's key equal to a record's key would share its entry (Begin and Update
// then fail on it, and an Acquirer reports the name held). It returns an error
// matching fence.ErrInvalid for a nil js, an empty or invalid bucket name, a
// negative option or a Timeout under MinTimeout, a bucket whose entries expire
// (a bucket TTL would remove armed records) or that drops its oldest entries at
// a message or byte limit (discard old), or a mirror or a bucket with sources.
// A missing bucket returns an error matching jetstream.ErrBucketNotFound.
func NewIdempotencyStore(ctx context.Context, js jetstream.JetStream, bucket string, opts *IdempotencyOptions) (*IdempotencyStore, error) {
	const op = "new idempotency store"
	// The same two options, the same defaults, as a Writer's.
	var wo *WriterOptions
	if opts != nil {
		wo = (*WriterOptions)(opts)
	}
	w, err := wo.withDefaults(op)
	if err != nil {
		return nil, err
	}
	o := IdempotencyOptions(w)
	kv, stream, err := openBucket(ctx, op, js, bucket)
	if err != nil {
		return nil, err
	}
	cfg := stream.CachedInfo().Config
	if cfg.MaxAge != 0 {
		return nil, &fence.InvalidError{Op: op, Arg: "bucket", Reason: fmt.Sprintf("%q expires its entries after %v, which would remove armed records (and their effect would run again): use a bucket without TTL", bucket, cfg.MaxAge)}
	}
	s := &IdempotencyStore{js: js, kv: kv, stream: stream, streamName: "KV_" + bucket, subj: "$KV." + bucket + ".", o: o}
	if cfg.AllowMsgTTL && cfg.SubjectDeleteMarkerTTL > 0 {
		s.marker = cfg.SubjectDeleteMarkerTTL
	}
	return s, nil
}

// idemEntry is a record as stored. Times count from the message's own server
// timestamp; a zero Fence or Start means "from this message's timestamp".
type idemEntry struct {
	Version     int           `json:"v"`
	Fingerprint string        `json:"fp"`
	State       string        `json:"st"`
	From        string        `json:"from,omitempty"` // the state an Update changed, for operators
	Fence       uint64        `json:"f,omitempty"`    // 0: max(Floor, timestamp in µs)
	Floor       uint64        `json:"fl,omitempty"`   // the fence a fresh claim must exceed, + 1
	Owner       string        `json:"o"`
	Lease       time.Duration `json:"l"`             // from the timestamp
	Start       int64         `json:"s,omitempty"`   // unix ns; 0: the timestamp
	Retention   time.Duration `json:"r,omitempty"`   // from the timestamp; 0: kept
	Result      []byte        `json:"res,omitempty"` // nil stays nil
	HasResult   bool          `json:"hr,omitempty"`
	Dropped     bool          `json:"d,omitempty"`
	WriteID     string        `json:"w"`
	resolved    resolvedEntry
}

// resolvedEntry is an entry's absolute values, from its message's timestamp.
type resolvedEntry struct {
	fence fence.Token
	start time.Time
	at    time.Time // the message's timestamp
}

const idemVersion = 1

// errNotRecord is an entry that the IdempotencyStore did not write.
var errNotRecord = errors.New("not a record written by natsfence")

// decodeIdem reads the entry of message m; nil for none or a marker.
func decodeIdem(key string, m *storedMsg) (*idemEntry, error) {
	if m == nil || isMarker(m) {
		return nil, nil
	}
	var e idemEntry
	if err := json.Unmarshal(m.Data, &e); err != nil || e.Version != idemVersion {
		return nil, fmt.Errorf("natsfence: idempotency record %q at revision %d: %w", key, m.Sequence, errNotRecord)
	}
	if !e.HasResult {
		e.Result = nil
	} else if e.Result == nil {
		e.Result = []byte{}
	}
	e.resolved.at = m.Time
	e.resolved.fence = fence.Token(e.Fence)
	if e.Fence == 0 {
		e.resolved.fence = fence.Token(max(e.Floor, uint64(m.Time.UnixMicro())))
	}
	e.resolved.start = m.Time
	if e.Start != 0 {
		e.resolved.start = time.Unix(0, e.Start)
	}
	return &e, nil
}

// since is how long after t the server's now is, never negative (two nodes'
// clocks may differ by a little).
func since(now, t time.Time) time.Duration {
	return max(now.Sub(t), 0)
}

// record is e as a Record, as of the server's time now.
func (e *idemEntry) record(key string, now time.Time) idempotency.Record {
	el := since(now, e.resolved.at)
	r := idempotency.Record{
		Key: key, Fingerprint: e.Fingerprint, State: idempotency.State(e.State), Fence: e.resolved.fence, Owner: e.Owner,
		LeaseLeft: e.Lease - el, InProgressFor: since(now, e.resolved.start), ResultDropped: e.Dropped,
	}
	if e.Result != nil {
		r.Result = append([]byte{}, e.Result...)
	}
	return r
}

// claimable reports a record that Begin may claim anew at now: released, or
// completed or failed past its retention.
func (e *idemEntry) claimable(now time.Time) bool {
	switch idempotency.State(e.State) {
	case idempotency.Released:
		return true
	case idempotency.Completed, idempotency.Failed:
		return e.Retention > 0 && since(now, e.resolved.at) >= e.Retention
	}
	return false
}

func newWriteID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]), nil
}

// last returns key's entry and its message (nil for none or a marker),
// retrying ambiguous failures within RetryFor.
func (s *IdempotencyStore) last(ctx context.Context, key, kvKey string) (*idemEntry, *storedMsg, error) {
	giveUp := time.Now().Add(s.o.RetryFor)
	for {
		m, err := lastMsg(ctx, s.js, s.streamName, s.subj+kvKey, s.o.Timeout)
		if err == nil {
			e, err := decodeIdem(key, m)
			return e, m, err
		}
		if !ambiguous(err) || time.Now().After(giveUp) || retryWait(ctx, s.js) != nil {
			return nil, nil, errors.Join(err, context.Cause(ctx))
		}
	}
}

// now reads the server's clock (the stream leader's) from a stream info
// reply, retrying ambiguous failures within RetryFor.
func (s *IdempotencyStore) now(ctx context.Context) (time.Time, error) {
	giveUp := time.Now().Add(s.o.RetryFor)
	for {
		actx, cancel := attemptCtx(ctx, s.js, s.o.Timeout)
		info, err := s.stream.Info(actx)
		cancel()
		if err == nil {
			if info.TimeStamp.IsZero() {
				return time.Time{}, errors.New("the server's stream info carries no time stamp (NATS Server 2.10 or later is needed)")
			}
			return info.TimeStamp, nil
		}
		if !ambiguous(err) || time.Now().After(giveUp) || retryWait(ctx, s.js) != nil {
			return time.Time{}, errors.Join(err, context.Cause(ctx))
		}
	}
}

// publish writes e under kvKey expecting revision expect (0: no entry), in
// one request; it returns the new revision.
func (s *IdempotencyStore) publish(ctx context.Context, kvKey string, e *idemEntry, expect uint64) (uint64, error) {
	data, err := json.Marshal(e)
	if err != nil {
		return 0, err
	}
	m := nats.NewMsg(s.subj + kvKey)
	m.Data = data
	actx, cancel := attemptCtx(ctx, s.js, s.o.Timeout)
	defer cancel()
	pa, err := s.js.PublishMsg(actx, m, jetstream.WithExpectLastSequencePerSubject(expect))
	if err != nil {
		if isWrongLastSeq(err) {
			return 0, fmt.Errorf("%w: %w", err, jetstream.ErrKeyRevisionMismatch)
		}
		return 0, err
	}
	return pa.Sequence, nil
}

// put publishes e expecting expect, once, and returns the revision, or the
// error and whether the attempt may have landed (an ambiguous failure). The
// caller reads the record again before it sends the step again: a revision
// names a record only within one bucket (one deleted and re-created numbers
// them from 1 again), so the step is sent again only when the key still
// holds the record it expected to replace, by write id as well as revision.
// It publishes only while the client is connected (see disconnected): a
// late arm would leave armed a key whose effect never ran.
func (s *IdempotencyStore) put(ctx context.Context, kvKey string, e *idemEntry, expect uint64, giveUp time.Time) (uint64, bool, error) {
	for disconnected(s.js) {
		if time.Now().After(giveUp) || retryWait(ctx, s.js) != nil {
			return 0, false, errors.Join(errNotConnected, context.Cause(ctx))
		}
	}
	rev, err := s.publish(ctx, kvKey, e, expect)
	return rev, ambiguous(err), err
}

func (s *IdempotencyStore) checkKey(ctx context.Context, op, key string) error {
	return checkKey(ctx, op, "key", key)
}

// Begin claims key, or returns its record. See idempotency.Store. A claim
// whose reply was lost is recognised when it landed (created, with its
// record), and sent again while that can land at most once (see Lost
// replies in IdempotencyStore); an error matching
// fence.ErrUnknown when that could not be told within RetryFor, or the
// record changed meanwhile. A lease that is not positive is
// fence.ErrInvalid.
func (s *IdempotencyStore) Begin(ctx context.Context, key, fingerprint, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	const op = "idempotency begin"
	if err := s.checkKey(ctx, op, key); err != nil {
		return idempotency.Record{}, false, err
	}
	if lease <= 0 {
		return idempotency.Record{}, false, &fence.InvalidError{Op: op, Arg: "lease", Reason: fmt.Sprintf("%v is not positive", lease)}
	}
	wid, err := newWriteID()
	if err != nil {
		return idempotency.Record{}, false, err
	}
	kvKey := EncodeKey(key)
	giveUp := time.Now().Add(s.o.RetryFor)
	var lastErr error
	// The last claim whose outcome is unknown expected revision sentRev
	// and the record with write id sentWid ("": no record, the key holding
	// nothing or a marker).
	var sentRev uint64
	var sentWid string
	fail := func(err error) (idempotency.Record, bool, error) {
		if lastErr != nil {
			return idempotency.Record{}, false, fmt.Errorf("natsfence: %s %q: %w: %w", op, key, fence.ErrUnknown, errors.Join(lastErr, err))
		}
		return idempotency.Record{}, false, fmt.Errorf("natsfence: %s %q: %w", op, key, err)
	}
	for {
		cur, m, err := s.last(ctx, key, kvKey)
		if err != nil {
			return fail(err)
		}
		if cur != nil && cur.WriteID == wid {
			return cur.record(key, cur.resolved.at), true, nil // an earlier attempt landed
		}
		var expect uint64
		if m != nil {
			expect = m.Sequence
		}
		var curWid string
		if cur != nil {
			curWid = cur.WriteID
		}
		if lastErr != nil && (expect != sentRev || curWid != sentWid) && !noRecordStill(cur, sentWid, sentRev) {
			return fail(errors.New("the record changed after a claim that may have landed"))
		}
		next := &idemEntry{Version: idemVersion, Fingerprint: fingerprint, State: string(idempotency.Claimed), Owner: owner, Lease: lease, WriteID: wid}
		if cur != nil {
			now, err := s.now(ctx)
			if err != nil {
				return fail(err)
			}
			if !cur.claimable(now) {
				return cur.record(key, now), false, nil
			}
			next.Floor = uint64(cur.resolved.fence) + 1
		}
		rev, maybe, err := s.put(ctx, kvKey, next, expect, giveUp)
		if maybe {
			lastErr, sentRev, sentWid = err, expect, curWid
			if time.Now().After(giveUp) || retryWait(ctx, s.js) != nil {
				return fail(errors.Join(err, context.Cause(ctx)))
			}
			continue // look again: landed, or the record it expected
		}
		if err == nil {
			return s.claimed(ctx, op, key, kvKey, wid, rev)
		}
		if !revisionMismatch(err) {
			return fail(err)
		}
		// Changed meanwhile, or an earlier attempt landed: look again.
	}
}

// noRecordStill reports whether a claim may be sent again although the key's
// revision moved on since a claim whose outcome is unknown was sent
// expecting revision sentRev and the record with write id sentWid: the key
// held no record then and holds none now (cur nil), and what it held then
// was a marker (sentRev not 0). A claim decides on records, and a marker
// and nothing are both no record: the claim sent again decides what the
// first one would have. The first one, dropped or still on its way, can no
// longer land: it expects the marker's revision, and the key's last
// revision, once past a revision, never returns to it (the marker aging out
// leaves the key with none, and every later message has a higher one), so
// the server refuses it wherever it arrives. At most one of the two lands.
// Not when the first one expected nothing (sentRev 0): a key holding a
// marker now can hold nothing again once the marker ages out, and that
// claim could then land after all. (A bucket deleted and re-created
// numbers revisions from 1 again: the window the package documentation
// describes.)
func noRecordStill(cur *idemEntry, sentWid string, sentRev uint64) bool {
	return cur == nil && sentWid == "" && sentRev != 0
}

// claimed reads the claim with write id wid stored at rev, for its fence
// (the server's timestamp of the claim). Another message at rev (another
// key's, or another claim's of this key) means the bucket was deleted and
// re-created since the claim: the claim went with it, and the message is not
// this claim.
func (s *IdempotencyStore) claimed(ctx context.Context, op, key, kvKey, wid string, rev uint64) (idempotency.Record, bool, error) {
	giveUp := time.Now().Add(s.o.RetryFor)
	for {
		m, err := seqMsg(ctx, s.js, s.streamName, rev, s.o.Timeout)
		if err == nil && m == nil {
			err = errors.New("replaced before it could be read")
		}
		if err == nil {
			var e *idemEntry
			if m.Subject == s.subj+kvKey {
				e, _ = decodeIdem(key, m)
			}
			if e == nil || e.WriteID != wid {
				return idempotency.Record{}, false, fmt.Errorf("natsfence: %s %q: claimed at revision %d, but the bucket holds another message there (deleted and re-created since the claim): %w", op, key, rev, fence.ErrUnknown)
			}
			return e.record(key, e.resolved.at), true, nil
		}
		if !ambiguous(err) || time.Now().After(giveUp) || retryWait(ctx, s.js) != nil {
			return idempotency.Record{}, false, fmt.Errorf("natsfence: %s %q: claimed at revision %d, but its record could not be read: %w: %w", op, key, rev, fence.ErrUnknown, errors.Join(err, context.Cause(ctx)))
		}
	}
}

// Get returns key's record, or fence.ErrNotFound.
func (s *IdempotencyStore) Get(ctx context.Context, key string) (idempotency.Record, error) {
	const op = "idempotency get"
	if err := s.checkKey(ctx, op, key); err != nil {
		return idempotency.Record{}, err
	}
	cur, _, err := s.last(ctx, key, EncodeKey(key))
	if err != nil {
		return idempotency.Record{}, fmt.Errorf("natsfence: %s %q: %w", op, key, err)
	}
	if cur == nil {
		return idempotency.Record{}, fence.ErrNotFound
	}
	now, err := s.now(ctx)
	if err != nil {
		return idempotency.Record{}, fmt.Errorf("natsfence: %s %q: %w", op, key, err)
	}
	return cur.record(key, now), nil
}

// Update is the compare-and-set on state and fence. See idempotency.Store. A
// change whose reply was lost is recognised when it landed (nil); an error
// matching fence.ErrUnknown when that could not be told within RetryFor or
// the record changed since. The record returned counts its lease and
// in-progress time from the change.
func (s *IdempotencyStore) Update(ctx context.Context, key string, from idempotency.State, fromFence fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	const op = "idempotency update"
	if err := s.checkKey(ctx, op, key); err != nil {
		return idempotency.Record{}, err
	}
	if ch.Lease < 0 || ch.Retention < 0 {
		return idempotency.Record{}, &fence.InvalidError{Op: op, Arg: "change", Reason: "negative lease or retention"}
	}
	wid, err := newWriteID()
	if err != nil {
		return idempotency.Record{}, err
	}
	kvKey := EncodeKey(key)
	giveUp := time.Now().Add(s.o.RetryFor)
	var lastErr error
	var sentRev uint64
	var sentWid string // the write id of the record that attempt expected to replace
	fail := func(err error) (idempotency.Record, error) {
		if lastErr != nil {
			return idempotency.Record{}, fmt.Errorf("natsfence: %s %q: %w: %w", op, key, fence.ErrUnknown, errors.Join(lastErr, err))
		}
		return idempotency.Record{}, err
	}
	for {
		cur, m, err := s.last(ctx, key, kvKey)
		if err != nil {
			return fail(fmt.Errorf("natsfence: %s %q: %w", op, key, err))
		}
		if cur == nil {
			return fail(fence.ErrNotFound)
		}
		if cur.WriteID == wid {
			return cur.record(key, cur.resolved.at), nil // an earlier attempt landed
		}
		if lastErr != nil && (m.Sequence != sentRev || cur.WriteID != sentWid) {
			return fail(errors.New("the record changed after a change that may have landed"))
		}
		if cur.resolved.fence != fromFence {
			return fail(&fence.StaleError{Key: key, Offered: fromFence, Current: cur.resolved.fence})
		}
		if cur.State != string(from) {
			return fail(&idempotency.StateError{Key: key, Want: from, Got: idempotency.State(cur.State)})
		}
		next := &idemEntry{Version: idemVersion, Fingerprint: cur.Fingerprint, State: string(ch.State), From: string(from), Fence: uint64(ch.Fence),
			Owner: ch.Owner, Lease: ch.Lease, Retention: ch.Retention, Dropped: ch.ResultDropped, WriteID: wid}
		if next.Fence == 0 {
			return fail(&fence.InvalidError{Op: op, Arg: "change", Reason: "fence 0"})
		}
		if !ch.Restart {
			next.Start = cur.resolved.start.UnixNano()
		}
		if ch.Result != nil {
			next.Result, next.HasResult = ch.Result, true
		}
		_, maybe, err := s.put(ctx, kvKey, next, m.Sequence, giveUp)
		if maybe {
			lastErr, sentRev, sentWid = err, m.Sequence, cur.WriteID
			if time.Now().After(giveUp) || retryWait(ctx, s.js) != nil {
				return fail(fmt.Errorf("natsfence: %s %q: %w", op, key, errors.Join(err, context.Cause(ctx))))
			}
			continue // look again: landed, or the record it expected
		}
		if err == nil {
			// Counted from the previous message's timestamp: the change's
			// own is not known without another read.
			next.resolved = resolvedEntry{fence: ch.Fence, start: cur.resolved.start, at: cur.resolved.at}
			if ch.Restart {
				next.resolved.start = cur.resolved.at
			}
			return next.record(key, cur.resolved.at), nil
		}
		if !revisionMismatch(err) {
			return fail(fmt.Errorf("natsfence: %s %q: %w", op, key, err))
		}
	}
}

// Purge removes released records and completed or failed ones past their
// retention, each by a purge expecting the revision it read (a record
// claimed meanwhile is kept), and returns how many it removed. Entries it
// did not write are left alone. It lists
// every key of the bucket: run it from one process now and then, not on
// every request.
func (s *IdempotencyStore) Purge(ctx context.Context) (int, error) {
	const op = "idempotency purge"
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return 0, err
	}
	now, err := s.now(ctx)
	if err != nil {
		return 0, fmt.Errorf("natsfence: %s: %w", op, err)
	}
	lister, err := s.kv.ListKeys(ctx)
	if err != nil {
		if errors.Is(err, jetstream.ErrNoKeysFound) {
			return 0, nil
		}
		return 0, fmt.Errorf("natsfence: %s: %w", op, err)
	}
	var keys []string
	for k := range lister.Keys() {
		keys = append(keys, k)
	}
	n := 0
	for _, kvKey := range keys {
		cur, m, err := s.last(ctx, kvKey, kvKey)
		if errors.Is(err, errNotRecord) {
			continue // not the store's: left alone
		}
		if err != nil {
			return n, fmt.Errorf("natsfence: %s: %w", op, err)
		}
		if cur == nil || !cur.claimable(now) {
			continue
		}
		opts := []jetstream.KVDeleteOpt{jetstream.LastRevision(m.Sequence)}
		if s.marker > 0 {
			opts = append(opts, jetstream.PurgeTTL(s.marker))
		}
		actx, cancel := attemptCtx(ctx, s.js, s.o.Timeout)
		err = s.kv.Purge(actx, kvKey, opts...)
		cancel()
		switch {
		case err == nil:
			n++
		case revisionMismatch(err) || isWrongLastSeq(err):
			// claimed or changed meanwhile: kept
		default:
			return n, fmt.Errorf("natsfence: %s: %w", op, err)
		}
	}
	return n, nil
}
