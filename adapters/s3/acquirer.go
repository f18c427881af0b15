package s3fence

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsmiddleware "github.com/aws/aws-sdk-go-v2/aws/middleware"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/smithy-go/middleware"
	smithyhttp "github.com/aws/smithy-go/transport/http"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/objkey"
	"github.com/fencekit/fencekit/internal/wakeup"
)

// MinAcquirerTTL is the shortest lease the S3 acquirer grants. S3 tells the
// time in whole seconds (the Date header), so shorter leases would only be
// refused to others for longer than they last.
const MinAcquirerTTL = time.Second

// MaxAcquirerTTL is the longest lease: the largest time.Duration (an expiry
// in the year 2300 or so fits the lock object's milliseconds).
const MaxAcquirerTTL = time.Duration(math.MaxInt64)

// DefaultDateLag is AcquirerOptions.DateLag when it is zero: it covers a
// server that caches its Date header and refreshes it once a second (a Date
// up to a second older than its truncation alone makes it), even when the
// refresh runs up to a second late.
const DefaultDateLag = 2 * time.Second

// MaxDateLag is the largest AcquirerOptions.DateLag NewAcquirer accepts: a
// Date further behind than that is a broken clock, not a cached header.
const MaxDateLag = time.Hour

// AcquirerOptions configures an Acquirer. A nil *AcquirerOptions means the defaults.
type AcquirerOptions struct {
	// Prefix starts the key of every lock object. Default: "fencekit-locks/".
	Prefix string
	// Owner is recorded in the lock object, for operators. Default: host name
	// and process id.
	Owner string
	// Backoff paces Acquire's polls while the lock is held: every poll is a
	// GET. Default: Min 50ms, Max 1s.
	Backoff fence.Backoff
	// Drift is taken off each lease's local deadline. Default: 1% of the ttl
	// plus 2ms. A TryAcquire or Acquire whose ttl is not longer than a Drift
	// set here returns an error matching fence.ErrInvalid naming the ttl.
	Drift time.Duration
	// MaxAttempts bounds how often one TryAcquire, Renew or Release reads and
	// writes again after a conflict or an ambiguous answer. Default: 8.
	MaxAttempts int
	// DateLag is how far the Date header of a response may be behind S3's
	// clock beyond its truncation to whole seconds, as for a server that
	// caches its Date header (see "Time" at Acquirer). Every expiry the
	// acquirer writes is that much later, an expired lock is granted again
	// up to twice that much later, and a new lock object's first grant
	// waits that much longer. Default (zero): DefaultDateLag, 2s. A Date
	// further behind than DateLag can let a lock be granted while its
	// holder's context is still live, by as much as the excess (the fence
	// still refuses the old holder's writes). Any tiny value, such as
	// time.Nanosecond, asks for no lag beyond whole seconds: only for a
	// server known to set Date from its clock on every response. Negative,
	// or above MaxDateLag: NewAcquirer returns an error matching
	// fence.ErrInvalid naming DateLag.
	DateLag time.Duration
}

// Acquirer grants leases from lock objects in an S3 bucket, with conditional
// writes alone: no other lock service. One object per lock name holds the
// token counter, the holder's nonce and the expiry, on S3's clock.
//
// A grant reads the lock object (GET), and if it is free (released, never
// used, or past its expiry on S3's clock) writes the next token and its own
// nonce with a PUT conditional on the ETag it read (If-Match), so of two
// contenders at most one succeeds; a name without an object first gets one,
// free (If-None-Match: *, see below). The token is the object's counter plus
// one, and a release keeps it (the acquirer never deletes the object). Renew
// and Release are PUTs conditional on the holder's ETag. Acquire + release
// take 3 requests (GET, PUT, PUT).
//
// # Tokens when the lock object is deleted
//
// Someone else may delete a lock object (a lifecycle rule, an operator, a
// bucket cleanup) while its holder still runs. The next grant then creates a
// new object, free and marked new (If-None-Match: *), reads it again, and
// takes its counter from S3's clock instead of 1: S3's latest possible time at
// that read (the second after its Date, plus DateLag), in microseconds (about
// 1.7e15 today; below 2^53 until the year 2255), and waits until S3's time has
// certainly reached it before it writes the grant, conditional on the new
// object's ETag. The token never comes from a read that found no object: a
// creating PUT may land long after that read, after another object's whole
// life. So a name's first grant, and the first after a deletion, take about
// a second plus DateLag (3s by default) and two requests longer. Its token is
// above every token the deleted object handed out, provided (a) S3's clock
// does not go back between the two objects and its Date headers are no
// further behind it than DateLag beyond whole seconds, and (b) the old object
// saw fewer than a million grants per second of its life (S3 accepts far
// fewer writes to one object). A stalled holder's write is then refused by
// the fence.
//
// # Tokens when an older version is restored
//
// With bucket versioning (or a backup), an operator may restore an older
// version of a lock object, whose counter is below tokens handed out since.
// Every grant's token is therefore at least the Date of the read it decides
// on, in microseconds: max(counter+1, Date). A Date is never ahead of S3's
// clock, so no token is above S3's time when its grant lands (given fewer
// than a million grants a second), and the first grant after a restore is
// above every token handed out before, provided its read's Date is later
// than the last grant before the restore landed: S3's clock does not go
// back, and the read comes more than a second plus DateLag (3s by default)
// after that grant, on S3's clock (a Date has whole seconds, and may be
// DateLag old). A grant sooner than that may repeat or go below a token
// handed out before the restore. Restoring a version that was held makes
// the name held until the expiry it records.
//
// # Time
//
// Expiry is decided on S3's clock, read from the Date header of its own
// responses, never on the client's: the client's wall clock may be off by any
// amount (only its monotonic clock measures the time since a response). A Date
// has whole seconds, and may be older still: a server that caches its Date
// header and refreshes it about once a second (as servers built on fasthttp
// do) sends a Date up to a second older than the truncation alone makes it,
// more when the refresh runs late. DateLag bounds that extra age (2s by
// default). So S3's time, when it answered, was at least the Date and less
// than the Date plus 1s plus DateLag.
//
// A writer records an expiry of at least S3's latest possible time (the Date,
// plus 1s, plus DateLag, plus the time since its request was sent) plus the
// ttl, and a reader takes a lock for expired only when S3's earliest possible
// time (the Date plus the time since its answer) has passed it. A released
// lock is granted at once. An expired one is granted again 0 to 2s + 2 x
// DateLag after its ttl ran out on S3's clock, counted from when the grant's
// or renewal's PUT was sent (6s with the default DateLag), plus a round trip
// and the waiter's poll: up to 1s + DateLag later when the writer's Date was
// fresh (its expiry is set for a Date as old as can be), and up to 1s +
// DateLag more when the reader's Date is as old as can be; 0 when the
// writer's Date was that old and the reader's fresh. From a server that sets
// Date from its clock on every response it is DateLag to 2s + DateLag.
// The holder's local deadline is measured from before the request that set
// the lease, less Drift; this tolerates clock rates differing by up to Drift
// over a ttl, and no clock offset at all. A read whose answer has no Date
// header is an error; a PUT whose answer has none (a proxy may drop it)
// computes the next expiry from the last Date seen, which only makes it later.
//
// A Date further behind S3's clock than DateLag (beyond whole seconds), on the
// answer a writer computes an expiry from, makes that expiry too early by the
// excess: a reader with a fresher Date could then grant the lock while the
// holder's context is still live (its writes are still refused by the fence
// once the next holder has written).
//
// Every client of a lock must see S3's own Date header. A proxy or gateway
// that sets Date from its own clock (or a client whose transport rewrites it)
// puts expiry on that clock: leases could then be granted twice, or held too
// long, by as much as that clock is off.
//
// # Lost answers
//
// A PUT whose answer was lost may have landed: the acquirer disables the SDK's
// retries for its PUTs, reads the object again, and recognises its own write
// by its nonce. A TryAcquire that gives up after such a PUT (its context
// ended, or a read failed) frees the lock in the background: it writes a free
// state conditional on the same ETag as the lost PUT, so a PUT still on its
// way can no longer land, or releases the grant if it had landed. Every write
// carries a random write id, so no two writes of a lock object share an ETag.
// It is safe for concurrent use.
type Acquirer struct {
	api    API
	bucket string
	o      AcquirerOptions

	line wakeup.Line // this acquirer's waiting Acquire calls, per name
}

var (
	_ fence.Acquirer  = (*Acquirer)(nil)
	_ fence.Inspector = (*Acquirer)(nil)
)

// NewAcquirer returns an Acquirer on bucket. It returns an error matching
// fence.ErrInvalid for a nil api, an empty bucket, or negative or invalid
// options.
func NewAcquirer(api API, bucket string, opts *AcquirerOptions) (*Acquirer, error) {
	if err := checkTarget("new acquirer", api, bucket); err != nil {
		return nil, err
	}
	var o AcquirerOptions
	if opts != nil {
		o = *opts
	}
	if o.Drift < 0 || o.MaxAttempts < 0 {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "options", Reason: "Drift and MaxAttempts may not be negative"}
	}
	if o.DateLag < 0 || o.DateLag > MaxDateLag {
		return nil, &fence.InvalidError{Op: "new acquirer", Arg: "DateLag", Reason: fmt.Sprintf("%v is outside 0 to %v", o.DateLag, MaxDateLag)}
	}
	if err := leasekit.CheckBackoff("new acquirer", o.Backoff); err != nil {
		return nil, err
	}
	if o.Prefix == "" {
		o.Prefix = "fencekit-locks/"
	}
	if err := leasekit.CheckText("new acquirer", "Prefix", o.Prefix, MaxKeyBytes-1); err != nil {
		return nil, err
	}
	if err := objkey.CheckPrefix("new acquirer", "Prefix", o.Prefix); err != nil {
		return nil, err
	}
	if o.Owner == "" {
		host, _ := os.Hostname()
		o.Owner = fmt.Sprintf("%s/%d", host, os.Getpid())
	}
	if o.Backoff == (fence.Backoff{}) {
		o.Backoff = fence.Backoff{Min: 50 * time.Millisecond, Max: time.Second}
	}
	if o.MaxAttempts == 0 {
		o.MaxAttempts = 8
	}
	if o.DateLag == 0 {
		o.DateLag = DefaultDateLag
	}
	return &Acquirer{api: api, bucket: bucket, o: o}, nil
}

// lockState is a lock object's content.
type lockState struct {
	Format  string `json:"fencekit"`
	Token   uint64 `json:"token"`
	Holder  string `json:"holder,omitempty"` // the holding grant's nonce; empty when released
	Owner   string `json:"owner,omitempty"`
	Expires int64  `json:"expires_ms"` // S3's clock, ms since the epoch
	// Write is random for every write, so no two writes share an ETag: a PUT
	// conditional on an ETag fails once anything was written over it.
	Write string `json:"write,omitempty"`
	// New marks an object created free by a grant that found none: the next
	// grant takes its token from S3's clock on the read that sees it.
	New bool `json:"new,omitempty"`
}

const lockFormat = "lock-v1"

// s3Clock is what one S3 response told about S3's time: its Date (whole
// seconds, and up to lag behind beyond that) and when the request was sent
// and its answer received, on the local monotonic clock.
type s3Clock struct {
	date       time.Time
	sent, recv time.Time
	lag        time.Duration // the acquirer's DateLag
}

// earliest is S3's earliest possible time now: the Date was set at or before
// the answer was received, and is never ahead of S3's clock. A stale Date
// only makes it earlier.
func (c s3Clock) earliest() time.Time { return c.date.Add(time.Since(c.recv)) }

// latest is S3's latest possible time now: the Date was set at or after the
// request was sent, and is less than a second (its truncation) plus lag
// behind S3's clock.
func (c s3Clock) latest() time.Time {
	return c.date.Add(time.Second + c.lag + time.Since(c.sent))
}

// observed is one read of a lock object.
type observed struct {
	exists bool
	etag   string
	st     lockState
	clock  s3Clock
}

func (o observed) free() bool {
	return !o.exists || o.st.Holder == "" || !o.clock.earliest().Before(time.UnixMilli(o.st.Expires))
}

func (a *Acquirer) objectKey(name string) string { return a.o.Prefix + name }

func (a *Acquirer) check(op string, ctx context.Context, name string) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if err := leasekit.CheckText(op, "name", name, MaxKeyBytes-len(a.o.Prefix)); err != nil {
		return err
	}
	return objkey.CheckPath(op, "name", a.objectKey(name))
}

// checkTTL refuses a ttl outside the acquirer's bounds, or one not longer
// than its Drift: the lease would be past its local deadline at once.
func (a *Acquirer) checkTTL(ttl time.Duration) error {
	if d := a.o.Drift; d > 0 && ttl > 0 && ttl <= d {
		return &fence.InvalidError{Op: "acquire", Arg: "ttl", Reason: fmt.Sprintf("%v is not longer than the acquirer's Drift %v: the lease would be lost at once", ttl, d)}
	}
	return leasekit.CheckTTL("acquire", ttl, MinAcquirerTTL, MaxAcquirerTTL)
}

// dateOf reads S3's Date header from a response's metadata or error.
func dateOf(md *middleware.Metadata, err error) (time.Time, bool) {
	var h http.Header
	if md != nil {
		if r, ok := awsmiddleware.GetRawResponse(*md).(*smithyhttp.Response); ok && r != nil {
			h = r.Header
		}
	}
	var re *smithyhttp.ResponseError
	if h == nil && errors.As(err, &re) && re.Response != nil {
		h = re.Response.Header
	}
	if h == nil {
		return time.Time{}, false
	}
	t, perr := http.ParseTime(h.Get("Date"))
	return t, perr == nil
}

// read GETs the lock object of name.
func (a *Acquirer) read(ctx context.Context, name string) (observed, error) {
	sent := time.Now()
	out, err := a.api.GetObject(ctx, &s3.GetObjectInput{Bucket: &a.bucket, Key: aws.String(a.objectKey(name))})
	recv := time.Now()
	var md *middleware.Metadata
	if out != nil {
		md = &out.ResultMetadata
	}
	date, ok := dateOf(md, err)
	if err != nil && !isNotFound(err) {
		return observed{}, err
	}
	if !ok {
		return observed{}, errors.New("s3fence: the server's response has no Date header, and leases need S3's clock")
	}
	o := observed{clock: s3Clock{date: date, sent: sent, recv: recv, lag: a.o.DateLag}}
	if err != nil {
		return o, nil // no such lock object yet
	}
	defer out.Body.Close()
	b, err := io.ReadAll(out.Body)
	if err != nil {
		return observed{}, err
	}
	if err := json.Unmarshal(b, &o.st); err != nil || o.st.Format != lockFormat || !fence.Token(o.st.Token).Valid() {
		return observed{}, fmt.Errorf("s3fence: lock object %q is not a fencekit lock (%q)", a.objectKey(name), truncate(b))
	}
	o.exists, o.etag = true, aws.ToString(out.ETag)
	return o, nil
}

func truncate(b []byte) string {
	if len(b) > 80 {
		return string(b[:80]) + "..."
	}
	return string(b)
}

// write PUTs st as name's lock object, conditional on etag (If-None-Match: *
// when etag is empty), without the SDK's retries. It returns the new ETag and
// S3's clock from the answer; an answer without a Date header gives prev, the
// clock of an earlier answer, which still bounds S3's time (its latest() only
// grows), so the next expiry computed from it is never too early.
func (a *Acquirer) write(ctx context.Context, name, etag string, st lockState, prev s3Clock) (string, s3Clock, error) {
	st.Format = lockFormat
	st.Write = newLockNonce()
	body, _ := json.Marshal(st)
	in := &s3.PutObjectInput{Bucket: &a.bucket, Key: aws.String(a.objectKey(name)),
		Body: bytes.NewReader(body), ContentLength: aws.Int64(int64(len(body))), ContentType: aws.String("application/json")}
	if etag == "" {
		in.IfNoneMatch = aws.String("*")
	} else {
		in.IfMatch = aws.String(etag)
	}
	sent := time.Now()
	out, err := a.api.PutObject(ctx, in, noRetries)
	clock := s3Clock{sent: sent, recv: time.Now(), lag: a.o.DateLag}
	var md *middleware.Metadata
	if out != nil {
		md = &out.ResultMetadata
	}
	if d, ok := dateOf(md, err); ok {
		clock.date = d
	} else {
		clock = prev
	}
	if err != nil {
		return "", clock, err
	}
	return aws.ToString(out.ETag), clock, nil
}

func newLockNonce() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// TryAcquire grants the lease on name for ttl, or returns fence.ErrHeld at
// once. ttl is at least MinAcquirerTTL; name is an S3 key (UTF-8, no NUL, with
// the prefix at most 1024 bytes), compared byte for byte. A counter at
// fence.MaxToken returns fence.ErrTokensExhausted. A grant that creates the
// lock object (a name's first, or the first after its object was deleted)
// waits about a second plus DateLag for S3's clock: see "Tokens when the
// lock object is deleted". A grant whose answer was lost is recognised and returned; one
// that cannot be confirmed before ctx ends returns an error and is released
// in the background.
func (a *Acquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check("acquire", ctx, name); err != nil {
		return nil, err
	}
	if err := a.checkTTL(ttl); err != nil {
		return nil, err
	}
	nonce := newLockNonce()
	var firstSent time.Time // the first PUT that may have landed
	var ambiguous error
	var pending *pendingGrant // the latest PUT that may have landed
	created := false          // this call wrote a new lock object
	defer func() {
		if pending != nil && !pending.adopted {
			go a.abandon(name, nonce, *pending, ttl)
		}
	}()
	for attempt := 0; attempt < a.o.MaxAttempts; attempt++ {
		o, err := a.read(ctx, name)
		if err != nil {
			return nil, a.failed("acquire", name, err, ambiguous)
		}
		if o.exists && o.st.Holder == nonce {
			// An earlier attempt of ours landed; its answer was lost.
			if pending != nil {
				pending.adopted = true
			}
			return a.lease(name, o.st, o.etag, o.clock, ttl, firstSent), nil
		}
		if !o.free() {
			if ambiguous != nil {
				return nil, a.failed("acquire", name, fence.ErrHeld, ambiguous)
			}
			return nil, fmt.Errorf("s3fence: acquire %q: %w", name, fence.ErrHeld)
		}
		if !o.exists {
			// The name's first grant, or its object was deleted: create it,
			// free and new, then read it again. A token from this read could
			// be below those of an object created and deleted while this PUT
			// was on its way.
			st := lockState{Token: uint64(o.clock.date.UnixMicro()), Owner: a.o.Owner, New: true}
			if _, _, err := a.write(ctx, name, "", st, o.clock); err != nil && !isConflict(err) && !mayHaveApplied(err) {
				return nil, a.failed("acquire", name, err, ambiguous)
			}
			if !created {
				created = true
				attempt-- // the first creation is no retry: MaxAttempts 1 still grants a new name
			}
			continue
		}
		// Every grant is at least S3's Date at this read, in microseconds
		// (never ahead of S3's clock, so no token is ahead of S3's time when
		// its grant lands): the first grant after an older version of the
		// lock object was restored (its counter back) is above every token
		// handed out before, once that Date is past them.
		next := max(o.st.Token+1, uint64(max(o.clock.date.UnixMicro(), 0)))
		if o.st.New {
			// A new lock object, seen by this read: start above every token
			// a deleted one may have handed out.
			t, err := a.creationToken(ctx, o.clock)
			if err != nil {
				return nil, a.failed("acquire", name, err, ambiguous)
			}
			next = max(next, t)
		}
		if !fence.Token(next).Valid() {
			return nil, fmt.Errorf("s3fence: acquire %q: %w", name, fence.ErrTokensExhausted)
		}
		st := lockState{Token: next, Holder: nonce, Owner: a.o.Owner}
		sent := time.Now()
		// S3's latest possible time when this PUT lands, plus the ttl.
		st.Expires = o.clock.latest().Add(ttl).UnixMilli() + 1
		if firstSent.IsZero() {
			firstSent = sent
		}
		etag, clock, err := a.write(ctx, name, o.etag, st, o.clock)
		switch {
		case err == nil:
			pending = nil // a later write was conditional on what the earlier one would have changed
			return a.lease(name, st, etag, clock, ttl, firstSent), nil
		case isConflict(err):
			// Someone else wrote in between (or created the object): read again.
		case mayHaveApplied(err):
			ambiguous = err
			pending = &pendingGrant{etag: o.etag, token: st.Token, clock: clock}
			if ctx.Err() != nil {
				return nil, a.failed("acquire", name, err, ambiguous)
			}
		default:
			return nil, a.failed("acquire", name, err, ambiguous)
		}
		if err := pause(ctx, attempt); err != nil {
			return nil, a.failed("acquire", name, err, ambiguous)
		}
	}
	return nil, a.failed("acquire", name, fmt.Errorf("%d attempts: %w", a.o.MaxAttempts, ErrContention), ambiguous)
}

// creationToken is the token of a new lock object: S3's latest possible time
// when it answered a read that found the object new (the second after its
// Date, plus DateLag), in microseconds, rounded up. It first waits until S3's
// time has certainly reached that time (by its earliest possible time: about
// a second plus DateLag after the read), so the PUT of the grant lands at or
// after the time its token stands for, and this object's tokens, which grow
// by one per grant (fewer than a million a second), stay below S3's time in
// microseconds. An object deleted before this one was created made all its
// grants before the read, so its tokens are below S3's time at the read, and
// so below this token; and any later read that finds a newer new object
// (created after this one was deleted) gives a token above S3's time at that
// read: above this object's tokens.
func (a *Acquirer) creationToken(ctx context.Context, c s3Clock) (uint64, error) {
	floor := c.date.Truncate(time.Second).Add(time.Second + c.lag)
	if r := floor.Sub(floor.Truncate(time.Microsecond)); r > 0 {
		floor = floor.Add(time.Microsecond - r)
	}
	if wait := floor.Sub(c.earliest()); wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return 0, context.Cause(ctx)
		case <-t.C:
		}
	}
	return uint64(floor.UnixMicro()), nil
}

// pendingGrant is a grant's PUT whose answer was lost: it may have landed,
// or may still land (delayed on the way), on the lock object as it was at
// etag ("" for no object).
type pendingGrant struct {
	etag    string
	token   uint64
	clock   s3Clock
	adopted bool // recognised as granted: the caller holds it
}

// abandon frees the lock from a grant that TryAcquire gave up on after an
// ambiguous PUT, in the background, whatever order the requests land in: it
// writes a free state conditional on the same ETag (or absence) as the
// pending PUT, so a PUT still on its way can no longer land; if the pending
// PUT landed first, it releases that grant (recognised by its nonce). It stops
// when the lock is free of this grant, or after the grant's ttl.
func (a *Acquirer) abandon(name, nonce string, p pendingGrant, ttl time.Duration) {
	// However it ends, the lock may be free now: the head of the line tries.
	defer a.line.Poke(name)
	ctx, cancel := context.WithTimeout(context.Background(), min(ttl, time.Minute)+5*time.Second)
	defer cancel()
	etag, clock := p.etag, p.clock
	for attempt := 0; ctx.Err() == nil; attempt++ {
		_, _, err := a.write(ctx, name, etag, lockState{Token: p.token, Owner: a.o.Owner}, clock)
		if err == nil {
			return
		}
		if isConflict(err) || mayHaveApplied(err) {
			o, rerr := a.read(ctx, name)
			switch {
			case rerr != nil:
			case o.exists && o.st.Holder == nonce:
				etag, clock = o.etag, o.clock // our grant landed: release it
			case o.exists != (p.etag != "") || o.etag != p.etag:
				return // the object changed since: the pending PUT cannot land
			}
		}
		if pause(ctx, attempt) != nil {
			return
		}
	}
}

// failed wraps err. After an ambiguous PUT the grant may exist (under this
// call's nonce): TryAcquire then frees it in the background (abandon).
func (a *Acquirer) failed(op, name string, err, ambiguous error) error {
	if ambiguous != nil {
		return fmt.Errorf("s3fence: %s %q: %w (an earlier attempt may have been granted; it is being released: %v)", op, name, err, ambiguous)
	}
	return fmt.Errorf("s3fence: %s %q: %w", op, name, err)
}

// pause paces the retries of one request after a conflict.
func pause(ctx context.Context, attempt int) error {
	return fence.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}.Sleep(ctx, attempt)
}

func (a *Acquirer) lease(name string, st lockState, etag string, clock s3Clock, ttl time.Duration, sent time.Time) *lease {
	return &lease{Base: leasekit.New(name, fence.Token(st.Token), ttl, a.o.Drift, sent), a: a, st: st, etag: etag, clock: clock}
}

// Acquire waits until the lease on name is granted, polling the lock object
// with the acquirer's Backoff. See fence.Acquirer.
//
// The Acquire calls of one Acquirer that wait for the same name form a line in
// the order they began: only its head reads and writes the lock object, a
// Release through this Acquirer lets the head try at once, and a holder that
// releases and asks again joins at the back. So within one Acquirer waiters
// are granted in arrival order, unless the head's attempt stays stuck for
// more than a second (the others then try too) or a grant goes elsewhere: to
// another Acquirer or process (no order is kept between them), or to a
// TryAcquire, which never waits in the line.
func (a *Acquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check("acquire", ctx, name); err != nil {
		return nil, err
	}
	if err := a.checkTTL(ttl); err != nil {
		return nil, err
	}
	return a.line.Acquire(ctx, a.o.Backoff, name, nil, func(ctx context.Context) (fence.Lease, error) {
		l, err := a.TryAcquire(ctx, name, ttl)
		if errors.Is(err, ErrContention) && !errors.Is(err, fence.ErrUnknown) {
			// Other contenders wrote the lock in between every attempt:
			// not granted, as for a held lock; wait and try again.
			return nil, fmt.Errorf("%w (%v)", fence.ErrHeld, err)
		}
		if err != nil && !errors.Is(err, fence.ErrHeld) && ctx.Err() != nil {
			// The wait ran out during an attempt.
			return nil, wakeup.GaveUp(ctx)
		}
		return l, err
	})
}

// Inspect reads name's lock object: its holder (the owner recorded by the
// grant), the time left on S3's clock (at least; up to 1s + DateLag more), and
// its counter.
func (a *Acquirer) Inspect(ctx context.Context, name string) (fence.LockInfo, error) {
	if err := a.check("inspect", ctx, name); err != nil {
		return fence.LockInfo{}, err
	}
	o, err := a.read(ctx, name)
	if err != nil {
		return fence.LockInfo{}, fmt.Errorf("s3fence: inspect %q: %w", name, err)
	}
	if !o.exists {
		return fence.LockInfo{}, fmt.Errorf("s3fence: inspect %q: %w", name, fence.ErrNotFound)
	}
	info := fence.LockInfo{Name: name, Counter: fence.Token(o.st.Token)}
	if !o.free() {
		info.Held, info.Token, info.Owner = true, fence.Token(o.st.Token), o.st.Owner
		info.TimeLeft = time.UnixMilli(o.st.Expires).Sub(o.clock.earliest())
	}
	return info, nil
}

// lease is one grant: the lock object's content and ETag as this holder wrote
// them last.
type lease struct {
	*leasekit.Base
	a *Acquirer

	mu    sync.Mutex
	st    lockState
	etag  string
	clock s3Clock // S3's time from the latest answer
}

// Renew extends the lease by its ttl on S3's clock, with a PUT conditional on
// the holder's ETag. See fence.Lease. A lease whose context is done (released,
// lost, or past its local deadline) returns fence.ErrLost without writing, so
// a late Renew never holds the lock on S3 again; a renewal that S3 confirms
// only after the local deadline passed is undone with a release. A renewal
// that may have landed but could not be confirmed returns an error matching
// fence.ErrUnknown, and the lease still ends at its local deadline.
func (l *lease) Renew(ctx context.Context) error {
	if err := leasekit.CheckContext("renew", ctx); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for attempt := 0; attempt < l.a.o.MaxAttempts; attempt++ {
		if l.Context().Err() != nil {
			return l.lost()
		}
		st := l.st
		sent := time.Now()
		st.Expires = l.clock.latest().Add(l.TTL()).UnixMilli() + 1
		etag, clock, err := l.a.write(ctx, l.Name(), l.etag, st, l.clock)
		if err == nil {
			l.st, l.etag, l.clock = st, etag, clock
			if !l.Extend(sent) {
				// Confirmed too late: the holder has stopped; free the lock
				// at once rather than leave it held for a ttl (in the
				// background when this write fails).
				if _, _, err := l.a.write(ctx, l.Name(), l.etag, lockState{Token: l.st.Token, Owner: l.st.Owner}, l.clock); err != nil {
					go l.a.abandon(l.Name(), l.st.Holder, pendingGrant{etag: l.etag, token: l.st.Token, clock: l.clock}, l.TTL())
				}
				return l.lost()
			}
			return nil
		}
		if !isConflict(err) && !mayHaveApplied(err) {
			return fmt.Errorf("s3fence: renew %q: %w", l.Name(), err)
		}
		// Someone else wrote, or our write may have landed: read and decide.
		o, rerr := l.a.read(ctx, l.Name())
		if rerr != nil {
			// The renewal may have landed: not confirmed, the lease still
			// ends at its local deadline.
			return fmt.Errorf("s3fence: renew %q: %w: %w (after %v)", l.Name(), fence.ErrUnknown, rerr, err)
		}
		if !o.exists || o.st.Holder != st.Holder || o.st.Token != st.Token {
			l.End(fence.ErrLost)
			return l.lost()
		}
		// Still ours: our write landed (its answer was lost) or not. Take the
		// current ETag and write again; the local deadline moves only when a
		// write is confirmed.
		l.st, l.etag, l.clock = o.st, o.etag, o.clock
		if err := pause(ctx, attempt); err != nil {
			return fmt.Errorf("s3fence: renew %q: %w", l.Name(), err)
		}
	}
	return fmt.Errorf("s3fence: renew %q: %d attempts: %w", l.Name(), l.a.o.MaxAttempts, ErrContention)
}

// Release frees the lock, keeping its counter, with a PUT conditional on the
// holder's ETag; fence.ErrLost if another grant holds it. The lease's context is
// done afterwards. A release that cannot be confirmed (an ambiguous PUT and a
// failed read, or ctx ending) goes on in the background until the lock is free
// of this grant or its ttl has passed, and Release returns an error matching
// fence.ErrUnknown.
func (l *lease) Release(ctx context.Context) error {
	if err := leasekit.CheckContext("release", ctx); err != nil {
		return err
	}
	// Whatever the outcome, the lock may be free: the head of this
	// acquirer's line tries at once (after the lease's own lock below is
	// let go).
	defer l.a.line.Poke(l.Name())
	l.mu.Lock()
	defer l.mu.Unlock()
	defer l.End(context.Canceled)
	for attempt := 0; attempt < l.a.o.MaxAttempts; attempt++ {
		st := lockState{Token: l.st.Token, Owner: l.st.Owner}
		_, _, err := l.a.write(ctx, l.Name(), l.etag, st, l.clock)
		if err == nil {
			return l.released()
		}
		if !isConflict(err) && !mayHaveApplied(err) {
			return fmt.Errorf("s3fence: release %q: %w", l.Name(), err)
		}
		o, rerr := l.a.read(ctx, l.Name())
		if rerr != nil {
			return l.releaseLater(fmt.Errorf("%w (after %v)", rerr, err))
		}
		switch {
		case o.exists && o.st.Token == l.st.Token && o.st.Holder == "":
			return l.released() // our release landed; its answer was lost
		case !o.exists || o.st.Token != l.st.Token || o.st.Holder != l.st.Holder:
			return l.lost()
		}
		l.etag = o.etag // still ours: release against the current ETag
		if err := pause(ctx, attempt); err != nil {
			return l.releaseLater(err)
		}
	}
	return l.releaseLater(fmt.Errorf("%d attempts: %w", l.a.o.MaxAttempts, ErrContention))
}

// releaseLater is Release's result when it could not confirm that the lock is
// free (err): the release goes on in the background, as for an abandoned
// grant (conditional on the holder's ETag, so it never frees another grant),
// and Release returns an error matching fence.ErrUnknown.
func (l *lease) releaseLater(err error) error {
	go l.a.abandon(l.Name(), l.st.Holder, pendingGrant{etag: l.etag, token: l.st.Token, clock: l.clock}, l.TTL())
	return fmt.Errorf("s3fence: release %q: %w: %w (it goes on in the background)", l.Name(), fence.ErrUnknown, err)
}

// released is Release's result once the lock is free: ErrLost when the lease
// had already ended on its own (past its local deadline, or found lost).
func (l *lease) released() error {
	if l.Context().Err() != nil && errors.Is(context.Cause(l.Context()), fence.ErrLost) {
		return l.lost()
	}
	return nil
}

func (l *lease) lost() error {
	return fmt.Errorf("s3fence: lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}
