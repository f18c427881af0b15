package gcsfence

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"cloud.google.com/go/storage"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"google.golang.org/api/googleapi"
)

// Custom metadata keys stored with every object the Writer writes.
const (
	MetaToken   = "fence-token"
	MetaWriteID = "fence-write-id"
	MetaDeleted = "fence-deleted"
	// MetaSeal binds the token, write id, tombstone mark and body checksum
	// of one upload: metadata changed after the upload no longer matches it.
	MetaSeal = "fence-seal"
)

// ErrMetadataChanged is returned by Write, Delete and Read for an object
// whose metadata was changed after its upload (an objects.patch by another
// tool): its token no longer matches its seal, or the object has no sealed
// token and a metageneration above 1. Its fence cannot be known, so nothing
// is written; a write after the object's metadata was rewritten by hand
// could otherwise take a lowered or removed token for the fence. The
// Acquirer returns it for a lock object whose metadata was changed in place
// and whose body holds no copy of its state (one written by an older
// version of this package): it grants nothing on it.
var ErrMetadataChanged = errors.New("gcsfence: the object's metadata was changed after its upload; its token cannot be trusted")

// seal is MetaSeal's value for an upload.
func seal(token fence.Token, writeID string, deleted bool, crc uint32) string {
	sum := sha256.Sum256(fmt.Appendf(nil, "fencekit-seal-v1 %d %s %t %d", uint64(token), writeID, deleted, crc))
	return hex.EncodeToString(sum[:16])
}

// MaxKeyBytes is GCS's limit on an object name, in bytes. The Prefix counts
// towards it.
const MaxKeyBytes = 1024

// ErrUnfenced is returned, with RefuseUnfenced, for an object that has no token.
var ErrUnfenced = errors.New("gcsfence: object was not written by a fenced writer")

// ErrLockObject is returned by Write, Delete and Read for an object that an
// Acquirer keeps (a lock object or the clock object, which carry a "fencekit"
// metadata key): a Writer never replaces one, so a key that names one (say
// "fencekit-locks/x" on the locks' bucket) is refused, and nothing is
// written.
var ErrLockObject = errors.New("gcsfence: the object is a fencekit lock or clock object, not a fenced value")

// ErrContention is returned when other writers changed the object between every
// read and write of MaxAttempts attempts.
var ErrContention = errors.New("gcsfence: object kept changing under the write")

// WriterOptions configures a Writer. A nil *WriterOptions means the defaults.
type WriterOptions struct {
	// Prefix is put before every key. Default: "".
	Prefix string
	// MaxAttempts bounds how often a write reads and tries again after another
	// writer got in between. Default: 8.
	MaxAttempts int
	// RefuseUnfenced makes writes to (and reads of) objects without a token fail
	// with ErrUnfenced instead of treating them as token 0. Default: false.
	RefuseUnfenced bool
	// ReuseGeneration skips the read when this Writer made the last write to
	// the key: the upload is conditional on the generation of that write. If
	// someone else wrote since, the upload fails its precondition and the
	// writer reads as usual. Default: false.
	ReuseGeneration bool
}

// Writer is a fence.FencedWriter, fence.Reader and fence.Deleter on one bucket.
// It is safe for concurrent use.
type Writer struct {
	b *storage.BucketHandle
	o WriterOptions

	mu   sync.Mutex
	last map[string]state // with ReuseGeneration: this writer's last write per key
}

var (
	_ fence.FencedWriter = (*Writer)(nil)
	_ fence.Reader       = (*Writer)(nil)
	_ fence.Deleter      = (*Writer)(nil)
)

// NewWriter returns a Writer on bucket. It returns an error matching
// fence.ErrInvalid for a nil bucket or one whose name GCS cannot have, a
// negative MaxAttempts or a Prefix GCS cannot store.
func NewWriter(bucket *storage.BucketHandle, opts *WriterOptions) (*Writer, error) {
	if err := checkBucket("new writer", bucket); err != nil {
		return nil, err
	}
	var o WriterOptions
	if opts != nil {
		o = *opts
	}
	if o.MaxAttempts < 0 {
		return nil, &fence.InvalidError{Op: "new writer", Arg: "MaxAttempts", Reason: "negative"}
	}
	if o.MaxAttempts == 0 {
		o.MaxAttempts = 8
	}
	if o.Prefix != "" {
		if err := checkName("new writer", "Prefix", o.Prefix, MaxKeyBytes-1); err != nil {
			return nil, err
		}
	}
	return &Writer{b: bucket, o: o, last: map[string]state{}}, nil
}

// checkBucket refuses a nil bucket handle, or one whose name GCS cannot
// have: 3..63 bytes of lowercase letters, digits, '-', '_' and '.', starting
// and ending with a letter or digit (up to 222 bytes with dots, each
// dot-separated part at most 63).
func checkBucket(op string, b *storage.BucketHandle) error {
	if b == nil {
		return &fence.InvalidError{Op: op, Arg: "bucket", Reason: "nil"}
	}
	name := b.BucketName()
	bad := func(reason string) error {
		return &fence.InvalidError{Op: op, Arg: "bucket", Reason: fmt.Sprintf("%q %s", name, reason)}
	}
	alnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' }
	switch {
	case len(name) < 3 || len(name) > 222:
		return bad("is not 3..222 bytes long")
	case !alnum(name[0]) || !alnum(name[len(name)-1]):
		return bad("does not start and end with a lowercase letter or digit")
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; !alnum(c) && c != '-' && c != '_' && c != '.' {
			return bad("holds a byte other than a lowercase letter, digit, '-', '_' or '.'")
		}
	}
	for _, part := range strings.Split(name, ".") {
		if len(part) > 63 {
			return bad("has a part longer than 63 bytes")
		}
	}
	return nil
}

// checkName refuses object names GCS cannot store: empty, over maxBytes, not
// UTF-8, with NUL, CR or LF, "." or "..", or under ".well-known/acme-challenge/".
func checkName(op, arg, s string, maxBytes int) error {
	if err := leasekit.CheckText(op, arg, s, maxBytes); err != nil {
		return err
	}
	switch {
	case strings.ContainsAny(s, "\r\n"):
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "holds a carriage return or line feed, which GCS object names cannot"}
	case s == "." || s == "..":
		return &fence.InvalidError{Op: op, Arg: arg, Reason: fmt.Sprintf("%q is not a GCS object name", s)}
	case strings.HasPrefix(s, ".well-known/acme-challenge/"):
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "GCS refuses names under .well-known/acme-challenge/"}
	}
	return nil
}

// state is what an object's attributes tell.
type state struct {
	exists   bool
	gen      int64
	token    fence.Token
	unfenced bool // exists, but written by another tool
	writeID  string
	deleted  bool
}

func (w *Writer) object(key string) *storage.ObjectHandle { return w.b.Object(w.o.Prefix + key) }

func (w *Writer) checkKey(op string, ctx context.Context, key string) error {
	return checkObjectName(op, ctx, "key", w.o.Prefix, key)
}

// checkObjectName refuses a nil ctx, and a key or name (arg) that GCS cannot
// store as the object prefix + s: s must be UTF-8 without NUL, the whole name
// at most MaxKeyBytes bytes, without CR or LF, not "." or "..", and not under
// the ACME path.
func checkObjectName(op string, ctx context.Context, arg, prefix, s string) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if err := leasekit.CheckText(op, arg, s, MaxKeyBytes-len(prefix)); err != nil {
		return err
	}
	return checkName(op, arg, prefix+s, MaxKeyBytes)
}

// stateOf reads the fence from an object's attributes.
func stateOf(key string, a *storage.ObjectAttrs) (state, error) {
	if f, ok := a.Metadata[metaFormat]; ok {
		return state{}, fmt.Errorf("object %q (%s %q): %w", key, metaFormat, f, ErrLockObject)
	}
	st := state{exists: true, gen: a.Generation, writeID: a.Metadata[MetaWriteID], deleted: a.Metadata[MetaDeleted] == "1"}
	sl, sealed := a.Metadata[MetaSeal]
	t, ok := a.Metadata[MetaToken]
	if !sealed && a.Metageneration > 1 {
		// Patched since the upload, and nothing tells whether the token
		// (or its absence) is the upload's.
		return state{}, fmt.Errorf("object %q (metageneration %d): %w", key, a.Metageneration, ErrMetadataChanged)
	}
	if !ok {
		if sealed {
			return state{}, fmt.Errorf("object %q has a %s but no %s: %w", key, MetaSeal, MetaToken, ErrMetadataChanged)
		}
		st.unfenced = true
		return st, nil
	}
	n, err := strconv.ParseUint(t, 10, 64)
	if err != nil || !fence.Token(n).Valid() || strconv.FormatUint(n, 10) != t {
		if sealed {
			return state{}, fmt.Errorf("object %q has a malformed %s %q: %w", key, MetaToken, t, ErrMetadataChanged)
		}
		return state{}, fmt.Errorf("gcsfence: object %q has a malformed %s %q", key, MetaToken, t)
	}
	st.token = fence.Token(n)
	if sealed && sl != seal(st.token, st.writeID, st.deleted, a.CRC32C) {
		return state{}, fmt.Errorf("object %q: %s %d does not match its %s: %w", key, MetaToken, n, MetaSeal, ErrMetadataChanged)
	}
	return st, nil
}

// attrs reads the object's state; a missing object is exists=false.
// (The library retries this read on its own: it changes nothing.)
func (w *Writer) attrs(ctx context.Context, key string) (state, error) {
	a, err := w.object(key).Attrs(ctx)
	if errors.Is(err, storage.ErrObjectNotExist) {
		return state{}, nil
	}
	if err != nil {
		return state{}, err
	}
	return stateOf(key, a)
}

// Write stores value under key unless the object holds a larger token.
// A lower token returns a *fence.StaleError; an outcome the writer could not
// learn returns an error matching fence.ErrUnknown; a key GCS cannot store
// returns fence.ErrInvalid before any request; a key naming an Acquirer's
// lock or clock object returns ErrLockObject, and nothing is written.
func (w *Writer) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	return w.put(ctx, "write", key, value, token, false)
}

// Delete replaces the object with a tombstone (an empty object whose metadata
// keeps the fence at token) unless the object holds a larger token. Read then
// returns fence.ErrNotFound, and a write with a lower token is still stale.
func (w *Writer) Delete(ctx context.Context, key string, token fence.Token) error {
	return w.put(ctx, "delete", key, nil, token, true)
}

func newID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// upload writes body with meta to o, conditional on generation gen (0: the
// object must not exist), without the library's retries: a retried
// conditional upload whose first attempt landed fails its precondition, and
// only the caller knows to read that as "maybe ours". It returns the new
// object's attributes.
func upload(ctx context.Context, o *storage.ObjectHandle, gen int64, body []byte, meta map[string]string) (*storage.ObjectAttrs, error) {
	cond := storage.Conditions{GenerationMatch: gen}
	if gen == 0 {
		cond = storage.Conditions{DoesNotExist: true}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // aborts the upload if Write fails
	wr := o.If(cond).Retryer(storage.WithPolicy(storage.RetryNever)).NewWriter(ctx)
	wr.ChunkSize = 0 // one request, not a resumable session
	wr.Metadata = meta
	wr.ContentType = "application/octet-stream"
	if _, err := wr.Write(body); err != nil {
		_ = wr.Close()
		return nil, err
	}
	if err := wr.Close(); err != nil {
		return nil, err
	}
	return wr.Attrs(), nil
}

func (w *Writer) put(ctx context.Context, op, key string, value []byte, token fence.Token, deleted bool) error {
	if err := w.checkKey(op, ctx, key); err != nil {
		return err
	}
	if err := leasekit.CheckToken(op, token); err != nil {
		return err
	}
	writeID := newID()
	if deleted {
		value = nil
	}
	meta := map[string]string{MetaToken: strconv.FormatUint(uint64(token), 10), MetaWriteID: writeID,
		MetaSeal: seal(token, writeID, deleted, crc32.Checksum(value, crc32.MakeTable(crc32.Castagnoli)))}
	if deleted {
		meta[MetaDeleted] = "1"
	}
	var st state
	haveState := false
	if w.o.ReuseGeneration {
		w.mu.Lock()
		st, haveState = w.last[key]
		w.mu.Unlock()
	}
	// ambiguous is set once an attempt may have been applied without our
	// knowing. From then on a refusal cannot mean "changed nothing".
	var ambiguous error
	for attempt := 0; attempt < w.o.MaxAttempts; attempt++ {
		if !haveState {
			var err error
			if st, err = w.attrs(ctx, key); err != nil {
				return w.failed(op, key, err, ambiguous)
			}
			if ambiguous != nil && st.exists && st.writeID == writeID {
				w.remember(key, st)
				return nil // an earlier attempt landed
			}
		}
		haveState = false
		if st.unfenced && w.o.RefuseUnfenced {
			return w.failed(op, key, ErrUnfenced, ambiguous)
		}
		if st.token > token {
			if ambiguous != nil {
				return w.failed(op, key, fmt.Errorf("the key now holds token %d (%w)", st.token, ambiguous), ambiguous)
			}
			return &fence.StaleError{Key: key, Offered: token, Current: st.token}
		}
		a, err := upload(ctx, w.object(key), st.gen, value, meta)
		if err == nil {
			w.remember(key, state{exists: true, gen: a.Generation, token: token, writeID: writeID, deleted: deleted})
			return nil
		}
		switch {
		case isConflict(err):
			// Someone wrote in between, or our own ambiguous attempt landed:
			// read and decide again.
		case isRateLimited(err):
			// 429: refused, not applied; GCS takes about one write a second
			// per object.
		case mayHaveApplied(err):
			ambiguous = err
			if ctx.Err() != nil {
				return w.failed(op, key, err, ambiguous)
			}
		default:
			// A definite refusal (400, 401, 403, 404): nothing was applied.
			return w.failed(op, key, err, ambiguous)
		}
		if err := (fence.Backoff{Min: 10 * time.Millisecond, Max: 500 * time.Millisecond}).Sleep(ctx, attempt); err != nil {
			return w.failed(op, key, err, ambiguous)
		}
	}
	w.forget(key)
	return w.failed(op, key, fmt.Errorf("%d attempts: %w", w.o.MaxAttempts, ErrContention), ambiguous)
}

// failed wraps err for op on key. After an attempt that may have been applied
// (ambiguous is its error), the error matches fence.ErrUnknown.
func (w *Writer) failed(op, key string, err, ambiguous error) error {
	w.forget(key)
	if ambiguous != nil {
		return fmt.Errorf("gcsfence: %s %q: %w: an attempt may have been applied (%v): %w", op, key, fence.ErrUnknown, ambiguous, err)
	}
	return fmt.Errorf("gcsfence: %s %q: %w", op, key, err)
}

func (w *Writer) remember(key string, st state) {
	if !w.o.ReuseGeneration {
		return
	}
	w.mu.Lock()
	w.last[key] = st
	w.mu.Unlock()
}

func (w *Writer) forget(key string) {
	if !w.o.ReuseGeneration {
		return
	}
	w.mu.Lock()
	delete(w.last, key)
	w.mu.Unlock()
}

// Read returns the value stored under key and its token. A key never written
// or deleted returns fence.ErrNotFound. An object written by another tool
// returns its body with token 0 (or ErrUnfenced with RefuseUnfenced). The body
// is read from the very generation whose attributes gave the token.
func (w *Writer) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	if err := w.checkKey("read", ctx, key); err != nil {
		return nil, 0, err
	}
	for attempt := 0; ; attempt++ {
		st, err := w.attrs(ctx, key)
		if err != nil {
			return nil, 0, fmt.Errorf("gcsfence: read %q: %w", key, err)
		}
		switch {
		case !st.exists || st.deleted:
			return nil, 0, fence.ErrNotFound
		case st.unfenced && w.o.RefuseUnfenced:
			return nil, 0, fmt.Errorf("gcsfence: read %q: %w", key, ErrUnfenced)
		}
		r, err := w.object(key).Generation(st.gen).NewReader(ctx)
		if errors.Is(err, storage.ErrObjectNotExist) && attempt < w.o.MaxAttempts {
			continue // replaced between the two reads
		}
		if err != nil {
			return nil, 0, fmt.Errorf("gcsfence: read %q: %w", key, err)
		}
		b, err := io.ReadAll(r)
		r.Close()
		if err != nil {
			return nil, 0, fmt.Errorf("gcsfence: read %q: %w", key, err)
		}
		if b == nil {
			b = []byte{}
		}
		return b, st.token, nil
	}
}

// httpStatus is the HTTP status of a GCS error, or 0 without an answer.
func httpStatus(err error) int {
	var ge *googleapi.Error
	if errors.As(err, &ge) {
		return ge.Code
	}
	return 0
}

// isConflict reports a failed precondition (412): the object's generation was
// not the one required, or it existed for ifGenerationMatch=0. 409 Conflict
// (a concurrent change GCS refused) counts too.
func isConflict(err error) bool {
	s := httpStatus(err)
	return s == 412 || s == 409
}

// isRateLimited reports 429: too many writes to one object; nothing applied.
func isRateLimited(err error) bool { return httpStatus(err) == 429 }

// mayHaveApplied reports an upload error after which the object may have been
// written: no HTTP answer (a broken connection, a timeout, a cancelled
// context), 408, or a server error (5xx).
func mayHaveApplied(err error) bool {
	if s := httpStatus(err); s != 0 {
		return s >= 500 || s == 408
	}
	return true
}
