package natsfence

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// MinTTL is the shortest lease: the server counts a key's TTL in whole seconds
// (and refuses one under a second). A ttl is rounded up to whole seconds on
// the server; the local deadline keeps the ttl asked for.
const MinTTL = time.Second

// MaxTTL is the longest lease: 100 years.
const MaxTTL = 100 * 365 * 24 * time.Hour

// LockBucket returns the configuration of a lock bucket named name: one entry
// per key, and markers when a key's TTL runs out (kept for a second), which
// wake the waiters. Create it with jetstream.JetStream.CreateOrUpdateKeyValue;
// set Replicas to 3 (or 5) on a cluster.
func LockBucket(name string) jetstream.KeyValueConfig {
	return jetstream.KeyValueConfig{Bucket: name, History: 1, LimitMarkerTTL: time.Second}
}

// AcquirerOptions configures an Acquirer. A nil *AcquirerOptions means the
// defaults.
type AcquirerOptions struct {
	// Drift is taken off each lease's local deadline: below MaxTTL.
	// Default: 1% of the ttl plus 2ms. An acquire with a ttl not above
	// Drift is refused (fence.ErrInvalid).
	Drift time.Duration
	// MaxWait bounds Acquire's wait when ctx has no deadline: at least
	// MinTimeout. Default: 30s.
	MaxWait time.Duration
	// Owner is stored in the lock key's entry, for operators: at most
	// MaxOwnerBytes. Default: host name and process id.
	Owner string
	// Timeout bounds each request to the server: at least MinTimeout,
	// at most MaxTTL. Default: 2s.
	Timeout time.Duration
	// RetryFor bounds how long a request whose reply was lost (a timeout, a
	// dropped connection, a leader election) is retried. Default: 10s.
	RetryFor time.Duration
	// Recheck is how often a waiting Acquire tries again when no watch event
	// woke it (a watch that lost events in a way the client could not see).
	// A break of the connection does not wait for it: the waiter watches
	// anew and tries again once connected. At least MinTimeout. Default: 5s.
	Recheck time.Duration
}

// MaxOwnerBytes is the longest AcquirerOptions.Owner: it travels in every grant
// and renewal, and a message over the server's max_payload would fail each one.
const MaxOwnerBytes = 1024

// Acquirer grants leases from a JetStream KV bucket made with LockBucket. It is
// safe for concurrent use.
//
// A grant creates the lock key EncodeKey(name) if it is absent, with a per-key
// TTL of the lease's ttl rounded up to whole seconds, so the lease expires on
// the server's clock. The create expects the revision of a marker on the key
// (a release's or an expiry's, or one the grant writes first) that the
// server expires within Timeout or LimitMarkerTTL, whichever is longer, so a
// create delivered later than that is refused. Renew republishes the entry
// with a fresh TTL and Release purges it, each after a read of the key finds
// the lease's own entry (its random nonce), expecting that entry's revision;
// neither touches a key another grant owns, also after the bucket was
// deleted and re-created, which restarts the revisions (with the window
// Renew describes).
//
// # Tokens
//
// The token is the bucket stream's creation time in microseconds (on the
// server's clock, read after each grant) plus the grant's revision (the
// stream sequence of the create). A grant during which the creation time
// changed (the bucket deleted and re-created between the create and that
// read) is given back and made again: a revision counts only with the
// creation time of its own bucket. Within one bucket the revision only grows,
// across leader changes and purges, so tokens grow. Deleting and re-creating
// the bucket restarts the revisions at 1 but moves the creation time on; a
// token from the new bucket is larger than every token of the old one as long
// as the old bucket stored fewer messages than the microseconds between the
// two creations (below a million messages per second over its life) and the
// clock of the server creating the new bucket is not behind the old one's by
// more than that margin. Tokens stay below 2^53 until the year 2255.
//
// # Waiting
//
// Waiters watch the lock key and try again when its release or expiry marker
// arrives (and every Recheck without one); they are not served in order
// (not FIFO): every waiter tries at once, and one wins. A waiter whose
// connection breaks, at any point of its wait, watches anew and tries again
// once connected: a marker sent while it was away may be lost with the
// connection (the client's consumer notices the gap only at its next
// heartbeat, 5s on) and lives only LimitMarkerTTL.
type Acquirer struct {
	js         jetstream.JetStream
	kv         jetstream.KeyValue
	stream     jetstream.Stream
	streamName string
	subj       string
	marker     time.Duration
	// reserve is the longest life of a marker a grant's create expects:
	// the bucket's LimitMarkerTTL or Timeout, whichever is longer, in whole
	// seconds. A create held in the network lands within it of its send,
	// or never.
	reserve time.Duration
	o       AcquirerOptions
	// created is the bucket's creation time (Unix µs) last read: a grant
	// compares it, read before its create, with the one read after.
	created atomic.Int64
}

var (
	_ fence.Acquirer  = (*Acquirer)(nil)
	_ fence.Inspector = (*Acquirer)(nil)
)

// NewAcquirer returns an Acquirer on the existing KV bucket named bucket of js.
// It refuses, with an error matching fence.ErrInvalid naming the bucket, one
// without limit markers (LimitMarkerTTL: no per-key TTLs, and an expiry would
// wake no waiter), with a bucket TTL (it would expire a renewed lease early),
// or a mirror or a bucket with sources. It refuses a negative option, a
// Timeout, MaxWait or Recheck under MinTimeout (2 meant as seconds is 2ns,
// which would end every request, wait or pause at once), a Timeout above MaxTTL
// (it sets the life of a grant's marker), a Drift not below MaxTTL and an Owner
// over MaxOwnerBytes, naming the option.
func NewAcquirer(ctx context.Context, js jetstream.JetStream, bucket string, opts *AcquirerOptions) (*Acquirer, error) {
	const op = "new acquirer"
	var o AcquirerOptions
	if opts != nil {
		o = *opts
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"Drift", o.Drift}, {"MaxWait", o.MaxWait}, {"Timeout", o.Timeout}, {"RetryFor", o.RetryFor}, {"Recheck", o.Recheck}} {
		if d.v < 0 {
			return nil, &fence.InvalidError{Op: op, Arg: d.name, Reason: "negative"}
		}
		if d.name != "Drift" && d.name != "RetryFor" && d.v > 0 && d.v < MinTimeout {
			return nil, &fence.InvalidError{Op: op, Arg: d.name, Reason: fmt.Sprintf("%v is under MinTimeout (%v)", d.v, MinTimeout)}
		}
	}
	if o.Timeout > MaxTTL {
		// It sets the life of a grant's marker (in whole seconds): more
		// overflows, and the server refuses every grant's marker.
		return nil, &fence.InvalidError{Op: op, Arg: "Timeout", Reason: fmt.Sprintf("%v is above MaxTTL (%v)", o.Timeout, MaxTTL)}
	}
	if o.Drift >= MaxTTL {
		return nil, &fence.InvalidError{Op: op, Arg: "Drift", Reason: fmt.Sprintf("%v is not below MaxTTL (%v): no ttl would be above it", o.Drift, MaxTTL)}
	}
	if len(o.Owner) > MaxOwnerBytes {
		return nil, &fence.InvalidError{Op: op, Arg: "Owner", Reason: fmt.Sprintf("%d bytes, over MaxOwnerBytes (%d)", len(o.Owner), MaxOwnerBytes)}
	}
	if o.MaxWait == 0 {
		o.MaxWait = fence.DefaultMaxWait
	}
	if o.Timeout == 0 {
		o.Timeout = 2 * time.Second
	}
	if o.RetryFor == 0 {
		o.RetryFor = 10 * time.Second
	}
	if o.Recheck == 0 {
		o.Recheck = 5 * time.Second
	}
	if o.Owner == "" {
		host, _ := os.Hostname()
		o.Owner = fmt.Sprintf("%s/%d", host, os.Getpid())
	}
	kv, stream, err := openBucket(ctx, op, js, bucket)
	if err != nil {
		return nil, err
	}
	cfg := stream.CachedInfo().Config
	if !cfg.AllowMsgTTL || cfg.SubjectDeleteMarkerTTL <= 0 {
		return nil, &fence.InvalidError{Op: op, Arg: "bucket", Reason: fmt.Sprintf("%q has no LimitMarkerTTL: per-key TTLs are off and an expiry would wake no waiter (make it with LockBucket)", bucket)}
	}
	if cfg.MaxAge != 0 {
		return nil, &fence.InvalidError{Op: op, Arg: "bucket", Reason: fmt.Sprintf("%q expires entries after %v, which would end a renewed lease early", bucket, cfg.MaxAge)}
	}
	connBroke(js) // follow the connection's breaks from now on
	a := &Acquirer{js: js, kv: kv, stream: stream, streamName: "KV_" + bucket, subj: "$KV." + bucket + ".", marker: cfg.SubjectDeleteMarkerTTL, o: o}
	a.reserve = time.Duration(leasekit.CeilDiv(max(a.marker, o.Timeout), time.Second)) * time.Second
	a.created.Store(stream.CachedInfo().Created.UnixMicro())
	return a, nil
}

func (a *Acquirer) check(ctx context.Context, name string, ttl time.Duration) error {
	if err := checkKey(ctx, "acquire", "name", name); err != nil {
		return err
	}
	if err := leasekit.CheckTTL("acquire", ttl, MinTTL, MaxTTL); err != nil {
		return err
	}
	if a.o.Drift >= ttl {
		// The lease would be past its local deadline at birth while the
		// server holds the name for the ttl.
		return &fence.InvalidError{Op: "acquire", Arg: "Drift", Reason: fmt.Sprintf("%v is not below the ttl %v", a.o.Drift, ttl)}
	}
	return nil
}

// TryAcquire grants the lease on name for ttl (at least MinTTL), or returns
// fence.ErrHeld at once. Three round trips: the key's read, the create, and
// the bucket's creation time for the token; a fourth, a marker written
// before the create, on a key that holds none (not released or expired
// within the bucket's LimitMarkerTTL). When the create's reply is lost and
// retries within RetryFor cannot tell whether it landed, the error matches
// fence.ErrUnknown; the acquirer then, in the background for up to the
// ttl, removes the entry if it landed or makes sure it cannot land. A
// create lands within Timeout or LimitMarkerTTL, whichever is longer (in
// whole seconds), of its send, or never: it expects a marker the server
// expires by then. So a create held in the network (a partition that
// delivers it later) while that cleanup cannot reach the server holds the
// name at most that long plus the ttl (in whole seconds) after TryAcquire
// returned, plus however late the server expires the marker.
// A grant confirmed only after its local deadline (a slow link) is given
// back (its purge sent again after a lost reply, for up to the ttl) and
// tried again, 3 times at most; then the error matches fence.ErrLost.
func (a *Acquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check(ctx, name, ttl); err != nil {
		return nil, err
	}
	return a.acquire(ctx, name, ttl, nil)
}

// Acquire waits for the lease on name. It gives up at ctx's deadline, or
// after MaxWait when ctx has none, with an error matching fence.ErrHeld and
// the context error. Grants confirmed only after their local deadline are
// given back and tried again, 50ms apart and doubling up to 1s, until then.
func (a *Acquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check(ctx, name, ttl); err != nil {
		return nil, err
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, a.o.MaxWait,
			fmt.Errorf("natsfence: gave up after the maximum wait %v: %w", a.o.MaxWait, context.DeadlineExceeded))
		defer cancel()
	}
	// Watch before the first try, so a release between the try and the
	// watch is not missed. Creating the watch (a consumer) can stall during
	// a leader election: wait for it at most Timeout, then go on with
	// Recheck alone until it arrives (a request unanswered for Timeout is
	// asked again).
	wt := a.watch(ctx, EncodeKey(name))
	defer func() { wt.close() }() // the last one: a break replaces it
	t := time.NewTimer(a.o.Timeout)
	defer t.Stop()
	select {
	case w := <-wt.ready:
		wt.took(w)
	case <-t.C:
	case <-ctx.Done():
		return nil, a.fail(ctx, name, ctx.Err(), true)
	}
	return a.acquire(ctx, name, ttl, &wt)
}

// keyWatch is a waiting Acquire's watch on its lock key, made in the
// background.
type keyWatch struct {
	// broke ends at the first break of the connection after the watch was
	// asked for: events may have been lost with the connection since, and
	// the tries made since may have read the key before a release.
	broke context.Context
	ready chan jetstream.KeyWatcher // the watch once made
	w     jetstream.KeyWatcher      // the watch, once taken from ready
	stop  context.CancelFunc        // ends the watch's creation

	mu     sync.Mutex
	closed bool
}

// watch asks for a watch on key. The connection's breaks are followed from
// before the request, so a break while the consumer is made, or at any time
// after, ends broke.
func (a *Acquirer) watch(ctx context.Context, key string) *keyWatch {
	wt := &keyWatch{broke: connBroke(a.js), ready: make(chan jetstream.KeyWatcher, 1)}
	wctx, stop := context.WithCancel(ctx)
	wt.stop = stop
	go func() {
		// A request that fails (the consumer refused under load, no
		// responders just after a reconnect), or that no answer came to
		// within its time (watchOnce), is asked again: a waiter
		// without its watch would only try every Recheck, and on a busy
		// lock keep finding it held. Each unanswered request gives the
		// next twice the time (Timeout, 2 Timeout, ... up to 32 Timeout),
		// so a server that answers every request, but later than
		// Timeout, still makes the watch.
		var w jetstream.KeyWatcher
		unanswered := 0
		for i := 0; ; i++ {
			var err error
			if h := watchErrHook.Load(); h != nil {
				err = (*h)(key)
			}
			if err == nil {
				w, err = a.watchOnce(wctx, key, a.o.Timeout<<min(unanswered, 5))
				if errors.Is(err, errWatchUnanswered) {
					unanswered++
				}
			}
			if err == nil {
				break
			}
			if (fence.Backoff{Min: 10 * time.Millisecond, Max: time.Second}).Sleep(wctx, i) != nil {
				return // the wait ended
			}
		}
		wt.mu.Lock()
		defer wt.mu.Unlock()
		if wt.closed {
			stopWatch(w) // made after the wait ended: nobody will take it
			return
		}
		wt.ready <- w
	}()
	return wt
}

// errWatchUnanswered is watchOnce's error for a request given up unanswered.
var errWatchUnanswered = errors.New("no answer")

// watchOnce makes one watch request on key, and gives it up when no answer
// came within wait (the caller asks again, with a longer wait).
//
// The client waits for the answer until ctx's deadline, a waiting Acquire's
// whole wait, and a request can go unanswered: one made while the node that
// was the JetStream meta leader stops (the node the request reached hands it
// on to the leader that is gone, and nobody answers it), which left the
// waiter with no watch, trying only every Recheck, after its node, leading
// the meta group, stopped. The watch's subscription lasts as long
// as the ctx it was made with, so the bound is not a deadline on that ctx but
// a cancel that fires only while the request is unanswered; once made, the
// watch ends with ctx (the keyWatch's stop). A request given up may still
// make its consumer on the server; nobody subscribes to it, and the server
// removes it after its inactivity threshold (about 5s).
func (a *Acquirer) watchOnce(ctx context.Context, key string, wait time.Duration) (jetstream.KeyWatcher, error) {
	wctx, cancel := context.WithCancel(ctx)
	cut := time.AfterFunc(wait, cancel)
	w, err := a.kv.Watch(wctx, key)
	if cut.Stop() {
		if err != nil {
			cancel()
		}
		return w, err
	}
	cancel()
	if err == nil {
		stopWatch(w) // made as the time ran out: its ctx is gone
	}
	return nil, fmt.Errorf("natsfence: watch %q: %w within %v", key, errWatchUnanswered, wait)
}

// took records w, taken from ready.
func (wt *keyWatch) took(w jetstream.KeyWatcher) {
	wt.w = w
}

// pending returns ready until the watch was taken, then nil.
func (wt *keyWatch) pending() <-chan jetstream.KeyWatcher {
	if wt.w != nil {
		return nil
	}
	return wt.ready
}

// updates returns the watch's events, nil before it was taken.
func (wt *keyWatch) updates() <-chan jetstream.KeyValueEntry {
	if wt.w == nil {
		return nil
	}
	return wt.w.Updates()
}

// close stops the watch, also one still being made or not yet taken.
func (wt *keyWatch) close() {
	wt.stop()
	wt.mu.Lock()
	wt.closed = true
	select {
	case w := <-wt.ready:
		stopWatch(w)
	default:
	}
	wt.mu.Unlock()
	if wt.w != nil {
		stopWatch(wt.w)
	}
}

// connBroke returns a context that ends at the next break of js's connection
// (none without a connection).
func connBroke(js jetstream.JetStream) context.Context {
	if nc := js.Conn(); nc != nil {
		return breaksOf(nc).current()
	}
	return context.Background()
}

// waitConnected waits until js's connection is connected. It returns
// nats.ErrConnectionClosed for a closed connection, or ctx's error.
func waitConnected(ctx context.Context, js jetstream.JetStream) error {
	nc := js.Conn()
	if nc == nil {
		return nil
	}
	ch := nc.StatusChanged(nats.CONNECTED, nats.CLOSED)
	defer nc.RemoveStatusListener(ch)
	for !nc.IsConnected() {
		if nc.IsClosed() {
			return nats.ErrConnectionClosed
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// stopWatch stops w without waiting: Stop may wait for the server (the
// consumer's removal) for seconds on a bad connection, and a granted lease's
// ttl runs meanwhile.
func stopWatch(w jetstream.KeyWatcher) {
	go func() { _ = w.Stop() }()
}

// ttlSeconds is ttl rounded up to whole seconds, as the server counts it.
func ttlSeconds(ttl time.Duration) string {
	return strconv.FormatInt(leasekit.CeilDiv(ttl, time.Second), 10)
}

// acquire tries, and when wt is set (a waiting Acquire's watch) waits for the
// key's release or expiry marker on the watch, or for the watch to arrive
// when it has not yet, or for the recheck, or for a break of the connection:
// then it waits to be connected again, watches anew (*wt) and tries again.
func (a *Acquirer) acquire(ctx context.Context, name string, ttl time.Duration, wt **keyWatch) (fence.Lease, error) {
	var nb [16]byte
	if _, err := rand.Read(nb[:]); err != nil {
		return nil, err
	}
	value := []byte(hex.EncodeToString(nb[:]) + " " + a.o.Owner)
	key := EncodeKey(name)
	recheck := time.NewTimer(a.o.Recheck)
	defer recheck.Stop()
	drift := a.o.Drift
	if drift <= 0 {
		drift = leasekit.DefaultDrift(ttl)
	}
	late, recreated := 0, 0
	for {
		before := a.created.Load() // read before the create is sent
		sent := time.Now()
		rev, err := a.grant(ctx, key, value, ttl)
		if err == nil {
			l, err := a.lease(ctx, name, key, value, ttl, sent, rev, before)
			if errors.Is(err, errRecreated) && recreated < 3 && ctx.Err() == nil {
				// The create may have landed in the bucket that is gone:
				// its revision does not count in the new one. Give it
				// back (it may be in the new one) and grant afresh.
				recreated++
				gave := make(chan struct{})
				go func(value []byte) {
					defer close(gave)
					a.cleanup(context.WithoutCancel(ctx), key, value, ttl)
				}(value)
				select {
				case <-gave:
				case <-ctx.Done():
				}
				if _, err := rand.Read(nb[:]); err != nil {
					return nil, err
				}
				value = []byte(hex.EncodeToString(nb[:]) + " " + a.o.Owner)
				continue
			}
			if err != nil {
				if errors.Is(err, errRecreated) {
					go a.cleanup(context.WithoutCancel(ctx), key, value, ttl)
				}
				if ctx.Err() != nil {
					return nil, a.fail(ctx, name, err, wt != nil)
				}
				return nil, err
			}
			if time.Since(sent) < ttl-drift {
				return l, nil
			}
			// Confirmed only after its local deadline (lost acks, a slow
			// link): a lease already lost. Give it back and try again.
			l.(*lease).End(fence.ErrLost)
			// The give-back is sent again after a lost reply, for up to
			// the ttl; the next try waits for it (or for ctx), so that
			// it does not find its own entry in the way; what is left of
			// it goes on in the background.
			gave := make(chan struct{})
			go func(value []byte) {
				defer close(gave)
				a.cleanup(context.WithoutCancel(ctx), key, value, ttl)
			}(value)
			// TryAcquire tries 3 times; a waiting Acquire tries on until
			// its context ends, pausing between tries (a grant can be late
			// at once: a Drift close to the ttl), and then gives up as a
			// wait does, at once. The last give-back is waited for too, so
			// that a caller trying again at once does not find the name
			// held by the grant just given back.
			select {
			case <-gave:
			case <-ctx.Done():
			}
			if late++; (late < 3 || wt != nil) && ctx.Err() == nil {
				if wt != nil {
					_ = pause(ctx, latePause(late))
				}
				if ctx.Err() == nil {
					// A new nonce: an entry the give-back missed must
					// not be taken for the next attempt's grant.
					if _, err := rand.Read(nb[:]); err != nil {
						return nil, err
					}
					value = []byte(hex.EncodeToString(nb[:]) + " " + a.o.Owner)
					continue
				}
			}
			lateErr := fmt.Errorf("every grant was confirmed only after its local deadline (a slow or cut connection): %w", fence.ErrLost)
			if wt != nil {
				return nil, a.fail(ctx, name, lateErr, true)
			}
			return nil, fmt.Errorf("natsfence: acquire %q: %w", name, lateErr)
		}
		if errors.Is(err, fence.ErrUnknown) {
			// The create may have landed: remove it once we can tell, so
			// the name is not blocked for the ttl by an entry nobody holds.
			go a.cleanup(context.WithoutCancel(ctx), key, value, ttl)
		}
		if !errors.Is(err, fence.ErrHeld) || wt == nil {
			return nil, a.fail(ctx, name, err, wt != nil)
		}
		w := *wt
		updates := w.updates()
		if h := waitingHook.Load(); h != nil {
			(*h)(key)
		}
		// Wait for a release or expiry marker, or the recheck, or a break.
	wait:
		for {
			select {
			case <-ctx.Done():
				return nil, a.fail(ctx, name, ctx.Err(), true)
			case <-recheck.C:
				recheck.Reset(a.o.Recheck)
				break wait
			case nw := <-w.pending():
				w.took(nw)
				break wait // a release before the watch began is not missed
			case e, ok := <-updates:
				if ok {
					if e != nil && e.Operation() != jetstream.KeyValuePut {
						break wait
					}
					continue
				}
				// The watch ended (the client could not make its
				// consumer again after a gap): watch anew.
			case <-w.broke.Done():
				// The connection broke after the watch was asked for:
				// a release sent meanwhile may be lost with it (the
				// client's consumer notices a gap only at its next
				// heartbeat, and a marker lives one LimitMarkerTTL), or
				// the watch was never made.
			}
			// Watch anew once connected, then try again.
			w.close()
			if err := waitConnected(ctx, a.js); err != nil {
				return nil, a.fail(ctx, name, err, true)
			}
			*wt = a.watch(ctx, key)
			break wait
		}
	}
}

// watchErrHook, set by tests only, makes a watch request fail with the
// error it returns for the key (nil: the request is made).
var watchErrHook atomic.Pointer[func(key string) error]

// createHook, set by tests only, is called with the lock key just before a
// grant's create is sent.
var createHook atomic.Pointer[func(key string)]

// waitingHook, set by tests only, is called with the lock key each time a
// waiting Acquire's try found the name held and it begins to wait.
var waitingHook atomic.Pointer[func(key string)]

// grant creates key with value and a TTL; it returns the create's revision,
// or fence.ErrHeld. A create whose reply was lost is sent again; one that
// landed is recognised by value (its nonce).
//
// The create never expects "no entry", which would stay true for as long as
// nobody writes the key: it expects a marker that lives at most a.reserve,
// and writes one first when the key has none (or one that lives longer), so
// a create held in the network lands within a.reserve of its send, or never.
func (a *Acquirer) grant(ctx context.Context, key string, value []byte, ttl time.Duration) (uint64, error) {
	giveUp := time.Now().Add(a.o.RetryFor)
	var lastErr error
	wrote := false // a create whose outcome is unknown was sent
	for {
		var expect uint64
		m, err := lastMsg(ctx, a.js, a.streamName, a.subj+key, a.o.Timeout)
		if err == nil {
			switch {
			case m != nil && !isMarker(m):
				if string(m.Data) == string(value) {
					return m.Sequence, nil // an earlier attempt landed
				}
				return 0, fence.ErrHeld
			case m != nil && markerLife(m) <= a.reserve:
				expect = m.Sequence
			default:
				var prev uint64
				if m != nil {
					prev = m.Sequence
				}
				expect, err = a.reserveKey(ctx, key, prev)
			}
		}
		if err == nil {
			if h := createHook.Load(); h != nil {
				(*h)(key)
			}
			var rev uint64
			rev, err = a.publish(ctx, key, value, expect, ttl, 0)
			if err == nil {
				return rev, nil
			}
			if ambiguous(err) {
				wrote = true
			}
		}
		if revisionMismatch(err) {
			continue // changed meanwhile: look again
		}
		if !ambiguous(err) {
			return 0, err
		}
		lastErr = err
		if werr := retryWaitUntil(ctx, a.js, giveUp); werr != nil {
			if !wrote {
				// No create was sent (only reads, or a marker, failed):
				// nothing to clean up; as any wait that ran out when
				// ctx ended.
				return 0, errors.Join(lastErr, werr)
			}
			return 0, fmt.Errorf("%w: %w", fence.ErrUnknown, errors.Join(lastErr, werr))
		}
	}
}

// cleanup removes key when it still holds value (a grant of ours that
// returned ErrUnknown), retrying ambiguous failures until it can tell, for at
// most ttl: by then the server has expired the entry anyway.
//
// A create of ours not landed yet (on its way, or not yet stored) expects
// the marker the key holds: cleanup replaces that marker, so it cannot land
// afterwards. At most one create of a grant lands (each expects the revision
// last read, and none expects "no entry"): once it was removed, or another
// grant's entry or no message at all is found, none can land any more.
func (a *Acquirer) cleanup(ctx context.Context, key string, value []byte, ttl time.Duration) {
	ctx, cancel := context.WithTimeout(ctx, ttl)
	defer cancel()
	for {
		m, err := lastMsg(ctx, a.js, a.streamName, a.subj+key, a.o.Timeout)
		if err == nil {
			switch {
			case m == nil || !isMarker(m) && string(m.Data) != string(value):
				return // not ours, and none of ours can land over it
			case isMarker(m):
				_, err = a.reserveKey(ctx, key, m.Sequence)
			default:
				err = a.purge(ctx, key, m.Sequence)
			}
			if err == nil {
				return
			}
			if revisionMismatch(err) {
				continue // look again
			}
		}
		if !ambiguous(err) || retryWait(ctx, a.js) != nil {
			return
		}
	}
}

// reserveKey writes a purge marker on key that lives a.reserve, expecting
// revision prev (0: no message), and returns its revision. A grant's create
// expects it, so that a create held in the network cannot land once it aged
// out; a purge marker's expiry leaves no further marker on the server.
func (a *Acquirer) reserveKey(ctx context.Context, key string, prev uint64) (uint64, error) {
	m := nats.NewMsg(a.subj + key)
	m.Header.Set("KV-Operation", "PURGE")
	m.Header.Set(jetstream.MsgRollup, jetstream.MsgRollupSubject)
	m.Header.Set(jetstream.MsgTTLHeader, ttlSeconds(a.reserve))
	actx, cancel := attemptCtx(ctx, a.js, a.o.Timeout)
	defer cancel()
	pa, err := a.js.PublishMsg(actx, m, jetstream.WithExpectLastSequencePerSubject(prev))
	if err != nil {
		if isWrongLastSeq(err) {
			return 0, fmt.Errorf("%w: %w", err, jetstream.ErrKeyRevisionMismatch)
		}
		return 0, err
	}
	return pa.Sequence, nil
}

// markerLife is how long marker m lives on the server: its TTL header, in
// whole seconds or as a duration; MaxTTL when it has none (it stays until
// the key is written again).
func markerLife(m *storedMsg) time.Duration {
	v := header(m, jetstream.MsgTTLHeader)
	if s, err := strconv.ParseInt(v, 10, 64); err == nil && s > 0 {
		return time.Duration(s) * time.Second
	}
	if d, err := time.ParseDuration(v); err == nil && d > 0 {
		return d
	}
	return MaxTTL
}

// grantHeader names the header of a renewal that holds the revision of the
// grant it renews (the token's part that Inspect needs).
const grantHeader = "Fencekit-Grant-Revision"

// publish writes value to key with a TTL, expecting revision expect (0: no
// entry), in one request; grant is the revision of the grant a renewal
// renews, 0 for a grant.
func (a *Acquirer) publish(ctx context.Context, key string, value []byte, expect uint64, ttl time.Duration, grant uint64) (uint64, error) {
	m := nats.NewMsg(a.subj + key)
	m.Data = value
	m.Header.Set(jetstream.MsgTTLHeader, ttlSeconds(ttl))
	if grant != 0 {
		m.Header.Set(grantHeader, strconv.FormatUint(grant, 10))
	}
	actx, cancel := attemptCtx(ctx, a.js, a.o.Timeout)
	defer cancel()
	pa, err := a.js.PublishMsg(actx, m, jetstream.WithExpectLastSequencePerSubject(expect))
	if err != nil {
		if isWrongLastSeq(err) {
			return 0, fmt.Errorf("%w: %w", err, jetstream.ErrKeyRevisionMismatch)
		}
		return 0, err
	}
	return pa.Sequence, nil
}

func isWrongLastSeq(err error) bool {
	var api *jetstream.APIError
	return errors.As(err, &api) && (api.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequence || api.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant)
}

// errRecreated is a grant during which the bucket was deleted and re-created.
var errRecreated = errors.New("the bucket was deleted and re-created during the grant")

// lease computes the token of a grant at revision rev and returns the lease.
// The bucket's creation time is read after the grant and compared with
// before, the one read before the create was sent: a revision is a token
// only with the creation time of the bucket it was made in, and a bucket
// re-created in between (a new creation time) may hold the grant or not
// (errRecreated).
func (a *Acquirer) lease(ctx context.Context, name, key string, value []byte, ttl time.Duration, sent time.Time, rev uint64, before int64) (fence.Lease, error) {
	var created time.Time
	giveUp := time.Now().Add(a.o.RetryFor)
	for {
		actx, cancel := attemptCtx(ctx, a.js, a.o.Timeout)
		info, err := a.stream.Info(actx)
		cancel()
		if err == nil {
			created = info.Created
			break
		}
		if !ambiguous(err) || time.Now().After(giveUp) || retryWait(ctx, a.js) != nil {
			// Given back in the background (sent again after a lost
			// reply), so that an ending ctx is not held up by it.
			go a.cleanup(context.WithoutCancel(ctx), key, value, ttl)
			return nil, fmt.Errorf("natsfence: acquire %q: the bucket's creation time for the token: %w", name, err)
		}
	}
	if c := created.UnixMicro(); c != before {
		a.created.CompareAndSwap(before, c)
		return nil, fmt.Errorf("natsfence: acquire %q: %w", name, errRecreated)
	}
	tok := fence.Token(uint64(created.UnixMicro()) + rev)
	if created.UnixMicro() <= 0 || !tok.Valid() {
		go a.cleanup(context.WithoutCancel(ctx), key, value, ttl)
		return nil, fmt.Errorf("natsfence: acquire %q: creation time %v, revision %d: %w", name, created, rev, fence.ErrTokensExhausted)
	}
	return &lease{Base: leasekit.New(name, tok, ttl, a.o.Drift, sent), a: a, key: key, value: value, rev: rev, grant: rev}, nil
}

// purge removes key if it is still at rev, leaving a marker that wakes the
// waiters and ages out.
func (a *Acquirer) purge(ctx context.Context, key string, rev uint64) error {
	actx, cancel := attemptCtx(ctx, a.js, a.o.Timeout)
	defer cancel()
	return a.kv.Purge(actx, key, jetstream.LastRevision(rev), jetstream.PurgeTTL(a.marker))
}

// latePause spaces a waiting Acquire's tries after its late-th grant
// confirmed past its local deadline: 50ms, doubling, at most 1s (no jitter:
// these are not contenders to tell apart, but a link too slow for the ttl).
func latePause(late int) time.Duration {
	return min(time.Second, 50*time.Millisecond<<min(late-1, 5))
}

// fail wraps err; an ending ctx turns it into ErrHeld joined with the cause.
// A grant whose outcome is unknown (ErrUnknown) stays so for TryAcquire;
// for a waiting Acquire (waiting) whose ctx ended it is joined with ErrHeld
// and the cause, as any wait that gives up.
func (a *Acquirer) fail(ctx context.Context, name string, err error, waiting bool) error {
	if errors.Is(err, fence.ErrHeld) && ctx.Err() == nil {
		return err
	}
	if errors.Is(err, fence.ErrUnknown) {
		err = fmt.Errorf("natsfence: acquire %q: %w", name, err)
		if waiting && ctx.Err() != nil {
			// Given up at the context's end, as any wait does; the last
			// grant's outcome is unknown (its entry is removed in the
			// background once it can tell).
			return errors.Join(fence.ErrHeld, context.Cause(ctx), err)
		}
		return err
	}
	if ctx.Err() != nil {
		return errors.Join(fence.ErrHeld, context.Cause(ctx))
	}
	return fmt.Errorf("natsfence: acquire %q: %w", name, err)
}

type lease struct {
	*leasekit.Base
	a     *Acquirer
	key   string
	value []byte
	grant uint64 // the grant's revision

	mu  sync.Mutex // serialises Renew and Release
	rev uint64     // the revision the lease last wrote
	// unsure is the send of the earliest renewal since rev whose outcome is
	// unknown (zero: none): a later renewal that finds its entry counts the
	// deadline from it, as the server counts the entry's TTL from its
	// landing. Every such renewal expects rev, so at most one of them lands.
	unsure time.Time
}

// Renew republishes the lock key with a fresh TTL. It first reads the key at
// the stream leader and goes on only when the key holds the lease's own entry
// (its random nonce), then publishes expecting that entry's revision. The
// read is what ties the step to the lease's own grant: a revision is a
// stream sequence, and a bucket deleted and re-created starts them again at
// 1, so the lease's revision alone may name another grant's entry, or a
// marker, in the new bucket. fence.ErrLost when the key expired, holds
// another grant's entry or a marker, or the bucket is gone, or when the
// local deadline has passed, also while the read was answered (no renewal
// is sent then); an error matching fence.ErrUnknown when retries within
// RetryFor could not tell whether the renewal landed.
//
// A renewal that lands after the local deadline (confirmed late, or sent
// before it with its outcome unknown when the deadline passed, in this call
// or an earlier one) holds the name for a fresh ttl that nobody holds:
// Renew gives it back, purging the lease's own entry expecting its
// revision, and returns fence.ErrLost. The give-back is sent again after a
// lost reply, in the background, for up to the ttl; Renew waits for it at
// most twice Timeout, and not past the end of ctx (the give-back goes on
// without it). When it cannot reach the server for that long, the renewal's
// entry holds the name until the server expires it: at most the ttl,
// rounded up to whole seconds, after it landed.
//
// A renewal that finds the entry of an earlier one whose outcome it did not
// know (one that returned ErrUnknown, or an earlier attempt of the same
// call) takes that entry as confirmed, counting the local deadline from the
// earliest send that may have written it (the server counts the entry's TTL
// from its landing), and then renews from it as from any entry of its own:
// a nil error always means a renewal sent by this call was confirmed, and
// the local deadline then counts from that renewal's send.
//
// The read and the publish are two requests: JetStream conditions a publish
// on a subject's last sequence, not on the stream's identity or the entry's
// content. A bucket deleted, re-created and granted to another up to the
// lease's revision between the leader's answer to the read and its receipt
// of the publish (a round trip, plus any pause of the holder between the
// two) is not seen.
func (l *lease) Renew(ctx context.Context) error {
	if err := leasekit.CheckContext("renew", ctx); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.Context().Err() != nil {
		return l.pastDeadline(ctx)
	}
	giveUp := time.Now().Add(l.a.o.RetryFor)
	var lastErr error
	for {
		cur, ours, err := l.own(ctx)
		if err == nil {
			if !ours {
				// Expired, taken, or the bucket deleted (and
				// perhaps re-created): not this grant's entry. A
				// renewal still on its way expects one of ours, and
				// cannot land.
				l.End(fence.ErrLost)
				l.unsure = time.Time{}
				return l.lost()
			}
			if cur != l.rev {
				// Written by a renewal whose outcome was unknown, of
				// this call or an earlier one: it counts from the
				// earliest send that may have written it. Then renew
				// from it: it may be most of a ttl old.
				from := l.unsure
				l.rev, l.unsure = cur, time.Time{}
				if !l.confirmed(from) {
					return l.undo(ctx)
				}
			}
			if l.Context().Err() != nil {
				// The local deadline passed while the read was
				// answered: send nothing.
				return l.pastDeadline(ctx)
			}
			sent := time.Now()
			var rev uint64
			rev, err = l.a.publish(ctx, l.key, l.value, cur, l.TTL(), l.grant)
			if err == nil {
				// It expected cur: no earlier renewal landed, nor can now.
				l.rev, l.unsure = rev, time.Time{}
				if !l.Extend(sent) {
					return l.undo(ctx)
				}
				return nil
			}
			if revisionMismatch(err) {
				continue // changed since the read: look again
			}
			if ambiguous(err) && l.unsure.IsZero() {
				l.unsure = sent
			}
		}
		if !ambiguous(err) {
			return fmt.Errorf("natsfence: renew %q: %w", l.Name(), err)
		}
		lastErr = err
		if l.Context().Err() != nil {
			return l.pastDeadline(ctx)
		}
		if time.Now().After(giveUp) || retryWait(ctx, l.a.js) != nil {
			return fmt.Errorf("natsfence: renew %q: %w: %w", l.Name(), fence.ErrUnknown, errors.Join(lastErr, context.Cause(ctx)))
		}
	}
}

// confirmed moves the local deadline after an entry of the lease, written
// by a renewal whose earliest possible send was from, was found on the key
// (a zero from: none is known, and the deadline stays). It returns false
// when the lease had already ended locally.
func (l *lease) confirmed(from time.Time) bool {
	if from.IsZero() {
		return l.Context().Err() == nil
	}
	return l.Extend(from)
}

// own reads the lock key at the stream leader and returns the revision of
// the lease's entry, and whether the key holds it: the last message on the
// key carries the lease's nonce. Another grant's entry, a marker, no message
// or no bucket is not the lease's.
func (l *lease) own(ctx context.Context) (uint64, bool, error) {
	m, err := lastMsg(ctx, l.a.js, l.a.streamName, l.a.subj+l.key, l.a.o.Timeout)
	if err != nil {
		var api *jetstream.APIError
		if errors.As(err, &api) && api.ErrorCode == jetstream.JSErrCodeStreamNotFound {
			return 0, false, nil // the bucket was deleted
		}
		return 0, false, err
	}
	if m == nil || isMarker(m) || string(m.Data) != string(l.value) {
		return 0, false, nil
	}
	return m.Sequence, true, nil
}

// Release ends the lease's context, then purges the lock key, which wakes
// the waiters. Like Renew, it first reads the key at the stream leader and
// purges only the lease's own entry (its nonce), expecting that entry's
// revision, so a release after the bucket was deleted and re-created does
// not purge another grant's entry at the same revision (with the window
// Renew describes). fence.ErrLost when the key had expired, holds another
// grant's entry or a marker, or the bucket is gone. After a lost reply it is
// sent again, and a key found gone or granted to another then counts as
// released (nil): the purge may have landed and woken the grant.
func (l *lease) Release(ctx context.Context) error {
	if err := leasekit.CheckContext("release", ctx); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.End(context.Canceled)
	giveUp := time.Now().Add(l.a.o.RetryFor)
	var lastErr error
	purged := false // a purge whose outcome is unknown was sent
	for {
		cur, ours, err := l.own(ctx)
		if err == nil {
			if !ours {
				l.unsure = time.Time{} // no renewal of ours can land now
				if purged {
					// Gone or granted again: ours landed (and a
					// waiter was woken by it), or it expired.
					return nil
				}
				return l.lost()
			}
			l.rev = cur // a renewal we could not confirm may have landed
			err = l.a.purge(ctx, l.key, cur)
			if err == nil {
				l.unsure = time.Time{} // no renewal of ours can land now
				return nil
			}
			if revisionMismatch(err) {
				continue // changed since the read: look again
			}
			if ambiguous(err) {
				purged = true
			}
		}
		if !ambiguous(err) {
			return fmt.Errorf("natsfence: release %q: %w", l.Name(), err)
		}
		lastErr = err
		if time.Now().After(giveUp) || retryWait(ctx, l.a.js) != nil {
			return fmt.Errorf("natsfence: release %q: %w: %w", l.Name(), fence.ErrUnknown, errors.Join(lastErr, context.Cause(ctx)))
		}
	}
}

// pastDeadline reports the lease lost once its local deadline has passed.
// A renewal whose outcome is unknown (l.unsure) may have landed, or land
// still, after that deadline, holding the name for a fresh ttl that nobody
// holds: it is given back (undo).
func (l *lease) pastDeadline(ctx context.Context) error {
	if !l.unsure.IsZero() {
		return l.undo(ctx)
	}
	return l.lost()
}

// undo gives back a renewal that landed, or may land, after the local
// deadline had passed (nobody holds the name it keeps for a fresh ttl), and
// reports the lease lost. The give-back purges the key when it holds the
// lease's entry (its nonce), expecting that entry's revision: that also
// keeps a renewal still on its way, which expects an earlier revision of the
// lease's, from landing after it. It is sent again after a lost reply, in the
// background, for up to the ttl (see giveBack); undo waits for it at most
// twice Timeout (a read and a purge), or until ctx ends: the give-back does
// not end with ctx, so the caller is not held up and the name is not left
// held.
func (l *lease) undo(ctx context.Context) error {
	l.End(fence.ErrLost)
	l.unsure = time.Time{} // the give-back settles it
	done := make(chan struct{})
	gctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), l.TTL())
	go func() {
		defer close(done)
		defer cancel()
		l.a.giveBack(gctx, l.key, l.value)
	}()
	t := time.NewTimer(2 * l.a.o.Timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	case <-ctx.Done():
	}
	return l.lost()
}

// giveBack purges key while it holds value (a lease's nonce), expecting the
// revision read, until it no longer does: each request bounded by Timeout,
// a lost reply looked at again, until ctx ends. A key holding anything else
// (nothing, a marker, another grant's entry) or no bucket is left alone.
func (a *Acquirer) giveBack(ctx context.Context, key string, value []byte) {
	for {
		m, err := lastMsg(ctx, a.js, a.streamName, a.subj+key, a.o.Timeout)
		if err == nil {
			if m == nil || isMarker(m) || string(m.Data) != string(value) {
				return
			}
			err = a.purge(ctx, key, m.Sequence)
			if err == nil {
				return
			}
			if revisionMismatch(err) {
				continue // changed since the read: look again
			}
		}
		if !ambiguous(err) || retryWait(ctx, a.js) != nil {
			return
		}
	}
}

func (l *lease) lost() error {
	return fmt.Errorf("natsfence: lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}

// Inspect returns the lock on name as the stream leader holds it: whether a
// lease is live on the server's clock, its token, owner and time left, and
// the bucket's counter (its creation time in microseconds plus its last
// revision: every later grant's token is larger). A name never granted and
// a free one look alike: Held false, no error. Expired leases whose marker
// has not yet been written count as free.
func (a *Acquirer) Inspect(ctx context.Context, name string) (fence.LockInfo, error) {
	if err := checkKey(ctx, "inspect", "name", name); err != nil {
		return fence.LockInfo{}, err
	}
	key := EncodeKey(name)
	m, err := lastMsg(ctx, a.js, a.streamName, a.subj+key, a.o.Timeout)
	if err != nil {
		return fence.LockInfo{}, fmt.Errorf("natsfence: inspect %q: %w", name, err)
	}
	actx, cancel := attemptCtx(ctx, a.js, a.o.Timeout)
	info, err := a.stream.Info(actx) // after the read: its last revision covers the entry
	cancel()
	if err != nil {
		return fence.LockInfo{}, fmt.Errorf("natsfence: inspect %q: %w", name, err)
	}
	created := uint64(info.Created.UnixMicro())
	li := fence.LockInfo{Name: name, Counter: fence.Token(created + info.State.LastSeq)}
	if m == nil || isMarker(m) {
		return li, nil
	}
	grant := m.Sequence
	if g, err := strconv.ParseUint(header(m, grantHeader), 10, 64); err == nil && g != 0 {
		grant = g
	}
	secs, err := strconv.ParseInt(header(m, jetstream.MsgTTLHeader), 10, 64)
	if err != nil {
		return li, fmt.Errorf("natsfence: inspect %q: revision %d has no TTL: not a lease written by natsfence", name, m.Sequence)
	}
	left := time.Duration(secs)*time.Second - info.TimeStamp.Sub(m.Time)
	if left <= 0 {
		return li, nil
	}
	_, owner, _ := strings.Cut(string(m.Data), " ")
	li.Held, li.Token, li.Owner, li.TimeLeft = true, fence.Token(created+grant), owner, left
	return li, nil
}
