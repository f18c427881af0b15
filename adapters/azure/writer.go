package azfence

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/streaming"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/bloberror"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blockblob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/objenvelope"
	"github.com/fencekit/fencekit/internal/objkey"
)

// Metadata keys stored with every blob this package writes (x-ms-meta-*;
// Azure compares metadata names case-insensitively, these are lower case).
const (
	MetaToken   = "fencetoken"
	MetaWriteID = "fencewrite"
	MetaDeleted = "fencedeleted"
)

// TagWriteID is the blob index tag holding the write id of the blob's last
// fenced write; conditional writes require it (x-ms-if-tags, which Azurite
// ignores).
const TagWriteID = "fencewrite"

// MaxKeyBytes is Azure's limit on a blob name, in bytes (1024 characters; a
// name is kept at 1024 bytes of UTF-8 here). The writer's Prefix counts
// towards it.
const MaxKeyBytes = 1024

// ErrUnfenced is returned, with RefuseUnfenced, for a blob that has no token.
var ErrUnfenced = errors.New("azfence: blob was not written by a fenced writer")

// ErrContention is returned when other writers changed the blob between every
// read and write of MaxAttempts attempts.
var ErrContention = errors.New("azfence: blob kept changing under the write")

// WriterOptions configures a Writer. A nil *WriterOptions means the defaults.
type WriterOptions struct {
	// Prefix is put before every key. Default: "".
	Prefix string
	// MaxAttempts bounds how often a write reads and tries again after another
	// writer got in between. Default: 8.
	MaxAttempts int
	// RefuseUnfenced makes writes to (and reads of) blobs without a token fail
	// with ErrUnfenced instead of treating them as token 0. Default: false.
	RefuseUnfenced bool
}

// Writer is a fence.FencedWriter, fence.Reader and fence.Deleter on one
// container. It is safe for concurrent use.
type Writer struct {
	c *container.Client
	o WriterOptions
}

var (
	_ fence.FencedWriter = (*Writer)(nil)
	_ fence.Reader       = (*Writer)(nil)
	_ fence.Deleter      = (*Writer)(nil)
)

// NewWriter returns a Writer on the container c (which must exist). It
// returns an error matching fence.ErrInvalid for a nil client, a negative
// MaxAttempts or a Prefix that is not UTF-8, holds a NUL or a backslash, has a
// path segment "." or "..", or leaves no room for a key.
func NewWriter(c *container.Client, opts *WriterOptions) (*Writer, error) {
	if c == nil {
		return nil, &fence.InvalidError{Op: "new writer", Arg: "container client", Reason: "nil"}
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
		if err := checkPrefix("new writer", o.Prefix); err != nil {
			return nil, err
		}
	}
	return &Writer{c: c, o: o}, nil
}

// checkName refuses text Azure cannot store byte for byte as (part of) a blob
// name: not UTF-8, NUL, longer than max bytes, or (checked by checkBlobName)
// ending in a dot or slash, which Azure drops.
func checkName(op, arg, s string, max int) error {
	if err := leasekit.CheckText(op, arg, s, max); err != nil {
		return err
	}
	if strings.ContainsAny(s, "\\") {
		// Azure turns a backslash in a blob name into a slash.
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "a backslash (Azure stores it as a slash)"}
	}
	return nil
}

// checkPrefix refuses a Prefix that makes every blob name one Azure would
// change: a whole path segment (every segment but the last, which the name
// continues) that is empty, "." or "..".
func checkPrefix(op, prefix string) error {
	return objkey.CheckPrefix(op, "Prefix", prefix)
}

// checkBlobName refuses a whole blob name Azure would change: one ending in a
// dot or a slash (dropped), or with a path segment that is empty, "." or
// "..".
func checkBlobName(op, arg, name string) error {
	if strings.HasSuffix(name, ".") || strings.HasSuffix(name, "/") {
		return &fence.InvalidError{Op: op, Arg: arg, Reason: "ends in a dot or slash, which Azure drops"}
	}
	return objkey.CheckPath(op, arg, name)
}

// state is what a blob's properties tell.
type state struct {
	exists   bool
	etag     azcore.ETag
	token    fence.Token
	unfenced bool
	writeID  string
	// envWriteID is the write id of the body's envelope: metadata replaced
	// by another tool may have lost or changed the one in writeID.
	envWriteID string
}

// tagWriteID is the write id the blob's TagWriteID tag holds: the
// envelope's, which metadata replaced by another tool does not change.
func (st state) tagWriteID() string {
	if st.envWriteID != "" {
		return st.envWriteID
	}
	return st.writeID
}

// wrote reports whether the blob is the write with write id id.
func (st state) wrote(id string) bool {
	return st.exists && (st.writeID == id || st.envWriteID == id)
}

func (w *Writer) blobName(key string) string { return w.o.Prefix + key }

func (w *Writer) checkKey(op string, ctx context.Context, key string) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if err := checkName(op, "key", key, MaxKeyBytes-len(w.o.Prefix)); err != nil {
		return err
	}
	return checkBlobName(op, "key", w.blobName(key))
}

// meta returns metadata value k, whatever case the server returned it in.
func meta(m map[string]*string, k string) (string, bool) {
	for mk, v := range m {
		if strings.EqualFold(mk, k) && v != nil {
			return *v, true
		}
	}
	return "", false
}

// envelopeHead is how many bytes of a blob hold its envelope's header line
// (about 60: magic, token, write id, "deleted").
const envelopeHead = 128

func (w *Writer) head(ctx context.Context, key string) (state, error) {
	bc := w.c.NewBlobClient(w.blobName(key))
	for attempt := 0; ; attempt++ {
		p, err := bc.GetProperties(ctx, nil)
		if err != nil {
			if isNotFound(err) {
				return state{}, nil
			}
			return state{}, err
		}
		st := state{exists: true}
		if p.ETag != nil {
			st.etag = *p.ETag
		}
		st.writeID, _ = meta(p.Metadata, MetaWriteID)
		if t, ok := meta(p.Metadata, MetaToken); ok {
			n, err := strconv.ParseUint(t, 10, 64)
			if err != nil || !fence.Token(n).Valid() {
				return state{}, fmt.Errorf("azfence: blob %q has a malformed %s %q", key, MetaToken, t)
			}
			st.token = fence.Token(n)
		} else {
			st.unfenced = true
		}
		// The metadata alone is not the fence: Set Blob Metadata by another
		// tool replaces all of it, and may drop or lower the token. The
		// envelope in the body still holds it: the token is the larger.
		if p.ContentLength == nil || *p.ContentLength < int64(len("fencekit-v1 1 x\n")) {
			return st, nil
		}
		e, same, err := w.bodyHeader(ctx, bc, st.etag)
		switch {
		case err != nil:
			return state{}, err
		case !same && attempt < 8:
			continue // written in between: read again
		case !same:
			return state{}, ErrContention
		case e != nil:
			st.unfenced = false
			st.token = max(st.token, e.Token)
			st.envWriteID = e.WriteID
		}
		return st, nil
	}
}

// bodyHeader reads the envelope header at the start of the blob, reporting
// whether the blob still had ETag etag; nil for a body without an envelope.
func (w *Writer) bodyHeader(ctx context.Context, bc *blob.Client, etag azcore.ETag) (*objenvelope.Envelope, bool, error) {
	out, err := bc.DownloadStream(ctx, &blob.DownloadStreamOptions{Range: blob.HTTPRange{Count: envelopeHead}})
	if err != nil {
		if isNotFound(err) {
			return nil, false, nil
		}
		return nil, false, err
	}
	defer out.Body.Close()
	b, err := io.ReadAll(out.Body)
	if err != nil {
		return nil, false, err
	}
	if out.ETag == nil || *out.ETag != etag {
		return nil, false, nil
	}
	if nl := bytes.IndexByte(b, '\n'); nl >= 0 {
		b = b[:nl+1] // the header alone: a tombstone's, or a value's cut at the range
	}
	e, err := objenvelope.Parse(b)
	if err != nil {
		return nil, true, nil
	}
	return &e, true, nil
}

// Write stores value under key unless the blob holds a larger token. It
// returns *fence.StaleError for a lower token, an error matching
// fence.ErrUnknown when an attempt may have been applied but could not be
// confirmed, ErrContention after MaxAttempts conflicts, and fence.ErrInvalid
// for a nil ctx, token 0 or a key Azure cannot store byte for byte.
func (w *Writer) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	return w.put(ctx, "write", key, objenvelope.Envelope{Token: token, Value: value})
}

// Delete replaces the blob with a tombstone that keeps the fence at token,
// unless the blob holds a larger token (errors as Write). Read then returns
// fence.ErrNotFound. The fence lives in the blob: a tombstone (or blob)
// deleted by other means (a lifecycle rule, an operator) takes it along, and
// the next write is accepted with any token.
func (w *Writer) Delete(ctx context.Context, key string, token fence.Token) error {
	return w.put(ctx, "delete", key, objenvelope.Envelope{Token: token, Deleted: true})
}

func newID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// noRetries turns azcore's retry policy off for requests made with the
// returned context: a conditional request retried after its first attempt
// landed fails its precondition, and only the caller knows to read that as
// "maybe ours".
func noRetries(ctx context.Context) context.Context {
	return policy.WithRetryOptions(ctx, policy.RetryOptions{MaxRetries: -1})
}

func (w *Writer) put(ctx context.Context, op, key string, e objenvelope.Envelope) error {
	if err := w.checkKey(op, ctx, key); err != nil {
		return err
	}
	if err := leasekit.CheckToken(op, e.Token); err != nil {
		return err
	}
	e.WriteID = newID()
	body := e.Encode()
	tok := strconv.FormatUint(uint64(e.Token), 10)
	md := map[string]*string{MetaToken: &tok, MetaWriteID: &e.WriteID}
	if e.Deleted {
		one := "1"
		md[MetaDeleted] = &one
	}
	bc := w.c.NewBlockBlobClient(w.blobName(key))
	var st state
	haveState := false
	var ambiguous error
	for attempt := 0; attempt < w.o.MaxAttempts; attempt++ {
		if !haveState {
			var err error
			if st, err = w.head(ctx, key); err != nil {
				return w.failed(op, key, err, ambiguous)
			}
			if ambiguous != nil && st.wrote(e.WriteID) {
				return nil // an earlier attempt landed
			}
		}
		haveState = false
		if st.unfenced && w.o.RefuseUnfenced {
			return w.failed(op, key, ErrUnfenced, ambiguous)
		}
		if st.token > e.Token {
			if ambiguous != nil {
				return w.failed(op, key, fmt.Errorf("the key now holds token %d (%w)", st.token, ambiguous), ambiguous)
			}
			return &fence.StaleError{Key: key, Offered: e.Token, Current: st.token}
		}
		mac := &blob.ModifiedAccessConditions{}
		if st.exists {
			mac.IfMatch = &st.etag
			if !st.unfenced {
				// ETag and write id: a write in between changed the tag
				// even if its ETag equals the one read.
				cond := fmt.Sprintf("%q = '%s'", TagWriteID, st.tagWriteID())
				mac.IfTags = &cond
			}
		} else {
			any := azcore.ETagAny
			mac.IfNoneMatch = &any
		}
		_, err := bc.Upload(noRetries(ctx), streaming.NopCloser(bytes.NewReader(body)), &blockblob.UploadOptions{
			Metadata: md, Tags: map[string]string{TagWriteID: e.WriteID},
			AccessConditions: &blob.AccessConditions{ModifiedAccessConditions: mac},
		})
		if err == nil {
			return nil
		}
		switch {
		case isConflict(err):
			cur, herr := w.head(ctx, key)
			if herr != nil {
				return w.failed(op, key, herr, ambiguous)
			}
			if cur.wrote(e.WriteID) {
				return nil
			}
			st, haveState = cur, true
			if cur.token <= e.Token {
				// Another writer got in between and we may try again:
				// a jittered pause, so that writers contending for one
				// blob do not keep meeting each other.
				if err := (fence.Backoff{Min: 2 * time.Millisecond, Max: 100 * time.Millisecond}).Sleep(ctx, attempt); err != nil {
					return w.failed(op, key, err, ambiguous)
				}
			}
		case mayHaveApplied(err):
			ambiguous = err
			if ctx.Err() != nil {
				return w.failed(op, key, err, ambiguous)
			}
			if err := (fence.Backoff{Min: 10 * time.Millisecond, Max: 500 * time.Millisecond}).Sleep(ctx, attempt); err != nil {
				return w.failed(op, key, err, ambiguous)
			}
		default:
			return w.failed(op, key, err, ambiguous)
		}
	}
	return w.failed(op, key, fmt.Errorf("%d attempts: %w", w.o.MaxAttempts, ErrContention), ambiguous)
}

// failed wraps err for op on key; after an attempt that may have been applied
// (ambiguous), the error matches fence.ErrUnknown.
func (w *Writer) failed(op, key string, err, ambiguous error) error {
	scrub(err)
	scrub(ambiguous)
	if ambiguous != nil {
		return fmt.Errorf("azfence: %s %q: %w: an attempt may have been applied (%v): %w", op, key, fence.ErrUnknown, ambiguous, err)
	}
	return fmt.Errorf("azfence: %s %q: %w", op, key, err)
}

// Read returns the value stored under key and its token. A key never written
// or deleted returns fence.ErrNotFound. A blob written by another tool
// returns its whole body with token 0 (or ErrUnfenced with RefuseUnfenced).
func (w *Writer) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	if err := w.checkKey("read", ctx, key); err != nil {
		return nil, 0, err
	}
	out, err := w.c.NewBlobClient(w.blobName(key)).DownloadStream(ctx, nil)
	scrub(err)
	if err != nil {
		if isNotFound(err) {
			return nil, 0, fence.ErrNotFound
		}
		return nil, 0, fmt.Errorf("azfence: read %q: %w", key, err)
	}
	defer out.Body.Close()
	b, err := io.ReadAll(out.Body)
	scrub(err)
	if err != nil {
		return nil, 0, fmt.Errorf("azfence: read %q: %w", key, err)
	}
	v, tok, err := objenvelope.Decode(b, w.o.RefuseUnfenced, ErrUnfenced)
	if err != nil && !errors.Is(err, fence.ErrNotFound) {
		return nil, 0, fmt.Errorf("azfence: read %q: %w", key, err)
	}
	return v, tok, err
}

// isConflict reports a failed precondition: 412 (ConditionNotMet, or a lease
// condition), 409 BlobAlreadyExists for If-None-Match: * on a blob created
// in between, or 404 for If-Match on a blob deleted in between.
func isConflict(err error) bool {
	if containerMissing(err) {
		return false
	}
	if bloberror.HasCode(err, bloberror.ConditionNotMet, bloberror.BlobAlreadyExists, bloberror.BlobNotFound) {
		return true
	}
	switch httpStatus(err) {
	case 412, 409, 404:
		return true
	}
	return false
}

// mayHaveApplied reports an error after which the request may have been
// applied: no HTTP response (a broken connection, a timeout, a cancelled
// context) or a 5xx.
func mayHaveApplied(err error) bool {
	if s := httpStatus(err); s != 0 {
		return s >= 500
	}
	return true
}

// scrub hides the signature of a SAS token (the query parameter sig) in the
// URL of every *url.Error in err's tree, in place, before the error is
// wrapped or printed: net/http puts the whole request URL, query included,
// in the error of a request that got no answer.
func scrub(err error) {
	if ue, ok := err.(*url.Error); ok {
		ue.URL = redactURL(ue.URL)
	}
	switch e := err.(type) {
	case interface{ Unwrap() error }:
		scrub(e.Unwrap())
	case interface{ Unwrap() []error }:
		for _, x := range e.Unwrap() {
			scrub(x)
		}
	}
}

// redactURL returns s with the value of its query parameter sig replaced,
// or without its query when it does not parse.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		if i := strings.IndexByte(s, '?'); i >= 0 {
			return s[:i] + "?REDACTED"
		}
		return s
	}
	if q := u.Query(); q.Has("sig") {
		q.Set("sig", "REDACTED")
		u.RawQuery = q.Encode()
	}
	return u.String()
}

// isNotFound reports a blob that does not exist, in a container that does.
func isNotFound(err error) bool {
	return !containerMissing(err) && (bloberror.HasCode(err, bloberror.BlobNotFound) || httpStatus(err) == 404)
}

// containerMissing reports Azure's 404 for a container that does not exist:
// a definite error for every call, never a blob deleted in between.
func containerMissing(err error) bool {
	return bloberror.HasCode(err, bloberror.ContainerNotFound)
}

func httpStatus(err error) int {
	var re *azcore.ResponseError
	if errors.As(err, &re) {
		return re.StatusCode
	}
	return 0
}
