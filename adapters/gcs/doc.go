// Package gcsfence fences writes to Google Cloud Storage with generation
// preconditions, and grants leases from lock objects in a bucket, with
// cloud.google.com/go/storage.
//
//   - [Writer] (made by [NewWriter], configured by [WriterOptions]): a
//     fence.FencedWriter, fence.Reader and fence.Deleter on one bucket.
//   - [Acquirer] (made by [NewAcquirer], configured by [AcquirerOptions]):
//     leases whose expiry is decided on GCS's clock.
//
// # Fenced writes
//
// A write reads the object's attributes (its generation and the token in its
// metadata), refuses a stale token, and uploads the value with
// ifGenerationMatch on the generation it read (ifGenerationMatch=0, "does not
// exist", for a new object): if anyone wrote in between, the upload fails with
// 412 and the writer reads again and decides again, a bounded number of times.
// The value is the object's body, byte for byte; the token and a random write
// id are in the object's custom metadata, written in the same request, so the
// body and its token are one generation.
//
// GCS never reuses a generation for a name: every upload (even of identical
// bytes, even after the object was deleted) gets a new one. So
// ifGenerationMatch on a generation read before a newer write can never match
// after it, and the writer needs nothing against ABA, unlike an S3 ETag, which
// reflects the body only.
//
//   - Ambiguous attempts: an upload whose response was lost (or that got a 5xx
//     or a 408) may have been applied. cloud.google.com/go/storage retries
//     uploads on its own when they are "idempotent" to it, which any upload
//     with a generation precondition is: by default (RetryIdempotent) on 408,
//     429 and 5xx answers, io.ErrUnexpectedEOF, and connection resets,
//     refusals and broken pipes. It can do so when it buffers the body (the
//     default ChunkSize of 16 MiB: TestLibraryRetries sees a conditional
//     upload answered 503 sent twice and reported as a success); a retry of
//     an attempt that landed fails with 412. The writer uploads in one request
//     (ChunkSize 0, which the library cannot resend) with RetryNever, and
//     retries itself: on every read after an ambiguous attempt it checks
//     whether the stored generation is its own write (by write id), and if so
//     the write succeeded. If instead a newer token is stored, or the write
//     ends for any other reason, the error matches fence.ErrUnknown, never
//     fence.ErrStale: the value may have landed before it was replaced. Reads
//     of attributes and bodies keep the library's retries: they change nothing.
//   - An object deleted other than by Delete (by hand, by a lifecycle rule)
//     takes its token with it: the next write of any token creates it again.
//     Keep lifecycle deletes off the keys you fence.
//   - Objects written by other tools have no token: they count as token 0 (any
//     fenced write may replace them), or are refused with
//     [WriterOptions.RefuseUnfenced].
//   - Metadata changed after the upload (objects.patch by another tool keeps
//     the body and generation) could drop or lower the token. Every upload
//     also stores a seal ([MetaSeal]) over its token, write id and body
//     checksum; an object whose token does not match its seal, or that has
//     no seal and a metageneration above 1, is refused with
//     [ErrMetadataChanged], and nothing is written.
//
// Keys and lock names map to object names byte for byte (Prefix + key). GCS
// keeps "a//b", "a/./b" and "a/../b" apart from "a/b" (its names are flat
// strings), so they are accepted; the suites check that they stay distinct.
//
// # Leases
//
// [Acquirer] grants leases from one lock object per name with generation
// preconditions alone. Expiry is decided on GCS's clock as GCS stamps it on
// objects (the lock object's updated time), not on the Date header, which a
// proxy may set; a contender reads GCS's time by rewriting a clock object
// ([AcquirerOptions.ClockObject]). Tokens keep growing after a lock object is
// deleted as long as GCS's clock never goes back. A lock object's state is
// in its metadata and, as a copy that an edit of the metadata in place cannot
// change, in its body: a patched lock object stays held and keeps its
// counter. GCS takes about one write a
// second per object: use ttls of 3s or more there. See [Acquirer].
//
// Errors are told apart by their HTTP status (googleapi.Error), never by
// their messages.
package gcsfence
