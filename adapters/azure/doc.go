// Package azfence fences writes to Azure Blob Storage with conditional Put
// Blob requests, and grants leases on Azure's native blob leases with the
// fencing token kept in the lock blob's metadata.
//
//   - [Writer] (made by [NewWriter], configured by [WriterOptions]): a
//     fence.FencedWriter, fence.Reader and fence.Deleter on one container.
//   - [Acquirer] (made by [NewAcquirer], configured by [AcquirerOptions]):
//     leases on Azure's native blob leases.
//
// # Writer
//
// A write reads the blob's properties (its token and write id in metadata,
// and its ETag), refuses a stale token, and puts the blob with If-Match on
// that ETag (If-None-Match: * for a new blob): if anyone wrote in between,
// the put fails with 412 ConditionNotMet (409 BlobAlreadyExists for a blob
// created in between, 404 for one deleted in between) and the writer reads
// again and decides again, a bounded number of times. Three corners:
//
//   - ETag reuse (ABA): Azure's ETags do not hash the body. Azurite makes them
//     from its clock in milliseconds times a random number in 70000..100000,
//     so two writes of one blob in the same millisecond can share an ETag. Every
//     write also stores its random write id in a blob index tag
//     ([TagWriteID]), and every conditional put requires that tag to still hold
//     the write id it read (x-ms-if-tags), along with the ETag: a write in
//     between changes the tag even if the ETag came back the same. Azure
//     documents that condition; Azurite 3.37.0 ignores it, so there the
//     guard is the ETag alone.
//   - Ambiguous attempts: a put whose reply was lost (or that got a 5xx) may
//     have been applied. The SDK's retry policy (azcore: up to 3 retries of
//     any request on a transport error other than the caller's context ending,
//     and on 408, 429, 500, 502, 503 and 504) is off for the put; the writer
//     retries itself, and on every read after such an attempt checks whether
//     the stored blob is its own write (by write id): then the write
//     succeeded. If a newer token is stored instead, or the write ends for any
//     other reason, the error matches fence.ErrUnknown, never fence.ErrStale.
//   - Blobs written by other tools have no token: they count as token 0, or
//     are refused with [WriterOptions.RefuseUnfenced]. A write also reads the envelope at
//     the start of the body and takes the larger of its token and the
//     metadata's, so metadata replaced (Set Blob Metadata by another tool,
//     dropping or lowering the token) never lowers the fence.
//
// Keys and lock names map to blob names byte for byte (Prefix + key). A
// key or name whose blob name has an empty path segment ("a//b", a slash at
// either end) or a "." or ".." segment, a trailing dot or a backslash, is
// refused with fence.ErrInvalid before any request, rather than encoded:
// Azure changes such names, and servers that store blobs as files resolve
// the path segments, so two keys would share one blob.
//
// # Leases
//
// [Acquirer] takes Azure's native lease on one lock blob per name and keeps the
// token in the blob's metadata, written under that lease. Expiry is the
// lease's own timer on Azure. Azure leases last 15 to 60 s: a ttl outside
// [MinAcquirerTTL]..[MaxAcquirerTTL] (1 s..60 s) is refused, and one under 15 s
// keeps others from the name for up to 15 s unless it is released. Breaking a
// lease by hand ends mutual exclusion at once, while the holder's context
// still runs; the fence still refuses its writes. Tokens keep growing after
// the lock blob is deleted as long as Azure's clock never goes back, and
// after it is restored from a snapshot or an older version as long as also
// the restore lands in a later second than the last grant (every grant's
// token is at least the blob's Last-Modified, in microseconds). See
// [Acquirer].
//
// Errors are told apart by Azure's error codes and HTTP status, never by
// their messages. Errors returned by this package show a SAS token's
// signature (the URL's sig parameter) as REDACTED.
package azfence
