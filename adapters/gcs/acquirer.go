package gcsfence

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"cloud.google.com/go/storage"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/wakeup"
)

// MinAcquirerTTL is the shortest lease the GCS acquirer grants. On GCS
// itself, which takes about one write a second per object, a lease renewed
// every ttl/3 (as fence.Hold does) wants a ttl of 3s or more; shorter ttls
// are for emulators.
const MinAcquirerTTL = 100 * time.Millisecond

// MaxOwnerBytes is the longest AcquirerOptions.Owner: it is stored in every
// lock object's custom metadata, which GCS limits to 8 KiB in all.
const MaxOwnerBytes = 1024

// MaxAcquirerTTL is the longest lease: the largest time.Duration.
const MaxAcquirerTTL = time.Duration(math.MaxInt64)

// clockResolution is the precision of GCS's object timestamps: milliseconds
// (fake-gcs-server gives microseconds). A timestamp is at most this much
// before the moment it stands for.
const clockResolution = time.Millisecond

// clockReuse is how long a reading of GCS's clock may decide that a lock is
// still held without a new one.
const clockReuse = 10 * time.Second

// Metadata keys of a lock object. The whole state is in its custom
// metadata, so one attributes read gives state and generation; the same
// state is also the object's body (lockBody), which an edit of the metadata
// in place (objects.patch) cannot change.
const (
	metaFormat  = "fencekit"
	metaToken   = "fence-token"
	metaHolder  = "fence-holder"
	metaOwner   = "fence-owner"
	metaTTL     = "fence-ttl-ns"
	metaNew     = "fence-new"
	lockFormat  = "lock-v1"
	clockFormat = "clock-v1"
)

// errClockBusy is now's error when other contenders rewrote the clock object
// between every read and upload of MaxAttempts attempts.
var errClockBusy = errors.New("gcsfence: the clock object kept changing under the clock reading")

// AcquirerOptions configures an Acquirer. A nil *AcquirerOptions means the defaults.
type AcquirerOptions struct {
	// Prefix starts the name of every lock object. Default: "fencekit-locks/".
	Prefix string
	// ClockObject is the object the acquirer writes to read GCS's clock (an
	// empty object with a clock marker in its metadata, rewritten
	// conditional on its generation). It may not start with Prefix. An
	// object of that name written by anything else (other than an empty
	// object without metadata) is never overwritten: reading the clock then
	// fails with an error naming ClockObject. Default: "fencekit-clock".
	ClockObject string
	// Owner is recorded in the lock object, for operators: UTF-8 without NUL,
	// at most MaxOwnerBytes. Default: host name and process id.
	Owner string
	// Backoff paces Acquire's polls while the lock is held: every poll is an
	// attributes read. Default: Min 50ms, Max 1s.
	Backoff fence.Backoff
	// Drift is taken off each lease's local deadline. Default: 1% of the ttl
	// plus 2ms. A TryAcquire or Acquire whose ttl is not longer than a Drift
	// set here returns an error matching fence.ErrInvalid naming the ttl.
	Drift time.Duration
	// MaxAttempts bounds how often one TryAcquire, Renew or Release reads and
	// writes again after a conflict or an ambiguous answer. Default: 8.
	MaxAttempts int
}

// Acquirer grants leases from lock objects in a GCS bucket, with generation
// preconditions alone: no other lock service. One object per lock name holds,
// in its metadata, the token counter, the holder's nonce, the ttl and the
// owner. A lock object's name is Prefix + name, byte for byte.
//
// A grant reads the lock object's attributes, and if it is free (released, or
// past its expiry on GCS's clock) uploads the next token and its own nonce
// with ifGenerationMatch on the generation it read, so of two contenders at
// most one succeeds. Renew and Release are uploads conditional on the
// holder's generation; a release keeps the counter (the acquirer never
// deletes the object). Acquire + release of a free lock take 3 requests (a
// read and two uploads).
//
// # Time
//
// Expiry is decided on GCS's clock as GCS records it in the objects
// themselves, never on the client's and never from the Date header: the
// lock object's "updated" timestamp is set by GCS when the grant or renewal
// lands, and the lease expires at that time plus its ttl (plus a millisecond,
// the timestamps' precision). To tell whether that time has passed, a
// contender that finds the lock held writes the clock object (ClockObject) and
// reads GCS's time from that upload's "updated"; it adds the time since that
// answer on its own monotonic clock, and reuses that reading for up to 10s to
// decide that a lock is still held, but takes a lock over only on a fresh one.
// The clock upload is conditional on the clock object's generation (after a
// 412 it reads the object and writes again), so it never overwrites an object
// that is not a clock; it is sent again after a lost answer or a 5xx, and
// when another contender's clock write got in before each of MaxAttempts
// tries, the time GCS stamped on that write is the reading. A clock upload
// refused with 429 (every contender writes that one object, and GCS takes
// about one write a second per object) counts the lock as held.
// A Date header can be set by any proxy or gateway on the way; an object's
// timestamps are in the JSON that GCS wrote. The holder's local deadline is
// measured from before the request that set the lease, less Drift; this
// tolerates clock rates differing by up to Drift over a ttl, and no clock
// offset at all.
//
// # Tokens when the lock object is deleted
//
// Someone may delete a lock object (a lifecycle rule, an operator) while its
// holder still runs. The next grant then creates a new object, free and marked
// new, with ifGenerationMatch=0, and the first grant on a new object takes its
// counter from GCS's clock instead of 1: the object's creation time rounded up
// to the next millisecond, in microseconds (about 1.8e15 today; below 2^53
// until the year 2255), after waiting a millisecond so that GCS's time has
// passed it. Its token is above every token the deleted object handed out,
// provided (a) GCS's clock does not go back between the two objects, and (b)
// the old object saw fewer than one grant per microsecond of its life (GCS
// takes about one write a second per object). A stalled holder's write is
// then refused by the fence. A name's first grant takes two more requests.
//
// # Tokens when an older generation is restored
//
// With object versioning, an operator may restore an older generation of a
// lock object (a copy of it over the live object), whose counter is below
// tokens handed out since. Every grant's token is therefore at least the
// floor a new object's first grant takes, from the lock object's updated
// time (the restore's, for a restored generation): max(counter+1, floor),
// after waiting until GCS's time has passed the floor (up to a millisecond
// after the read). Every token is then at or below GCS's time when its
// grant lands, and the first grant after a restore is above every token
// handed out before it, under the same conditions (a) and (b) as for a
// deleted object. Restoring a generation that was held makes the name held
// until its ttl has passed since the restore.
//
// # Metadata edited in place
//
// Another tool may patch a lock object's metadata (objects.patch or update:
// the generation and the body stay) and remove its holder, shorten its ttl
// or lower its token. Every upload of the acquirer stores the state twice:
// in the metadata, and as the body. A read takes the metadata when its state
// keys encode to the body GCS checksummed (its CRC32C), and the body
// otherwise, so a patch never frees a held lock early nor lowers the counter
// (a patch moves the object's updated time, and so its expiry, later: the
// lock is held that much longer). A lock object with an empty body, as
// older versions of this package wrote, whose metadata GCS reports edited
// (a metageneration above 1) is refused with an error matching
// ErrMetadataChanged until someone deletes it; its next upload (a grant or
// release) gives it a body.
//
// # Lost answers
//
// cloud.google.com/go/storage retries conditional uploads on its own (see the
// package doc); the acquirer turns that off for its uploads, reads again after
// an ambiguous one, and recognises its own write by its nonce. A TryAcquire
// that gives up after such an upload frees the lock in the background: it
// writes a free state conditional on the same generation as the lost upload,
// so an upload still on its way can no longer land, or releases the grant if
// it had landed. It is safe for concurrent use.
type Acquirer struct {
	b *storage.BucketHandle
	o AcquirerOptions

	line wakeup.Line // this acquirer's waiting Acquire calls, per name

	mu       sync.Mutex
	clock    gcsClock // the latest reading of GCS's clock
	clockGen int64    // the clock object's generation as last seen; 0: unknown
}

var (
	_ fence.Acquirer  = (*Acquirer)(nil)
	_ fence.Inspector = (*Acquirer)(nil)
)

// NewAcquirer returns an Acquirer on bucket. It returns an error matching
// fence.ErrInvalid, naming the option, for a nil bucket or one whose name GCS
// cannot have, a negative Drift or MaxAttempts, an invalid Backoff, an Owner
// GCS cannot keep, or a Prefix or ClockObject GCS cannot store (or a
// ClockObject under Prefix, which a lock name could then name).
func NewAcquirer(bucket *storage.BucketHandle, opts *AcquirerOptions) (*Acquirer, error) {
	const op = "new acquirer"
	if err := checkBucket(op, bucket); err != nil {
		return nil, err
	}
	var o AcquirerOptions
	if opts != nil {
		o = *opts
	}
	if o.Drift < 0 {
		return nil, &fence.InvalidError{Op: op, Arg: "Drift", Reason: "negative"}
	}
	if o.MaxAttempts < 0 {
		return nil, &fence.InvalidError{Op: op, Arg: "MaxAttempts", Reason: "negative"}
	}
	if err := leasekit.CheckBackoff(op, o.Backoff); err != nil {
		return nil, err
	}
	if o.Prefix == "" {
		o.Prefix = "fencekit-locks/"
	}
	if err := checkName(op, "Prefix", o.Prefix, MaxKeyBytes-1); err != nil {
		return nil, err
	}
	if o.ClockObject == "" {
		o.ClockObject = "fencekit-clock"
	}
	if err := checkName(op, "ClockObject", o.ClockObject, MaxKeyBytes); err != nil {
		return nil, err
	}
	if strings.HasPrefix(o.ClockObject, o.Prefix) {
		return nil, &fence.InvalidError{Op: op, Arg: "ClockObject", Reason: fmt.Sprintf("%q starts with Prefix %q: a lock name would name it", o.ClockObject, o.Prefix)}
	}
	if o.Owner == "" {
		host, _ := os.Hostname()
		o.Owner = fmt.Sprintf("%s/%d", host, os.Getpid())
	}
	// GCS keeps at most 8 KiB of custom metadata per object, as text.
	if err := leasekit.CheckText(op, "Owner", o.Owner, MaxOwnerBytes); err != nil {
		return nil, err
	}
	if o.Backoff == (fence.Backoff{}) {
		o.Backoff = fence.Backoff{Min: 50 * time.Millisecond, Max: time.Second}
	}
	if o.MaxAttempts == 0 {
		o.MaxAttempts = 8
	}
	return &Acquirer{b: bucket, o: o}, nil
}

// lockState is a lock object's content.
type lockState struct {
	token  uint64
	holder string // the holding grant's nonce; empty when released
	owner  string
	ttl    time.Duration
	new    bool // created free by a grant that found no object
}

func (s lockState) metadata() map[string]string {
	m := map[string]string{metaFormat: lockFormat, metaToken: strconv.FormatUint(s.token, 10), metaOwner: s.owner}
	if s.holder != "" {
		m[metaHolder] = s.holder
		m[metaTTL] = strconv.FormatInt(int64(s.ttl), 10)
	}
	if s.new {
		m[metaNew] = "1"
	}
	return m
}

// lockBody is a lock object's body: its state's metadata as JSON (keys
// sorted, so the same state always gives the same bytes).
func lockBody(m map[string]string) []byte {
	b, _ := json.Marshal(m)
	return b
}

// maxLockBody bounds the body read of a lock object: the state with the
// longest Owner is far smaller.
const maxLockBody = 16 << 10

// stateKeys are the metadata keys that hold a lock object's state.
var stateKeys = []string{metaFormat, metaToken, metaHolder, metaOwner, metaTTL, metaNew}

// stateMetadata is the part of an object's metadata that holds lock state:
// the state keys present, whatever their value.
func stateMetadata(m map[string]string) map[string]string {
	out := map[string]string{}
	for _, k := range stateKeys {
		if v, ok := m[k]; ok {
			out[k] = v
		}
	}
	return out
}

func parseLock(m map[string]string) (lockState, bool) {
	if m[metaFormat] != lockFormat {
		return lockState{}, false
	}
	tok, err := strconv.ParseUint(m[metaToken], 10, 64)
	if err != nil || (!fence.Token(tok).Valid() && !(tok == 0 && m[metaNew] == "1")) {
		return lockState{}, false
	}
	s := lockState{token: tok, holder: m[metaHolder], owner: m[metaOwner], new: m[metaNew] == "1"}
	if s.holder != "" {
		ttl, err := strconv.ParseInt(m[metaTTL], 10, 64)
		if err != nil || ttl <= 0 {
			return lockState{}, false
		}
		s.ttl = time.Duration(ttl)
	}
	return s, true
}

// gcsClock is one reading of GCS's clock: an object timestamp GCS set while
// serving a request, and when that request's answer arrived, on the local
// monotonic clock.
type gcsClock struct {
	at   time.Time
	recv time.Time
}

// earliest is GCS's earliest possible time now.
func (c gcsClock) earliest() time.Time { return c.at.Add(time.Since(c.recv)) }

// observed is one read of a lock object.
type observed struct {
	exists  bool
	gen     int64
	updated time.Time // GCS's time when this generation was written
	recv    time.Time // when the read's answer arrived
	st      lockState
}

// expires is when the holder's lease ends on GCS's clock.
func (o observed) expires() time.Time { return o.updated.Add(clockResolution).Add(o.st.ttl) }

func (a *Acquirer) object(name string) *storage.ObjectHandle { return a.b.Object(a.o.Prefix + name) }

func (a *Acquirer) check(op string, ctx context.Context, name string) error {
	return checkObjectName(op, ctx, "name", a.o.Prefix, name)
}

// checkTTL refuses a ttl outside the acquirer's bounds, or one not longer
// than its Drift.
func (a *Acquirer) checkTTL(ttl time.Duration) error {
	if d := a.o.Drift; d > 0 && ttl > 0 && ttl <= d {
		return &fence.InvalidError{Op: "acquire", Arg: "ttl", Reason: fmt.Sprintf("%v is not longer than the acquirer's Drift %v: the lease would be lost at once", ttl, d)}
	}
	return leasekit.CheckTTL("acquire", ttl, MinAcquirerTTL, MaxAcquirerTTL)
}

// read reads name's lock object's attributes (the library retries this read
// on its own: it changes nothing).
//
// The state is taken from the metadata when the metadata is the upload's:
// its state keys, encoded as lockBody does, have the CRC32C that GCS
// computed for the body. Metadata edited in place since (objects.patch by
// another tool: a holder removed, a ttl or token rewritten) does not, and
// the state is then read from the body of the same generation, which an
// edit of the metadata cannot change. A lock object with an empty body
// (written by an older fencekit, or by hand) is taken from its metadata
// unless GCS says its metadata was edited (a metageneration above 1): then
// its state cannot be known, and read returns an error matching
// ErrMetadataChanged.
func (a *Acquirer) read(ctx context.Context, name string) (observed, error) {
	for attempt := 0; ; attempt++ {
		attrs, err := a.object(name).Attrs(ctx)
		o := observed{recv: time.Now()}
		if errors.Is(err, storage.ErrObjectNotExist) {
			return o, nil
		}
		if err != nil {
			return observed{}, err
		}
		if attrs.Updated.IsZero() {
			return observed{}, fmt.Errorf("gcsfence: lock object %q has no updated time", a.o.Prefix+name)
		}
		st, ok := parseLock(attrs.Metadata)
		switch {
		case attrs.Size == 0 && attrs.Metageneration > 1:
			// Edited, and no body to check against: also when the edit
			// removed the keys that say it is a fencekit lock, since its
			// holder and counter may be among what is gone.
			return observed{}, fmt.Errorf("gcsfence: lock object %q (metageneration %d, metadata %v): %w; it holds no copy of its state to check against (written by an older fencekit): delete it to start its name again from GCS's clock", a.o.Prefix+name, attrs.Metageneration, attrs.Metadata, ErrMetadataChanged)
		case attrs.Size == 0 && !ok:
			return observed{}, fmt.Errorf("gcsfence: lock object %q is not a fencekit lock (metadata %v)", a.o.Prefix+name, attrs.Metadata)
		case attrs.Size > 0 && (!ok || crc32.Checksum(lockBody(stateMetadata(attrs.Metadata)), crcTable) != attrs.CRC32C):
			// The metadata was changed after the upload: the body holds
			// the state the upload wrote.
			st, err = a.readBody(ctx, name, attrs)
			if errors.Is(err, storage.ErrObjectNotExist) && attempt < 3 {
				continue // replaced since the attributes were read
			}
			if err != nil {
				return observed{}, err
			}
		}
		o.exists, o.gen, o.updated, o.st = true, attrs.Generation, attrs.Updated, st
		return o, nil
	}
}

// crcTable is GCS's CRC32C.
var crcTable = crc32.MakeTable(crc32.Castagnoli)

// readBody reads the state from the body of the lock object's generation
// in attrs, whose metadata was changed after its upload.
func (a *Acquirer) readBody(ctx context.Context, name string, attrs *storage.ObjectAttrs) (lockState, error) {
	r, err := a.object(name).Generation(attrs.Generation).NewReader(ctx)
	if err != nil {
		return lockState{}, err
	}
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, maxLockBody+1))
	if err != nil {
		return lockState{}, err
	}
	var m map[string]string
	if json.Unmarshal(b, &m) == nil {
		if st, ok := parseLock(m); ok {
			return st, nil
		}
	}
	return lockState{}, fmt.Errorf("gcsfence: lock object %q (metadata %v): %w, and its body is no lock state to check against: delete it to start its name again from GCS's clock", a.o.Prefix+name, attrs.Metadata, ErrMetadataChanged)
}

// write uploads st as name's lock object (in its metadata, and as its
// body), conditional on generation gen (0: the object must not exist),
// without the library's retries.
func (a *Acquirer) write(ctx context.Context, name string, gen int64, st lockState) (*storage.ObjectAttrs, error) {
	m := st.metadata()
	attrs, err := upload(ctx, a.object(name), gen, lockBody(m), m)
	if err == nil && attrs.Updated.IsZero() {
		return nil, fmt.Errorf("gcsfence: the answer to an upload of lock object %q has no updated time", a.o.Prefix+name)
	}
	return attrs, err
}

// now reads GCS's clock: it rewrites the clock object and takes the time GCS
// stamped on it. The upload is conditional on the clock object's generation
// as last seen (on its absence at first), so it never overwrites an object
// that is not a clock: after a 412 it reads the object, and refuses to go on
// if that object holds anything but an empty body without metadata or
// fencekit's clock marker (a Writer's value, say, in the same bucket). The
// library does not retry these uploads; now does, after a lost answer or a
// 5xx, up to MaxAttempts uploads in all. When every upload met another
// contender's clock write (412), the time GCS stamped on the last such write
// is the reading.
func (a *Acquirer) now(ctx context.Context) (gcsClock, error) {
	a.mu.Lock()
	gen := a.clockGen
	a.mu.Unlock()
	o := a.b.Object(a.o.ClockObject)
	var read gcsClock // the latest clock write another contender made, as read after a 412
	for attempt := 0; attempt < a.o.MaxAttempts; attempt++ {
		attrs, err := upload(ctx, o, gen, nil, map[string]string{metaFormat: clockFormat})
		if isConflict(err) {
			cur, rerr := o.Attrs(ctx)
			if rerr == nil && cur.Metadata[metaFormat] == clockFormat && !cur.Updated.IsZero() {
				// GCS stamped that write before it served this read: a
				// reading too (maybe older than an upload of our own would
				// give, never later than GCS's time).
				read = gcsClock{at: cur.Updated, recv: time.Now()}
			}
			switch {
			case errors.Is(rerr, storage.ErrObjectNotExist):
				gen = 0
			case rerr != nil:
				return gcsClock{}, fmt.Errorf("gcsfence: reading GCS's clock (reading %q after %v): %w", a.o.ClockObject, err, rerr)
			case cur.Metadata[metaFormat] != clockFormat && (cur.Size != 0 || len(cur.Metadata) != 0):
				return gcsClock{}, fmt.Errorf("gcsfence: reading GCS's clock: ClockObject %q holds an object fencekit did not write as its clock (metadata %v, %d bytes); it is left alone: choose another ClockObject", a.o.ClockObject, cur.Metadata, cur.Size)
			default:
				gen = cur.Generation
			}
			continue
		}
		if err != nil && mayHaveApplied(err) && ctx.Err() == nil && attempt+1 < a.o.MaxAttempts {
			// A lost answer or a 5xx: write again (if the upload landed, the
			// next one gets 412 and reads the new generation).
			if perr := pause(ctx, attempt); perr != nil {
				return gcsClock{}, fmt.Errorf("gcsfence: reading GCS's clock (writing %q): %w", a.o.ClockObject, err)
			}
			continue
		}
		if err != nil {
			return gcsClock{}, fmt.Errorf("gcsfence: reading GCS's clock (writing %q): %w", a.o.ClockObject, err)
		}
		c := gcsClock{at: attrs.Updated, recv: time.Now()}
		if c.at.IsZero() {
			return gcsClock{}, fmt.Errorf("gcsfence: reading GCS's clock: the answer for %q has no updated time", a.o.ClockObject)
		}
		a.mu.Lock()
		a.clockGen = attrs.Generation
		if c.earliest().After(a.clock.earliest()) || a.clock.recv.IsZero() {
			a.clock = c
		}
		a.mu.Unlock()
		return c, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.clockGen = gen
	if read.recv.IsZero() {
		return gcsClock{}, errClockBusy
	}
	if read.earliest().After(a.clock.earliest()) || a.clock.recv.IsZero() {
		a.clock = read
	}
	return read, nil
}

// free reports whether a grant may take o over: it exists and is released, or
// its holder's lease has expired on GCS's clock (by a fresh reading of it).
func (a *Acquirer) free(ctx context.Context, o observed) (bool, error) {
	if o.st.holder == "" {
		return true, nil
	}
	a.mu.Lock()
	c := a.clock
	a.mu.Unlock()
	if !c.recv.IsZero() && time.Since(c.recv) < clockReuse && c.earliest().Before(o.expires()) {
		return false, nil // held, by a recent reading
	}
	c, err := a.now(ctx)
	if isRateLimited(err) || errors.Is(err, errClockBusy) {
		// GCS takes about one write a second per object, and every
		// contender writes the clock object: without a reading, the lock
		// counts as held (Acquire polls again).
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return !c.earliest().Before(o.expires()), nil
}

// TryAcquire grants the lease on name for ttl, or returns fence.ErrHeld at
// once. ttl is within MinAcquirerTTL..MaxAcquirerTTL and longer than Drift;
// name is a GCS object name (with the prefix at most 1024 bytes of UTF-8,
// without NUL, CR or LF), compared byte for byte; others return
// fence.ErrInvalid. A counter at fence.MaxToken returns
// fence.ErrTokensExhausted. A grant whose answer was lost is recognised by
// its nonce and returned; one that cannot be confirmed before ctx ends returns
// an error and is released in the background.
func (a *Acquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check("acquire", ctx, name); err != nil {
		return nil, err
	}
	if err := a.checkTTL(ttl); err != nil {
		return nil, err
	}
	nonce := newID()
	var firstSent time.Time // the first upload that may have landed
	var ambiguous error
	var pending *pendingGrant // the latest upload that may have landed
	created := false
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
		if o.exists && o.st.holder == nonce {
			// An earlier attempt of ours landed; its answer was lost.
			if pending != nil {
				pending.adopted = true
			}
			return a.lease(name, o.st, o.gen, ttl, firstSent), nil
		}
		if !o.exists {
			// The name's first grant, or its object was deleted: create it
			// free and new, then read it again for its creation time.
			_, err := a.write(ctx, name, 0, lockState{owner: a.o.Owner, new: true})
			if err != nil && !isConflict(err) && !mayHaveApplied(err) && !isRateLimited(err) {
				return nil, a.failed("acquire", name, err, ambiguous)
			}
			if !created {
				created = true
				attempt-- // the creation is no retry: MaxAttempts 1 still grants a new name
			}
			continue
		}
		free, err := a.free(ctx, o)
		if err != nil {
			return nil, a.failed("acquire", name, err, ambiguous)
		}
		if !free {
			if ambiguous != nil {
				return nil, a.failed("acquire", name, fence.ErrHeld, ambiguous)
			}
			return nil, fmt.Errorf("gcsfence: acquire %q: %w", name, fence.ErrHeld)
		}
		// Every grant is at least GCS's time at the lock object's last
		// write: a new object's first, and the first after an older
		// generation was restored (its counter back, its updated time the
		// restore's) stay above every token handed out before.
		t, err := creationToken(ctx, o)
		if err != nil {
			return nil, a.failed("acquire", name, err, ambiguous)
		}
		next := max(o.st.token+1, t)
		if !fence.Token(next).Valid() {
			return nil, fmt.Errorf("gcsfence: acquire %q: %w", name, fence.ErrTokensExhausted)
		}
		st := lockState{token: next, holder: nonce, owner: a.o.Owner, ttl: ttl}
		sent := time.Now()
		if firstSent.IsZero() {
			firstSent = sent
		}
		attrs, err := a.write(ctx, name, o.gen, st)
		switch {
		case err == nil:
			pending = nil // a later write was conditional on what the earlier one would have changed
			return a.lease(name, st, attrs.Generation, ttl, firstSent), nil
		case isConflict(err), isRateLimited(err):
			// Someone else wrote in between: read again.
		case mayHaveApplied(err):
			ambiguous = err
			pending = &pendingGrant{gen: o.gen, token: st.token}
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

// creationToken is the floor of a grant's token on lock object o: the time
// of o's last write (GCS's, from the object: its creation for a new object,
// the restore for a restored generation) rounded up to the next
// millisecond, in microseconds, so at or above the true time whatever the
// timestamp's precision. It first waits until GCS's time has passed that
// (a millisecond after the read that saw the object, which was served after
// that write), so the grant lands at or after the time its token stands
// for, and every token stays at or below GCS's time when its grant lands:
// the next new object, created after this one is deleted and so after all
// its grants, starts above all of them, and so does the next grant on a
// generation restored after them.
func creationToken(ctx context.Context, o observed) (uint64, error) {
	floor := o.updated.Truncate(clockResolution).Add(clockResolution)
	if wait := clockResolution - time.Since(o.recv); wait > 0 {
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

// pendingGrant is a grant's upload whose answer was lost: it may have landed,
// or may still land, on the lock object's generation gen.
type pendingGrant struct {
	gen     int64
	token   uint64
	adopted bool // recognised as granted: the caller holds it
}

// abandon frees the lock from a grant that was given up after an ambiguous
// upload, in the background: it writes a free state conditional on the same
// generation as the pending upload, so an upload still on its way can no
// longer land; if the pending upload landed first, it releases that grant
// (recognised by its nonce). It stops when the lock is free of this grant, or
// after the grant's ttl (at most a minute) and 5s.
func (a *Acquirer) abandon(name, nonce string, p pendingGrant, ttl time.Duration) {
	// However it ends, the lock may be free now: the head of the line tries.
	defer a.line.Poke(name)
	ctx, cancel := context.WithTimeout(context.Background(), min(ttl, time.Minute)+5*time.Second)
	defer cancel()
	gen := p.gen
	for attempt := 0; ctx.Err() == nil; attempt++ {
		_, err := a.write(ctx, name, gen, lockState{token: p.token, owner: a.o.Owner})
		if err == nil {
			return
		}
		if isConflict(err) || mayHaveApplied(err) || isRateLimited(err) {
			o, rerr := a.read(ctx, name)
			switch {
			case rerr != nil:
			case o.exists && o.st.holder == nonce:
				gen = o.gen // our grant landed: release it
			case !o.exists || o.gen != p.gen:
				return // the object changed since: the pending upload cannot land
			}
		}
		if pause(ctx, attempt) != nil {
			return
		}
	}
}

// failed wraps err. After an ambiguous upload the grant may exist (under this
// call's nonce): TryAcquire then frees it in the background (abandon).
func (a *Acquirer) failed(op, name string, err, ambiguous error) error {
	if ambiguous != nil {
		return fmt.Errorf("gcsfence: %s %q: %w (an earlier attempt may have been granted; it is being released: %v)", op, name, err, ambiguous)
	}
	return fmt.Errorf("gcsfence: %s %q: %w", op, name, err)
}

// pause paces the retries of one request after a conflict.
func pause(ctx context.Context, attempt int) error {
	return fence.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}.Sleep(ctx, attempt)
}

func (a *Acquirer) lease(name string, st lockState, gen int64, ttl time.Duration, sent time.Time) *lease {
	return &lease{Base: leasekit.New(name, fence.Token(st.token), ttl, a.o.Drift, sent), a: a, st: st, gen: gen}
}

// Acquire waits until the lease on name is granted, polling the lock object
// with the acquirer's Backoff. See fence.Acquirer and TryAcquire.
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
// grant), the time left on GCS's clock (by a fresh reading of it, when held),
// and its counter. A name without a lock object returns fence.ErrNotFound.
func (a *Acquirer) Inspect(ctx context.Context, name string) (fence.LockInfo, error) {
	if err := a.check("inspect", ctx, name); err != nil {
		return fence.LockInfo{}, err
	}
	o, err := a.read(ctx, name)
	if err != nil {
		return fence.LockInfo{}, fmt.Errorf("gcsfence: inspect %q: %w", name, err)
	}
	if !o.exists {
		return fence.LockInfo{}, fmt.Errorf("gcsfence: inspect %q: %w", name, fence.ErrNotFound)
	}
	info := fence.LockInfo{Name: name, Counter: fence.Token(o.st.token)}
	if o.st.holder != "" {
		c, err := a.now(ctx)
		if err != nil {
			return fence.LockInfo{}, fmt.Errorf("gcsfence: inspect %q: %w", name, err)
		}
		if left := o.expires().Sub(c.earliest()); left > 0 {
			info.Held, info.Token, info.Owner, info.TimeLeft = true, fence.Token(o.st.token), o.st.owner, left
		}
	}
	return info, nil
}

// lease is one grant: the lock object's state and generation as this holder
// wrote them last.
type lease struct {
	*leasekit.Base
	a *Acquirer

	mu  sync.Mutex
	st  lockState
	gen int64
}

// Renew extends the lease by its ttl from the moment GCS stores the renewal,
// with an upload conditional on the holder's generation. See fence.Lease. A
// lease whose context is done (released, lost, or past its local deadline)
// returns fence.ErrLost without writing, so a late Renew never holds the lock
// again; a renewal that GCS confirms only after the local deadline passed is
// undone with a release. A renewal that may have landed but could not be
// confirmed returns an error matching fence.ErrUnknown, and the lease still
// ends at its local deadline.
func (l *lease) Renew(ctx context.Context) error {
	if err := leasekit.CheckContext("renew", ctx); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var ambiguous error // an upload of the renewal that may have landed
	for attempt := 0; attempt < l.a.o.MaxAttempts; attempt++ {
		if l.Context().Err() != nil {
			return l.lost()
		}
		sent := time.Now()
		attrs, err := l.a.write(ctx, l.Name(), l.gen, l.st)
		if err == nil {
			l.gen = attrs.Generation
			if !l.Extend(sent) {
				// Confirmed too late: the holder has stopped; free the lock at
				// once rather than leave it held for a ttl.
				if _, err := l.a.write(ctx, l.Name(), l.gen, lockState{token: l.st.token, owner: l.st.owner}); err != nil {
					go l.a.abandon(l.Name(), l.st.holder, pendingGrant{gen: l.gen, token: l.st.token}, l.TTL())
				}
				return l.lost()
			}
			return nil
		}
		if !isConflict(err) && !mayHaveApplied(err) && !isRateLimited(err) {
			return fmt.Errorf("gcsfence: renew %q: %w", l.Name(), err)
		}
		if mayHaveApplied(err) {
			ambiguous = err
		}
		o, rerr := l.a.read(ctx, l.Name())
		if rerr != nil {
			return fmt.Errorf("gcsfence: renew %q: %w: %w (after %v)", l.Name(), fence.ErrUnknown, rerr, err)
		}
		if !o.exists || o.st.holder != l.st.holder || o.st.token != l.st.token {
			l.End(fence.ErrLost)
			return l.lost()
		}
		// Still ours: our write landed (its answer was lost) or not. Take the
		// current generation and write again; the local deadline moves only
		// when a write is confirmed.
		l.gen = o.gen
		if err := pause(ctx, attempt); err != nil {
			return l.renewFailed(err, ambiguous)
		}
	}
	return l.renewFailed(fmt.Errorf("%d attempts: %w", l.a.o.MaxAttempts, ErrContention), ambiguous)
}

// renewFailed wraps err for a Renew that gave up; after an upload that may
// have landed (ambiguous), it matches fence.ErrUnknown.
func (l *lease) renewFailed(err, ambiguous error) error {
	if ambiguous != nil {
		return fmt.Errorf("gcsfence: renew %q: %w: a renewal may have landed (%v): %w", l.Name(), fence.ErrUnknown, ambiguous, err)
	}
	return fmt.Errorf("gcsfence: renew %q: %w", l.Name(), err)
}

// Release frees the lock, keeping its counter, with an upload conditional on
// the holder's generation; fence.ErrLost if another grant holds it or the
// lease had already ended, but an error matching fence.ErrUnknown when
// another grant holds it after an upload of the release that may have landed
// (the release may have freed it). The lease's context is done afterwards. A release
// that cannot be confirmed goes on in the background until the lock is free
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
	live := l.Context().Err() == nil
	var ambiguous error // an upload of the release that may have landed
	for attempt := 0; attempt < l.a.o.MaxAttempts; attempt++ {
		_, err := l.a.write(ctx, l.Name(), l.gen, lockState{token: l.st.token, owner: l.st.owner})
		if err == nil {
			return l.released()
		}
		if !isConflict(err) && !mayHaveApplied(err) && !isRateLimited(err) {
			return fmt.Errorf("gcsfence: release %q: %w", l.Name(), err)
		}
		if mayHaveApplied(err) {
			ambiguous = err
		}
		o, rerr := l.a.read(ctx, l.Name())
		if rerr != nil {
			return l.releaseLater(fmt.Errorf("%w (after %v)", rerr, err))
		}
		switch {
		case o.exists && o.st.token == l.st.token && o.st.holder == "":
			return l.released() // our release landed; its answer was lost
		case !o.exists || o.st.token != l.st.token || o.st.holder != l.st.holder:
			if ambiguous != nil && live {
				// Our release may have landed and the lock been granted
				// since: that is not a lost lease.
				return fmt.Errorf("gcsfence: release %q: %w: another grant holds the lock after an upload of the release that may have landed (%v)", l.Name(), fence.ErrUnknown, ambiguous)
			}
			return l.lost()
		}
		l.gen = o.gen // still ours: release against the current generation
		if err := pause(ctx, attempt); err != nil {
			return l.releaseLater(err)
		}
	}
	return l.releaseLater(fmt.Errorf("%d attempts: %w", l.a.o.MaxAttempts, ErrContention))
}

// releaseLater is Release's result when it could not confirm that the lock is
// free: the release goes on in the background (conditional on the holder's
// generation, so it never frees another grant), and Release returns an error
// matching fence.ErrUnknown.
func (l *lease) releaseLater(err error) error {
	go l.a.abandon(l.Name(), l.st.holder, pendingGrant{gen: l.gen, token: l.st.token}, l.TTL())
	return fmt.Errorf("gcsfence: release %q: %w: %w (it goes on in the background)", l.Name(), fence.ErrUnknown, err)
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
	return fmt.Errorf("gcsfence: lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}
