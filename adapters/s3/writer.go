package s3fence

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"sync"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/objenvelope"
	"github.com/fencekit/fencekit/internal/objkey"
)

// Metadata keys (x-amz-meta-*) stored with every object this package writes.
const (
	MetaToken   = "fence-token"
	MetaWriteID = "fence-write-id"
	MetaDeleted = "fence-deleted"
	// MetaBodyMD5 is the hex MD5 of the object's body: where the server's
	// ETag is that MD5 (a plain single-part PUT), a HEAD whose ETag matches
	// it answered the token and the ETag of one version.
	MetaBodyMD5 = "fence-body-md5"
)

// ErrUnfenced is returned, with RefuseUnfenced, for an object that has no token.
var ErrUnfenced = errors.New("s3fence: object was not written by a fenced writer")

// ErrContention is returned when other writers changed the object between every
// read and write of MaxAttempts attempts, or between 9 HEADs in a row that
// could not be trusted (see Writer.head): nothing was written; try again.
var ErrContention = errors.New("s3fence: object kept changing under the write")

// API is the part of *s3.Client the writer uses.
type API interface {
	HeadObject(ctx context.Context, in *s3.HeadObjectInput, opts ...func(*s3.Options)) (*s3.HeadObjectOutput, error)
	GetObject(ctx context.Context, in *s3.GetObjectInput, opts ...func(*s3.Options)) (*s3.GetObjectOutput, error)
	PutObject(ctx context.Context, in *s3.PutObjectInput, opts ...func(*s3.Options)) (*s3.PutObjectOutput, error)
}

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
	// ReuseETag skips the HEAD when this Writer made the last write to the key:
	// the PUT is conditional on the ETag of that write. If someone else wrote
	// since, the PUT fails its precondition and the writer reads as usual.
	// Default: false.
	ReuseETag bool
}

// Writer is a fence.FencedWriter, fence.Reader and fence.Deleter on one bucket.
// It is safe for concurrent use.
type Writer struct {
	api    API
	bucket string
	o      WriterOptions

	mu   sync.Mutex
	last map[string]state // with ReuseETag: this writer's last write per key
}

var (
	_ fence.FencedWriter = (*Writer)(nil)
	_ fence.Reader       = (*Writer)(nil)
	_ fence.Deleter      = (*Writer)(nil)
)

// NewWriter returns a Writer on bucket. It returns an error matching
// fence.ErrInvalid for an empty bucket name or negative MaxAttempts.
func NewWriter(api API, bucket string, opts *WriterOptions) (*Writer, error) {
	if err := checkTarget("new writer", api, bucket); err != nil {
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
		if err := leasekit.CheckText("new writer", "Prefix", o.Prefix, MaxKeyBytes-1); err != nil {
			return nil, err
		}
		if err := objkey.CheckPrefix("new writer", "Prefix", o.Prefix); err != nil {
			return nil, err
		}
	}
	return &Writer{api: api, bucket: bucket, o: o, last: map[string]state{}}, nil
}

// checkTarget refuses a nil api (also a nil pointer in the interface) and an
// empty bucket, for op.
func checkTarget(op string, api API, bucket string) error {
	if api == nil {
		return &fence.InvalidError{Op: op, Arg: "api", Reason: "nil"}
	}
	if v := reflect.ValueOf(api); v.Kind() == reflect.Pointer && v.IsNil() {
		return &fence.InvalidError{Op: op, Arg: "api", Reason: fmt.Sprintf("nil %T", api)}
	}
	if bucket == "" {
		return &fence.InvalidError{Op: op, Arg: "bucket", Reason: "empty"}
	}
	return nil
}

// state is what a HEAD (and the envelope at the start of the body) tells
// about an object.
type state struct {
	exists   bool
	etag     string
	token    fence.Token
	unfenced bool // exists, but written by another tool
	writeID  string
	// envWriteID is the write id of the body's envelope: metadata replaced
	// in place (CopyObject) may have lost or changed the one in writeID.
	envWriteID string
}

// wrote reports whether the object is the write with write id id.
func (st state) wrote(id string) bool {
	return st.exists && (st.writeID == id || st.envWriteID == id)
}

func (w *Writer) objectKey(key string) string { return w.o.Prefix + key }

// MaxKeyBytes is S3's limit on an object key, in bytes. The writer's Prefix
// counts towards it.
const MaxKeyBytes = 1024

// checkKey refuses a nil ctx, and keys S3 cannot store: the object key
// (Prefix + key) must be UTF-8 of at most MaxKeyBytes bytes, without NUL
// (which the XML of S3's listings cannot carry), and without an empty, "."
// or ".." path segment (which servers storing objects as files resolve).
func (w *Writer) checkKey(op string, ctx context.Context, key string) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if err := leasekit.CheckText(op, "key", key, MaxKeyBytes-len(w.o.Prefix)); err != nil {
		return err
	}
	return objkey.CheckPath(op, "key", w.objectKey(key))
}

// head reads the object's state; a missing object is exists=false.
//
// A server may answer a HEAD with the metadata of one version and the ETag of
// a newer one (versitygw v1.8.0 reads them one after the other while a PUT is
// published between the two reads; a reviewer saw 21 torn answers of 3155
// beside concurrent PUTs). The writer would then
// pair an old token with the current ETag, and a PUT conditional on it would
// replace a newer token. So a HEAD is trusted when its ETag is the MD5 its
// metadata records (MetaBodyMD5); otherwise (a torn answer, an object without
// MetaBodyMD5, a server whose ETag is no MD5) only when a second HEAD gives
// the same ETag and write id: a version published before the first answer's
// ETag was read is, by the second HEAD, also in its metadata.
//
// The metadata alone is not the fence: an in-place CopyObject with
// MetadataDirective REPLACE (S3 and versitygw allow it) keeps the body and
// replaces the metadata. So the token is the larger of the metadata's and the
// body's envelope's, read conditional on the ETag the HEAD gave.
func (w *Writer) head(ctx context.Context, key string) (state, error) {
	var prev state
	for i := range 9 {
		st, md5hex, err := w.headOnce(ctx, key)
		if err != nil || !st.exists {
			return st, err
		}
		if (md5hex != "" && trimETag(st.etag) == md5hex) ||
			(i > 0 && st.etag == prev.etag && st.writeID == prev.writeID && st.token == prev.token) {
			changed, err := w.envelopeHead(ctx, key, &st)
			if err != nil {
				return state{}, err
			}
			if !changed {
				return st, nil
			}
			// Written between the HEAD and the GET: read again.
			prev = state{}
			continue
		}
		prev = st
	}
	return state{}, fmt.Errorf("object %q: 9 HEADs in a row disagreed on its ETag or write id: %w", key, ErrContention)
}

// envelopeHeadBytes is how many bytes at the start of an object hold its
// envelope's header line (about 60: magic, token, write id, "deleted").
const envelopeHeadBytes = 128

// envelopeHead reads the envelope header at the start of the object as it
// is at st.etag, and raises st's token to the envelope's. It reports
// changed when the object no longer has that ETag.
func (w *Writer) envelopeHead(ctx context.Context, key string, st *state) (changed bool, err error) {
	out, err := w.api.GetObject(ctx, &s3.GetObjectInput{Bucket: &w.bucket, Key: aws.String(w.objectKey(key)),
		IfMatch: aws.String(st.etag), Range: aws.String(fmt.Sprintf("bytes=0-%d", envelopeHeadBytes-1))})
	if err != nil {
		switch {
		case isNotFound(err) || isConflict(err):
			return true, nil
		case httpStatus(err) == 416:
			return false, nil // an empty body: no envelope
		}
		return false, err
	}
	defer out.Body.Close()
	b, err := io.ReadAll(io.LimitReader(out.Body, envelopeHeadBytes))
	if err != nil {
		return false, err
	}
	if out.ETag != nil && aws.ToString(out.ETag) != st.etag {
		return true, nil
	}
	if nl := bytes.IndexByte(b, '\n'); nl >= 0 {
		b = b[:nl+1] // the header alone: a tombstone's, or a value's cut at the range
	}
	e, perr := objenvelope.Parse(b)
	if perr != nil {
		return false, nil // another tool's body: the metadata alone tells
	}
	st.unfenced = false
	st.token = max(st.token, e.Token)
	st.envWriteID = e.WriteID
	return false, nil
}

// trimETag drops an ETag's quotes.
func trimETag(etag string) string {
	if len(etag) >= 2 && etag[0] == '"' && etag[len(etag)-1] == '"' {
		return etag[1 : len(etag)-1]
	}
	return etag
}

// headOnce is one HEAD of key: its state, and the MetaBodyMD5 it records.
func (w *Writer) headOnce(ctx context.Context, key string) (state, string, error) {
	out, err := w.api.HeadObject(ctx, &s3.HeadObjectInput{Bucket: &w.bucket, Key: aws.String(w.objectKey(key))})
	if err != nil {
		if isNotFound(err) {
			return state{}, "", nil
		}
		if httpStatus(err) == 400 && w.headsShortKey(ctx) {
			// HEAD carries nothing but the key: a server that refuses it
			// and takes a HEAD of a short key refuses the key (versitygw's
			// posix backend, for one, allows 255 bytes per path segment,
			// below S3's 1024 for a key). One that refuses every HEAD (an
			// expired session token gets 400 with no body) says nothing
			// about the key.
			return state{}, "", fmt.Errorf("%w: the server refused key %q (%d bytes) with 400 Bad Request; it may allow shorter keys than S3's %d bytes: %w",
				fence.ErrInvalid, key, len(key), MaxKeyBytes, err)
		}
		return state{}, "", err
	}
	st := state{exists: true, etag: aws.ToString(out.ETag), writeID: out.Metadata[MetaWriteID]}
	if t, ok := out.Metadata[MetaToken]; ok {
		n, err := strconv.ParseUint(t, 10, 64)
		if err != nil || !fence.Token(n).Valid() {
			return state{}, "", fmt.Errorf("s3fence: object %q has a malformed %s %q", key, MetaToken, t)
		}
		st.token = fence.Token(n)
	} else {
		st.unfenced = true
	}
	return st, out.Metadata[MetaBodyMD5], nil
}

// headsShortKey reports whether the server answers a HEAD of a short key
// (found or not found): after a 400 for a key, that tells the key apart from
// the request (credentials, a proxy).
func (w *Writer) headsShortKey(ctx context.Context) bool {
	_, err := w.api.HeadObject(ctx, &s3.HeadObjectInput{Bucket: &w.bucket, Key: aws.String("fencekit-key-probe")})
	return err == nil || isNotFound(err)
}

// Write stores value under key unless the object holds a larger token.
func (w *Writer) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	return w.put(ctx, "write", key, objenvelope.Envelope{Token: token, Value: value})
}

// Delete replaces the object with a tombstone that keeps the fence at token,
// unless the object holds a larger token. Read then returns fence.ErrNotFound.
func (w *Writer) Delete(ctx context.Context, key string, token fence.Token) error {
	return w.put(ctx, "delete", key, objenvelope.Envelope{Token: token, Deleted: true})
}

func newWriteID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func (w *Writer) put(ctx context.Context, op, key string, e objenvelope.Envelope) error {
	if err := w.checkKey(op, ctx, key); err != nil {
		return err
	}
	if err := leasekit.CheckToken(op, e.Token); err != nil {
		return err
	}
	e.WriteID = newWriteID()
	body := e.Encode()
	sum := md5.Sum(body)
	meta := map[string]string{MetaToken: strconv.FormatUint(uint64(e.Token), 10), MetaWriteID: e.WriteID, MetaBodyMD5: hex.EncodeToString(sum[:])}
	if e.Deleted {
		meta[MetaDeleted] = "1"
	}
	var st state
	haveState := false
	if w.o.ReuseETag {
		w.mu.Lock()
		st, haveState = w.last[key]
		w.mu.Unlock()
	}
	// ambiguous is set once an attempt may have been applied without our
	// knowing (lost response, broken connection, 5xx). From then on, a refusal
	// cannot mean "changed nothing": our value may have landed and been
	// replaced since.
	var ambiguous error
	for attempt := 0; attempt < w.o.MaxAttempts; attempt++ {
		if !haveState {
			var err error
			if st, err = w.head(ctx, key); err != nil {
				return w.failed(op, key, err, ambiguous)
			}
			if ambiguous != nil && st.wrote(e.WriteID) {
				w.remember(key, st)
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
		in := &s3.PutObjectInput{Bucket: &w.bucket, Key: aws.String(w.objectKey(key)),
			Body: bytes.NewReader(body), ContentLength: aws.Int64(int64(len(body))), Metadata: meta}
		if st.exists {
			in.IfMatch = aws.String(st.etag)
		} else {
			in.IfNoneMatch = aws.String("*")
		}
		// No SDK retries: a retried conditional PUT whose first attempt landed
		// fails its precondition, and only this loop knows to read that as
		// "maybe ours".
		out, err := w.api.PutObject(ctx, in, noRetries)
		if err == nil {
			w.remember(key, state{exists: true, etag: aws.ToString(out.ETag), token: e.Token, writeID: e.WriteID})
			return nil
		}
		switch {
		case isConflict(err):
			// Someone wrote in between, or (after an ambiguous attempt) our
			// own write landed: read and decide again.
			cur, herr := w.head(ctx, key)
			if herr != nil {
				return w.failed(op, key, herr, ambiguous)
			}
			if cur.wrote(e.WriteID) {
				w.remember(key, cur)
				return nil
			}
			st, haveState = cur, true
		case mayHaveApplied(err):
			ambiguous = err
			if ctx.Err() != nil {
				return w.failed(op, key, err, ambiguous)
			}
			if err := (fence.Backoff{Min: 10 * time.Millisecond, Max: 500 * time.Millisecond}).Sleep(ctx, attempt); err != nil {
				return w.failed(op, key, err, ambiguous)
			}
		default:
			// A definite refusal (400, 403, ...): nothing was applied by this
			// attempt.
			return w.failed(op, key, err, ambiguous)
		}
	}
	w.forget(key)
	return w.failed(op, key, fmt.Errorf("%d attempts: %w", w.o.MaxAttempts, ErrContention), ambiguous)
}

// noRetries turns the SDK's retries off for one operation.
func noRetries(o *s3.Options) { o.Retryer = aws.NopRetryer{} }

// failed wraps err for op on key. After an attempt that may have been applied
// (ambiguous is its error), the outcome is unknown: the error matches
// fence.ErrUnknown, whatever ended the write.
func (w *Writer) failed(op, key string, err, ambiguous error) error {
	w.forget(key)
	if ambiguous != nil {
		return fmt.Errorf("s3fence: %s %q: %w: an attempt may have been applied (%v): %w", op, key, fence.ErrUnknown, ambiguous, err)
	}
	return fmt.Errorf("s3fence: %s %q: %w", op, key, err)
}

// mayHaveApplied reports a PUT error after which the object may have been
// written: no HTTP response (a broken connection, a timeout, a cancelled
// context) or a server error (5xx).
func mayHaveApplied(err error) bool {
	if s := httpStatus(err); s != 0 {
		return s >= 500
	}
	var ae smithy.APIError
	if errors.As(err, &ae) && ae.ErrorFault() == smithy.FaultClient {
		return false
	}
	return true
}

func (w *Writer) remember(key string, st state) {
	if !w.o.ReuseETag {
		return
	}
	w.mu.Lock()
	w.last[key] = st
	w.mu.Unlock()
}

func (w *Writer) forget(key string) {
	if !w.o.ReuseETag {
		return
	}
	w.mu.Lock()
	delete(w.last, key)
	w.mu.Unlock()
}

// Read returns the value stored under key and its token. A key never written or
// deleted returns fence.ErrNotFound. An object written by another tool returns
// its whole body with token 0 (or ErrUnfenced with RefuseUnfenced).
func (w *Writer) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	if err := w.checkKey("read", ctx, key); err != nil {
		return nil, 0, err
	}
	out, err := w.api.GetObject(ctx, &s3.GetObjectInput{Bucket: &w.bucket, Key: aws.String(w.objectKey(key))})
	if err != nil {
		if isNotFound(err) {
			return nil, 0, fence.ErrNotFound
		}
		return nil, 0, fmt.Errorf("s3fence: read %q: %w", key, err)
	}
	defer out.Body.Close()
	b, err := io.ReadAll(out.Body)
	if err != nil {
		return nil, 0, fmt.Errorf("s3fence: read %q: %w", key, err)
	}
	v, tok, err := objenvelope.Decode(b, w.o.RefuseUnfenced, ErrUnfenced)
	if err != nil && !errors.Is(err, fence.ErrNotFound) {
		return nil, 0, fmt.Errorf("s3fence: read %q: %w", key, err)
	}
	return v, tok, err
}

// isConflict reports a failed precondition: 412 PreconditionFailed, 409
// ConditionalRequestConflict, or NoSuchKey for If-Match on a key deleted in
// between.
func isConflict(err error) bool {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		switch ae.ErrorCode() {
		case "PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey":
			return true
		}
	}
	switch httpStatus(err) {
	case 412, 409:
		return true
	}
	return false
}

func isNotFound(err error) bool {
	var nk *types.NoSuchKey
	var nf *types.NotFound
	if errors.As(err, &nk) || errors.As(err, &nf) {
		return true
	}
	var ae smithy.APIError
	if errors.As(err, &ae) && (ae.ErrorCode() == "NoSuchKey" || ae.ErrorCode() == "NotFound") {
		return true
	}
	return httpStatus(err) == 404
}

func httpStatus(err error) int {
	var re *awshttp.ResponseError
	if errors.As(err, &re) {
		return re.HTTPStatusCode()
	}
	return 0
}
