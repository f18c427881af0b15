// Package fence is the core contract of fencekit: fencing tokens, leases, the
// acquirers that grant them, and the fenced writers that enforce them.
//
// # Why a lock is not enough
//
// A lease lock expires on the backend's clock, but its holder acts on its own view
// of time. A holder that pauses longer than its lease (a GC pause, a descheduled VM,
// a slow call) wakes up believing it still holds the lock while another process
// has been granted it. No TTL prevents that: a pause can always be longer.
//
// fencekit moves the decision to the protected resource. Every grant carries a
// [Token] that is larger than every earlier grant's token for the same lock name.
// Every write carries its token, and a [FencedWriter] refuses a write whose token is
// lower than one the key has already accepted, with an error that matches
// [ErrStale]. The stale holder's write is rejected even though it arrives last.
//
// # What is guaranteed
//
//   - For one lock name, tokens strictly increase across grants, also across
//     expiry and re-grant, and they stay within 1..[MaxToken].
//   - A fenced writer accepts a write with a token equal to or larger than the
//     largest it has accepted for that key, and rejects a lower one. The check and
//     the write are one atomic step at the resource.
//   - A fenced delete keeps the fence (a tombstone), so a stale writer cannot
//     recreate a deleted key.
//   - [Lease.Release] is token-checked: a holder whose lease expired cannot free
//     the lease of the next holder; it gets [ErrLost] instead.
//
// What is not guaranteed: that two holders never run at the same time. They can,
// whenever a holder pauses past its lease; fencing makes that harmless for writes
// that go through a fenced writer. Side effects that cannot be fenced need an
// idempotency key (package idempotency).
//
// # The watchdog
//
// [Hold] acquires a lease, renews it every ttl/3 while the work runs, cancels the
// work's context as soon as the lease is lost or its local deadline passes
// without a confirmed renewal, and always releases it. It cannot stop a process
// that is paused as a whole: the check "do I still hold the lock?" and the write
// that follows can always be separated by a pause. Only the fence catches that.
package fence
