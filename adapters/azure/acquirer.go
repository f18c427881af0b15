package azfence

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"bytes"
	"errors"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/streaming"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/bloberror"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blockblob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/lease"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/wakeup"
)

// MaxAcquirerTTL is the longest ttl the acquirer grants: Azure's longest
// finite blob lease. A longer ttl returns an error matching fence.ErrInvalid
// (this package never takes infinite leases: see Acquirer).
const MaxAcquirerTTL = 60 * time.Second

// MinAcquirerTTL is the shortest ttl the acquirer grants (a shorter one
// returns an error matching fence.ErrInvalid): Azure holds every lease for
// 15 s at least, so a shorter local lease only ends the holder's work early.
const MinAcquirerTTL = time.Second

// MinLeaseDuration is Azure's shortest blob lease. A ttl below it is granted
// with a lease of this length on Azure: the holder's lease ends at its ttl
// (its local deadline), but others are refused the name until Azure's lease
// expires, up to MinLeaseDuration after the grant, unless it is released.
const MinLeaseDuration = 15 * time.Second

// MetaOwner is the metadata key of the lock blob holding the owner of the
// latest grant, for operators.
const MetaOwner = "fenceowner"

// AcquirerOptions configures an Acquirer. A nil *AcquirerOptions means the
// defaults.
type AcquirerOptions struct {
	// Prefix starts the name of every lock blob. Default: "fencekit-locks/".
	Prefix string
	// Owner is recorded in the lock blob's metadata: printable ASCII without
	// a space at either end, at most 1024 bytes (fence.ErrInvalid
	// otherwise). Default: host name and process id.
	Owner string
	// Backoff paces Acquire's attempts while the lock is held: each is one
	// Lease Blob request. Default: Min 50ms, Max 1s.
	Backoff fence.Backoff
	// Drift is taken off each lease's local deadline. Default: 1% of the ttl
	// plus 2ms. A ttl not longer than a Drift set here returns an error
	// matching fence.ErrInvalid naming the ttl.
	Drift time.Duration
	// MaxAttempts bounds how often one TryAcquire, Renew or Release sends a
	// request again after an ambiguous answer or a conflict. Default: 8.
	MaxAttempts int
}

// Acquirer grants leases on Azure's native blob leases, one lock blob per
// name, with the fencing token kept in the lock blob's metadata.
//
// A grant takes the blob's lease (Lease Blob, action acquire) with the
// caller's nonce as the proposed lease ID and a duration of the ttl rounded
// up to whole seconds, at least 15 s. Under that lease it reads the blob's
// token and writes the next one (Set Blob Metadata with the lease ID and
// If-Match on the ETag it read). These are two requests, and that is safe:
// while the lease is held, Azure refuses every write to the blob that does
// not carry the lease ID (412), so nobody else can change the token between
// the read and the write, and the write fails if the lease was lost before
// it landed. The grant is returned only once the token write is confirmed.
// A release (Lease Blob, release) keeps the token. Acquire + release take 4
// requests (acquire, read, write, release); the acquirer remembers the ETag
// and token of its own last write of each name and skips the read when the
// acquire's answer carries that ETag (lease operations do not change it), so
// a name it used last takes 3.
//
// # Time
//
// Expiry is decided by Azure on its own clock: a lease not renewed expires
// its duration after the service handled the acquire or the last renewal.
// The holder's local deadline is measured from before the acquire (or
// renewal) was sent, less Drift, so it passes before Azure's expiry. A ttl
// above 60 s or below 1 s is refused with fence.ErrInvalid; one below 15 s is
// granted on a 15 s lease (see MinLeaseDuration).
//
// # Infinite leases and break
//
// This package never takes an infinite lease (duration -1): one outlives a
// crashed holder until someone breaks it. A blob another tool leased
// (infinitely or not) is held, and TryAcquire returns fence.ErrHeld. Breaking a
// lease (Lease Blob, break, e.g. from the portal or the CLI) ends it on Azure
// at once, while its holder's local deadline still runs: the holder is not
// told until its next Renew (fence.ErrLost), and mutual exclusion is gone for
// that time. Fencing still holds: the next grant's token is larger, so a
// fenced writer refuses the broken holder's writes after the new holder's.
//
// # Tokens when the lock blob is deleted
//
// Deleting a leased blob needs its lease ID, but a break followed by a
// delete (or a container's deletion) removes the token. A grant that finds no
// blob creates it without a token and gives it its first token before taking
// the lease: Azure's clock in microseconds (about 1.7e15; below 2^53 until
// the year 2255), read as the time of a snapshot of the blob (taken and
// deleted at once: 100 ns steps on Azure, 1 ms on Azurite; Date has whole
// seconds). Its token is then above every token a deleted blob handed out,
// provided Azure's clock does not go back between the two blobs, the old
// blob handed out fewer than one token per microsecond of its life, and that
// life (from its first token to the new blob's snapshot) was longer than the
// clock's step.
//
// # Tokens when the lock blob is restored
//
// An operator may restore a lock blob from a snapshot or an older version
// (copied over the base blob), or set its old metadata back (Set Blob
// Metadata, seal included), when no lease is held on it: its counter is then
// below tokens handed out since. Every grant's token is therefore at least
// the blob's Last-Modified (the restore's, after one), in microseconds:
// max(counter+1, Last-Modified), from the answers the grant already gets.
// Last-Modified has whole seconds: the first grant after a restore is above
// every token handed out before, provided Azure's clock does not go back
// and the restore lands in a later second, on Azure's clock, than the last
// grant before it. A restore within the same second may give a token that
// repeats or goes below one handed out before.
//
// # Lost answers
//
// azcore's retry policy is off for every lease and metadata request; the
// acquirer retries itself. An acquire whose answer was lost is sent again
// with the same lease ID: Azure grants it again to the same ID (recognised),
// and refuses another (409). A token write whose answer was lost is
// recognised by its write id. A TryAcquire that gives up after taking (or
// maybe taking) the lease releases it in the background, again and again
// until a release is confirmed or the lease's duration plus 5 s has passed:
// an acquire still in the network for longer than that can hold the name
// until its lease expires. Acquirer is safe for concurrent use.
type Acquirer struct {
	c *container.Client
	o AcquirerOptions

	line wakeup.Line // this acquirer's waiting Acquire calls, per name

	mu   sync.Mutex
	last map[string]lastWrite
}

// lastWrite is this acquirer's last token write to a lock blob.
type lastWrite struct {
	etag  azcore.ETag
	token uint64
}

var _ fence.Acquirer = (*Acquirer)(nil)

// NewAcquirer returns an Acquirer on the container c (which must exist). It
// returns an error matching fence.ErrInvalid for a nil client, or negative
// or invalid options.
func NewAcquirer(c *container.Client, opts *AcquirerOptions) (*Acquirer, error) {
	const op = "new acquirer"
	if c == nil {
		return nil, &fence.InvalidError{Op: op, Arg: "container client", Reason: "nil"}
	}
	var o AcquirerOptions
	if opts != nil {
		o = *opts
	}
	if o.Drift < 0 || o.MaxAttempts < 0 {
		return nil, &fence.InvalidError{Op: op, Arg: "options", Reason: "Drift and MaxAttempts may not be negative"}
	}
	if o.Drift >= MaxAcquirerTTL {
		return nil, &fence.InvalidError{Op: op, Arg: "Drift", Reason: fmt.Sprintf("%v leaves no ttl up to %v", o.Drift, MaxAcquirerTTL)}
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
	if err := checkPrefix(op, o.Prefix); err != nil {
		return nil, err
	}
	if o.Owner == "" {
		host, _ := os.Hostname()
		o.Owner = headerSafe(fmt.Sprintf("%s/%d", host, os.Getpid()))
	}
	if err := checkOwner(op, o.Owner); err != nil {
		return nil, err
	}
	if o.Backoff == (fence.Backoff{}) {
		o.Backoff = fence.Backoff{Min: 50 * time.Millisecond, Max: time.Second}
	}
	if o.MaxAttempts == 0 {
		o.MaxAttempts = 8
	}
	return &Acquirer{c: c, o: o, last: map[string]lastWrite{}}, nil
}

// checkOwner refuses an Owner that cannot be sent as a metadata value the
// way Azure signs and stores it: printable ASCII (a line break or a control
// character is refused by net/http, non-ASCII and spaces at either end fail
// the request's signature), 1 to 1024 bytes.
func checkOwner(op, owner string) error {
	if err := leasekit.CheckText(op, "Owner", owner, 1024); err != nil {
		return err
	}
	if headerSafe(owner) != owner {
		return &fence.InvalidError{Op: op, Arg: "Owner", Reason: "only printable ASCII, without a space at either end, can be sent as blob metadata"}
	}
	return nil
}

// headerSafe returns s with every byte outside printable ASCII replaced by
// '_' and the spaces at either end removed ("_" when nothing is left).
func headerSafe(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c < 0x20 || c > 0x7e {
			b[i] = '_'
		}
	}
	if s = strings.Trim(string(b), " "); s == "" {
		return "_"
	}
	return s
}

func (a *Acquirer) blobName(name string) string { return a.o.Prefix + name }

func (a *Acquirer) check(op string, ctx context.Context, name string) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if err := checkName(op, "name", name, MaxKeyBytes-len(a.o.Prefix)); err != nil {
		return err
	}
	return checkBlobName(op, "name", a.blobName(name))
}

func (a *Acquirer) checkTTL(ttl time.Duration) error {
	if d := a.o.Drift; d > 0 && ttl > 0 && ttl <= d {
		return &fence.InvalidError{Op: "acquire", Arg: "ttl", Reason: fmt.Sprintf("%v is not longer than the acquirer's Drift %v: the lease would be lost at once", ttl, d)}
	}
	return leasekit.CheckTTL("acquire", ttl, MinAcquirerTTL, MaxAcquirerTTL)
}

// leaseSeconds is the Azure lease duration for ttl: whole seconds, rounded
// up, at least 15.
func leaseSeconds(ttl time.Duration) int32 {
	s := int32(math.Ceil(ttl.Seconds()))
	return max(s, int32(MinLeaseDuration/time.Second))
}

// newLeaseID returns a random GUID: Azure's lease IDs are GUIDs.
func newLeaseID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

func (a *Acquirer) leaseClient(name, id string) *lease.BlobClient {
	lc, _ := lease.NewBlobClient(a.c.NewBlobClient(a.blobName(name)), &lease.BlobClientOptions{LeaseID: &id})
	return lc
}

// TryAcquire grants the lease on name for ttl, or returns fence.ErrHeld at
// once. ttl is in [MinAcquirerTTL, MaxAcquirerTTL], 1 s to 60 s
// (fence.ErrInvalid otherwise); name is a blob name
// (UTF-8, no NUL or backslash, not ending in a dot or slash, with the prefix
// at most 1024 bytes), compared byte for byte. A counter at fence.MaxToken
// returns fence.ErrTokensExhausted. A name's first grant (and the first after
// its blob was deleted) creates the blob and reads Azure's clock from a
// snapshot (a few more requests): see "Tokens when the lock blob is deleted". A
// grant that cannot be confirmed returns an error and is released in the
// background (see abandon's bound in "Lost answers"); so is a grant confirmed
// only after its local deadline, which returns an error matching
// fence.ErrLost (it holds nothing; Acquire tries again instead).
func (a *Acquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	if err := a.check("acquire", ctx, name); err != nil {
		return nil, err
	}
	if err := a.checkTTL(ttl); err != nil {
		return nil, err
	}
	id := newLeaseID()
	lc := a.leaseClient(name, id)
	var firstSent time.Time
	var ambiguous error
	created := false
	granted := false // Azure may hold the lease for id
	ok := false
	var etag azcore.ETag   // the blob's ETag as the granted acquire saw it
	var modified time.Time // the blob's Last-Modified as the granted acquire saw it
	defer func() {
		if granted && !ok {
			// An attempt without an answer may still be on its way
			// and land after the give-back: keep releasing.
			go a.abandon(name, id, ttl, ambiguous != nil)
		}
	}()
	for attempt := 0; ; attempt++ {
		if attempt >= a.o.MaxAttempts {
			return nil, a.failed("acquire", name, fmt.Errorf("%d attempts: %w", a.o.MaxAttempts, ErrContention), ambiguous)
		}
		sent := time.Now()
		resp, err := lc.AcquireLease(noRetries(ctx), leaseSeconds(ttl), nil)
		if firstSent.IsZero() {
			// The local deadline counts from the first acquire that may
			// have started Azure's lease.
			firstSent = sent
		}
		if err == nil {
			granted = true
			if resp.ETag != nil {
				etag = *resp.ETag
			}
			if resp.LastModified != nil {
				modified = *resp.LastModified
			}
			break
		}
		switch {
		case isNotFound(err):
			if err := a.create(ctx, name); err != nil {
				return nil, a.failed("acquire", name, err, ambiguous)
			}
			if err := a.stamp(ctx, name); err != nil {
				return nil, a.failed("acquire", name, err, ambiguous)
			}
			if !created {
				created = true
				attempt--
			}
			firstSent = time.Time{}
			continue
		case httpStatus(err) == 409:
			// LeaseAlreadyPresent: another ID holds it. Had an earlier
			// attempt of ours landed, this one would have been granted.
			return nil, fmt.Errorf("azfence: acquire %q: %w", name, fence.ErrHeld)
		case mayHaveApplied(err):
			granted = true // maybe: released in the background if we give up
			ambiguous = err
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
	tok, err := a.advance(ctx, name, id, etag, modified)
	if err != nil {
		return nil, a.failed("acquire", name, err, nil)
	}
	l := &azLease{Base: leasekit.New(name, fence.Token(tok), ttl, a.o.Drift, firstSent), a: a, lc: lc, id: id}
	if l.Context().Err() != nil {
		// Confirmed after its local deadline: nobody would use it.
		return nil, a.failed("acquire", name, errLate, nil)
	}
	ok = true
	return l, nil
}

// create makes name's lock blob, without a token, unless it exists.
func (a *Acquirer) create(ctx context.Context, name string) error {
	anyTag := azcore.ETagAny
	owner := a.o.Owner
	_, err := a.c.NewBlockBlobClient(a.blobName(name)).Upload(ctx, streaming.NopCloser(bytes.NewReader(nil)), &blockblob.UploadOptions{
		Metadata:         map[string]*string{MetaOwner: &owner},
		AccessConditions: &blob.AccessConditions{ModifiedAccessConditions: &blob.ModifiedAccessConditions{IfNoneMatch: &anyTag}},
	})
	if err != nil && !isConflict(err) {
		return err
	}
	return nil
}

// stamp gives a lock blob without a token its first one, before any lease:
// the token from Azure's clock (creationToken). It writes conditional on the
// ETag of the blob it read without a token and without a lease ID: if the
// blob changed, or someone leased it first, the write is refused and the
// grant under the lease takes the token itself (advance).
func (a *Acquirer) stamp(ctx context.Context, name string) error {
	bc := a.c.NewBlobClient(a.blobName(name))
	p, err := bc.GetProperties(ctx, nil)
	if err != nil {
		if isNotFound(err) {
			return nil
		}
		return err
	}
	if _, ok := meta(p.Metadata, MetaToken); ok {
		return nil
	}
	t, err := creationToken(ctx, bc)
	if err != nil {
		return err
	}
	ts, owner, write := strconv.FormatUint(t-1, 10), a.o.Owner, newID()
	sl := lockSeal(ts, write)
	_, err = bc.SetMetadata(noRetries(ctx), map[string]*string{MetaToken: &ts, MetaWriteID: &write, MetaOwner: &owner, metaSeal: &sl}, &blob.SetMetadataOptions{
		AccessConditions: &blob.AccessConditions{ModifiedAccessConditions: &blob.ModifiedAccessConditions{IfMatch: p.ETag}},
	})
	if err != nil && !isConflict(err) && !mayHaveApplied(err) {
		return err
	}
	return nil
}

// metaSeal is the lock blob's metadata key holding lockSeal of its token
// and write id: metadata another tool set (Set Blob Metadata needs no lease
// when none is held) does not match it, and the next grant then floors its
// token at Azure's clock instead of trusting a token that may be lower than
// one already handed out.
const metaSeal = "fenceseal"

// lockSeal hashes a lock blob's token and write id.
func lockSeal(token, write string) string {
	h := sha256.Sum256([]byte(fmt.Sprintf("fencekit lock %d %s %d %s", len(token), token, len(write), write)))
	return hex.EncodeToString(h[:16])
}

// sealed reports whether m's seal matches token and write.
func sealed(m map[string]*string, token, write string) bool {
	sl, ok := meta(m, metaSeal)
	return ok && sl == lockSeal(token, write)
}

var errNoClock = errors.New("azfence: the server's snapshot has no time, and a new lock blob's token needs Azure's clock")

// advance writes the next token of name under the lease id and returns it.
// etag is the blob's ETag from the acquire's answer (lease operations leave
// it alone): when it is the ETag of this acquirer's own last token write, the
// token is known and the read is skipped. modified is the blob's
// Last-Modified from that answer: the token is at least that time (and the
// Last-Modified of a read), in microseconds (lastModifiedFloor).
func (a *Acquirer) advance(ctx context.Context, name, id string, etag azcore.ETag, modified time.Time) (uint64, error) {
	bc := a.c.NewBlobClient(a.blobName(name))
	write := newID()
	a.mu.Lock()
	lw, known := a.last[name]
	a.mu.Unlock()
	known = known && etag != "" && lw.etag == etag
	var ambiguous error
	for attempt := 0; attempt < a.o.MaxAttempts; attempt++ {
		if !known {
			p, err := bc.GetProperties(ctx, nil)
			if err != nil {
				return 0, err
			}
			if w, _ := meta(p.Metadata, MetaWriteID); ambiguous != nil && w == write {
				t, _ := meta(p.Metadata, MetaToken)
				n, _ := strconv.ParseUint(t, 10, 64)
				a.remember(name, *p.ETag, n)
				return n, nil // our write landed; its answer was lost
			}
			lw = lastWrite{etag: *p.ETag}
			if p.LastModified != nil && p.LastModified.After(modified) {
				modified = *p.LastModified
			}
			if t, ok := meta(p.Metadata, MetaToken); ok {
				n, err := strconv.ParseUint(t, 10, 64)
				if err != nil || !fence.Token(n).Valid() {
					return 0, fmt.Errorf("lock blob %q has a malformed %s %q", a.blobName(name), MetaToken, t)
				}
				lw.token = n
				if w, _ := meta(p.Metadata, MetaWriteID); !sealed(p.Metadata, t, w) {
					// Not this package's write (another tool set the
					// metadata, maybe lower, or an older fencekit
					// wrote it): the token cannot be trusted to be
					// the largest handed out. Take Azure's clock as
					// a floor, as for a new blob.
					c, err := creationToken(ctx, bc)
					if err != nil {
						return 0, err
					}
					lw.token = max(lw.token, c-1)
				}
			} else {
				t, err := creationToken(ctx, bc)
				if err != nil {
					return 0, err
				}
				lw.token = t - 1
			}
		}
		known = false
		next := max(lw.token+1, lastModifiedFloor(modified))
		if !fence.Token(next).Valid() {
			return 0, fence.ErrTokensExhausted
		}
		ts, owner := strconv.FormatUint(next, 10), a.o.Owner
		sl := lockSeal(ts, write)
		out, err := bc.SetMetadata(noRetries(ctx), map[string]*string{MetaToken: &ts, MetaWriteID: &write, MetaOwner: &owner, metaSeal: &sl}, &blob.SetMetadataOptions{
			AccessConditions: &blob.AccessConditions{
				LeaseAccessConditions:    &blob.LeaseAccessConditions{LeaseID: &id},
				ModifiedAccessConditions: &blob.ModifiedAccessConditions{IfMatch: &lw.etag},
			},
		})
		if err == nil {
			a.remember(name, *out.ETag, next)
			return next, nil
		}
		switch {
		case bloberror.HasCode(err, bloberror.ConditionNotMet):
			// Our remembered ETag is old, or our lost write landed: read.
		case mayHaveApplied(err):
			ambiguous = err
			if ctx.Err() != nil {
				return 0, err
			}
		default:
			// The lease is gone (412 lease mismatch), or a definite refusal.
			return 0, err
		}
		if err := pause(ctx, attempt); err != nil {
			return 0, err
		}
	}
	return 0, fmt.Errorf("%d attempts: %w", a.o.MaxAttempts, ErrContention)
}

// lastModifiedFloor is the least token a grant takes on a blob last
// modified at t (Azure's clock, whole seconds): t in microseconds. A blob
// copied from a snapshot or an older version, or whose metadata was set
// back, has the Last-Modified of that restore, after every grant before it;
// and t is never ahead of Azure's clock, so no token is ahead of Azure's
// time when its grant lands (given fewer than a million grants a second).
func lastModifiedFloor(t time.Time) uint64 {
	return uint64(max(t.UnixMicro(), 0))
}

func (a *Acquirer) remember(name string, etag azcore.ETag, tok uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.last) > 10000 {
		clear(a.last)
	}
	a.last[name] = lastWrite{etag: etag, token: tok}
}

// creationToken is the first token of a lock blob without one: Azure's
// clock now, read as the time of a snapshot of the blob (x-ms-snapshot: 100ns
// on Azure, milliseconds on Azurite, unlike Date's whole seconds), in
// microseconds, plus one. The snapshot is deleted at once. A newer blob of
// the same name is created after this one was deleted, so after every grant
// this one made: its snapshot is later, and its first token is above this
// blob's tokens as long as they grew by less than one per microsecond of its
// life (one per grant), and the life lasted longer than the clock's step.
func creationToken(ctx context.Context, bc *blob.Client) (uint64, error) {
	out, err := bc.CreateSnapshot(ctx, nil)
	if err != nil {
		return 0, err
	}
	if out.Snapshot == nil {
		return 0, errNoClock
	}
	if sc, err := bc.WithSnapshot(*out.Snapshot); err == nil {
		_, _ = sc.Delete(ctx, nil)
	}
	t, err := time.Parse(time.RFC3339Nano, *out.Snapshot)
	if err != nil || t.UnixMicro() <= 0 {
		return 0, fmt.Errorf("azfence: snapshot time %q: %w", *out.Snapshot, errNoClock)
	}
	return uint64(t.UnixMicro()) + 1, nil
}

// abandon releases lease id on name in the background, for a grant that
// TryAcquire gave up on (or a renewal confirmed too late): an acquire still
// on its way can land afterwards, so it tries until a release is confirmed
// (Azure held the lease for id, and now does not) or the lease's duration
// plus 5 s has passed since it started. Refusals (no lease, or another ID's)
// do not stop it: they are what it sees before a late acquire lands.
//
// With linger (an acquire of id got no answer, and may still be on its way),
// a confirmed release does not end it either: it goes on releasing id, every
// second at most, until that bound, so that an acquire landing after the
// give-back holds the name for a second or so, not for Azure's whole lease.
// An acquire delayed in the network for longer than the bound can still hold
// the name until its lease expires.
func (a *Acquirer) abandon(name, id string, ttl time.Duration, linger bool) {
	// However it ends, the lock may be free now: the head of the line tries.
	defer a.line.Poke(name)
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(leaseSeconds(ttl))*time.Second+5*time.Second)
	defer cancel()
	lc := a.leaseClient(name, id)
	b := fence.Backoff{Min: 10 * time.Millisecond, Max: time.Second}
	for attempt := 0; ctx.Err() == nil; attempt++ {
		if _, err := lc.ReleaseLease(noRetries(ctx), nil); err == nil {
			if !linger {
				return
			}
			a.line.Poke(name)
		}
		if b.Sleep(ctx, attempt) != nil {
			return
		}
	}
}

func (a *Acquirer) failed(op, name string, err, ambiguous error) error {
	scrub(err)
	scrub(ambiguous)
	if ambiguous != nil {
		return fmt.Errorf("azfence: %s %q: %w (an earlier attempt may have been granted; it is being released: %v)", op, name, err, ambiguous)
	}
	return fmt.Errorf("azfence: %s %q: %w", op, name, err)
}

// latePause is how long a waiting Acquire pauses after its n-th late grant
// before it tries again.
var latePause = fence.Backoff{Min: 50 * time.Millisecond, Max: time.Second}

// errLate is TryAcquire's answer for a grant Azure confirmed only after its
// local deadline: it was given back (abandon), and it matches fence.ErrLost.
// A waiting Acquire tries again instead.
var errLate = fmt.Errorf("the grant was confirmed after its local deadline and is being released: %w", fence.ErrLost)

func pause(ctx context.Context, attempt int) error {
	return fence.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}.Sleep(ctx, attempt)
}

// Acquire waits until the lease on name is granted, trying with the
// acquirer's Backoff. See fence.Acquirer and TryAcquire. A grant confirmed
// past its local deadline is released in the background and counts as a
// held name: Acquire pauses (50ms after the first, doubling to 1s) and tries
// again, until ctx ends; between its tries other acquirers can take the name.
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
	late := 0 // late grants so far
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
		if errors.Is(err, errLate) {
			// A grant confirmed past its local deadline holds nothing and
			// is being given back: wait, as for a held name, and try
			// again within ctx (fence.Acquirer: only TryAcquire answers
			// ErrLost for it). The give-back's release wakes the line at
			// once, so the head pauses first (latePause, growing): on a
			// link too slow for the ttl it would otherwise take Azure's
			// lease again at once, again and again, and keep the name
			// from acquirers that could use it.
			if latePause.Sleep(ctx, late) != nil {
				return nil, wakeup.GaveUp(ctx)
			}
			late++
			return nil, fmt.Errorf("%w (%v)", fence.ErrHeld, err)
		}
		return l, err
	})
}

// azLease is one grant: Azure's lease id on the lock blob.
type azLease struct {
	*leasekit.Base
	a  *Acquirer
	lc *lease.BlobClient
	id string
	mu sync.Mutex
}

// Renew renews Azure's lease for its duration. See fence.Lease. A lease whose
// context is done returns fence.ErrLost without a request (Azure would renew
// an expired lease nobody took since, and hold the name again); a lease
// Azure no longer holds for this grant (expired and taken, released, or
// broken) returns fence.ErrLost and ends; a renewal confirmed only after the
// local deadline is released and returns fence.ErrLost; one that may have
// landed but was not confirmed returns an error matching fence.ErrUnknown,
// and the lease still ends at its local deadline.
func (l *azLease) Renew(ctx context.Context) error {
	if err := leasekit.CheckContext("renew", ctx); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var ambiguous error
	for attempt := 0; attempt < l.a.o.MaxAttempts; attempt++ {
		if l.Context().Err() != nil {
			return l.lost()
		}
		sent := time.Now()
		_, err := l.lc.RenewLease(noRetries(ctx), nil)
		if err == nil {
			if !l.Extend(sent) {
				go l.a.abandon(l.Name(), l.id, l.TTL(), false)
				return l.lost()
			}
			return nil
		}
		if !mayHaveApplied(err) {
			if httpStatus(err) == 409 || httpStatus(err) == 412 || httpStatus(err) == 404 {
				l.End(fence.ErrLost)
				return l.lost()
			}
			scrub(err)
			return fmt.Errorf("azfence: renew %q: %w", l.Name(), err)
		}
		ambiguous = err
		if ctx.Err() != nil {
			break
		}
		if err := pause(ctx, attempt); err != nil {
			break
		}
	}
	scrub(ambiguous)
	return fmt.Errorf("azfence: renew %q: %w: not confirmed (%v)", l.Name(), fence.ErrUnknown, ambiguous)
}

// Release releases Azure's lease; the token stays in the blob. fence.ErrLost
// when the lease had already ended (past its local deadline, or another
// grant holds the name). A release that cannot be confirmed goes on in the
// background until Azure's lease has expired, and Release returns an error
// matching fence.ErrUnknown. The lease's context is done afterwards.
func (l *azLease) Release(ctx context.Context) error {
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
	liveAtStart := l.Context().Err() == nil
	var ambiguous error
	for attempt := 0; attempt < l.a.o.MaxAttempts; attempt++ {
		_, err := l.lc.ReleaseLease(noRetries(ctx), nil)
		if err == nil {
			return l.released()
		}
		if !mayHaveApplied(err) {
			if ambiguous != nil && liveAtStart && httpStatus(err) == 409 {
				// Azure no longer holds our lease, and it was live when
				// the first release was sent: that release landed (Azure
				// answers LeaseNotPresentWithLeaseOperation, Azurite
				// LeaseIdMismatchWithLeaseOperation, also when another
				// grant followed).
				return l.released()
			}
			if httpStatus(err) == 409 || httpStatus(err) == 412 || httpStatus(err) == 404 {
				return l.lost()
			}
			scrub(err)
			return fmt.Errorf("azfence: release %q: %w", l.Name(), err)
		}
		ambiguous = err
		if ctx.Err() != nil {
			break
		}
		if err := pause(ctx, attempt); err != nil {
			break
		}
	}
	go l.a.abandon(l.Name(), l.id, l.TTL(), false)
	scrub(ambiguous)
	return fmt.Errorf("azfence: release %q: %w: %v (it goes on in the background)", l.Name(), fence.ErrUnknown, ambiguous)
}

func (l *azLease) released() error {
	if l.Context().Err() != nil && errors.Is(context.Cause(l.Context()), fence.ErrLost) {
		return l.lost()
	}
	return nil
}

func (l *azLease) lost() error {
	return fmt.Errorf("azfence: lease %q token %d: %w", l.Name(), l.Token(), fence.ErrLost)
}
