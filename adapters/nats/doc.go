// Package natsfence fences data kept in a NATS JetStream key-value bucket and
// grants fenced leases from one (github.com/nats-io/nats.go and its jetstream
// package; NATS Server 2.11 or later for per-key TTLs).
//
//   - [Acquirer] (made by [NewAcquirer], configured by [AcquirerOptions]):
//     leases on a KV bucket made with [LockBucket]: a grant creates the lock
//     key if absent with a per-key TTL, so expiry runs on the server's clock;
//     the token is the bucket's creation time in microseconds plus the grant's
//     revision; renew and release read the key and act only on the lease's
//     own entry (its nonce), expecting its revision, so a lease from a
//     bucket since deleted and re-created gets fence.ErrLost instead of
//     extending or purging a new grant's entry at the same revision; waiters
//     watch the key and wake on its release or expiry marker (not FIFO). It is a
//     fence.Inspector; it has no Bump (tokens are revisions).
//   - [Writer] (made by [NewWriter], configured by [WriterOptions]): a
//     fence.FencedWriter, fence.Reader and fence.Deleter keeping a key's value
//     and fence in one KV entry, written by compare-and-set on the entry's
//     revision.
//   - [IdempotencyStore] (made by [NewIdempotencyStore], configured by
//     [IdempotencyOptions]): an idempotency.Store keeping one record per key in
//     a KV entry, each step a compare-and-set on the entry's revision, leases
//     and retention counted on the server's clock; a fresh claim's fence is at
//     least the server's clock in microseconds, so fences never go down, also
//     after Purge, kv del, kv purge or the bucket re-created.
//
// # Keys
//
// NATS KV keys hold only A-Z a-z 0-9 - _ / = and dots; [EncodeKey] maps any
// name or key (any bytes, up to [MaxKeyBytes]) to a KV key injectively, so two
// names never share an entry and nothing is folded (case, Unicode forms,
// spaces).
//
// # Ambiguous replies
//
// A request whose reply never came (a timeout, a dropped connection, a
// leader election) may have been stored. Every entry carries a random write
// id: the Writer looks again, returns nil when its entry landed, and otherwise,
// when the key still holds the entry it expected to replace (the same
// revision and write id), publishes the same entry expecting the same
// revision, which can land at most once. A grant, renewal or release does the
// same, recognising its lease's entry by a random nonce. When that does not settle within WriterOptions.RetryFor, or a larger
// token replaced the entry meanwhile, the error matches fence.ErrUnknown.
//
// # What loses a fence
//
// A fence lives in its entry. Deleting or re-creating the bucket, a stream
// purge, or a bucket TTL removes fences and would let a stale writer in:
// NewWriter refuses a bucket with a TTL, and a key whose entry was deleted or
// purged with kv del or kv purge is refused with [ErrFenceGone] until an
// operator clears it. Never delete or purge a fence bucket while holders of
// older tokens may be alive, and never run PurgeDeletes (kv compact) on it:
// it removes those markers, the key then looks never written, and any token
// is accepted.
//
// # A bucket deleted and re-created
//
// A revision is a stream sequence: a bucket deleted and re-created numbers
// them from 1 again, so a revision read before names another entry after.
// Every step that expects a revision therefore also checks, on a read at the
// stream leader just before it, that the entry is the one it means (a
// lease's nonce, a write id): a Renew or Release of a lease granted in the old
// bucket returns fence.ErrLost and touches nothing in the new one; a write or
// idempotency step whose reply was lost, and a claim read back for its fence,
// return fence.ErrUnknown rather than act on a new entry at the same
// revision. JetStream conditions a publish on a subject's last sequence
// only, not on the stream's identity or an entry's content, so the read and
// the publish are two requests: a re-creation, and a new entry reaching the
// same revision, between the leader's answer to the read and its receipt of
// the publish (a round trip, plus any pause of the client between the two)
// is not seen. A grant's create, which expects the revision of the marker it
// read or wrote, has the same window; a grant that spans a re-creation is
// given back (the bucket's creation time read after it differs).
//
// # Durability and leader changes
//
// Grants, renewals and fenced writes are publishes that the stream leader
// acknowledges once its replicas agree (Raft), so on an R3 bucket the loss of
// one node loses no acknowledged grant or fence. Decisions read the stream
// leader (STREAM.MSG.GET), never a direct get that a lagging replica may
// answer. During a leader election requests time out or find no responder;
// each is retried within RetryFor and then returns a clear error (ErrUnknown
// when a write may have landed), never a hang. A lease whose holder is cut
// off during the election is not renewed and expires on the server; its
// holder's context ends at its local deadline, which passes before the
// server's TTL (rounded up to whole seconds), so no one is granted while it
// is live.
//
// An R1 bucket on the server's default sync_interval (2 minutes) can lose the
// last acknowledged messages when the machine (not only the process) dies:
// a grant or a fence could then be handed out or accepted again. Use R3, or
// sync_interval: always, for locks that guard correctness.
package natsfence
