// Package s3fence fences writes to S3 (and S3-compatible stores) with conditional
// PUTs: If-Match on the ETag that was read, or If-None-Match: * for a new key,
// and grants leases from lock objects with conditional PUTs alone.
//
//   - [Writer] (made by [NewWriter], configured by [WriterOptions]): a
//     fence.FencedWriter, fence.Reader and fence.Deleter on one bucket.
//   - [Acquirer] (made by [NewAcquirer], configured by [AcquirerOptions]):
//     leases whose expiry is decided on S3's clock.
//
// A write reads the object's current token and ETag (HEAD, then the
// envelope at the start of the body, conditional on that ETag: the token is
// the larger of the metadata's and the envelope's, so metadata replaced in
// place by CopyObject never lowers the fence), refuses a stale token, and PUTs with If-Match on that ETag: if anyone wrote in between, the PUT
// fails with 412 (or 409 ConditionalRequestConflict) and the writer reads again
// and decides again, a bounded number of times. Three corners are handled:
//
//   - ETag reuse (ABA): an ETag reflects the body only. Every stored body begins
//     with a header holding the token and a random write id, so no two writes
//     share an ETag, even when a newer grant stores byte-identical data.
//   - Ambiguous attempts: a PUT whose response was lost (or that got a 5xx) may
//     have been applied. The SDK's own retries are off for the PUT; the writer
//     retries itself, and on every read after such an attempt checks whether
//     the stored object is its own write (by write id): if so, the write
//     succeeded. If instead a newer token is stored, or the write ends for any
//     other reason, the error matches fence.ErrUnknown, never fence.ErrStale:
//     the value may have landed before it was replaced.
//   - Objects written by other tools have no token: they count as token 0 (any
//     fenced write may replace them), or are refused with
//     [WriterOptions.RefuseUnfenced].
//
// Keys and lock names map to object names byte for byte (Prefix + key). A
// key or name whose object name has an empty path segment ("a//b", a slash
// at either end) or a "." or ".." segment is refused with fence.ErrInvalid
// before any request, rather than encoded: servers that store objects as
// files resolve such names, so two keys would share one object.
//
// # Leases
//
// Acquirer grants leases from one lock object per name in the bucket, with
// conditional PUTs alone. Expiry is decided on S3's clock as its Date header
// tells it (whole seconds; [AcquirerOptions.DateLag] allows for a Date served late), never on
// the client's wall clock. Tokens keep growing after a lock object is deleted
// as long as S3's clock never goes back and its Date is at most DateLag behind
// it beyond whole seconds; after an older version of a lock object is
// restored, as long as also the next grant reads it more than a second plus
// DateLag after the last grant before the restore (every grant's token is at
// least its read's Date, in microseconds). A Renew after the lease's local deadline returns
// fence.ErrLost and writes nothing. See [Acquirer].
//
// [Writer] detects S3 errors by their codes (smithy.APIError) and HTTP status,
// never by their messages.
package s3fence
