// Package redislua grants fenced leases from Redis and fences data kept in Redis,
// with Lua scripts that decide and write in one atomic step.
//
//   - [Acquirer]: SET-NX-style leases whose token comes from a per-name counter,
//     granted by one script in one round trip; token-checked renew and release;
//     waiters of any process queue in Redis, and a release grants the lease to
//     the first live one in its own script and tells it by pub/sub, with
//     jittered polling as the fallback.
//   - [Redlock]: the same on a majority of independent Redis primaries, with a
//     fencing token that a later majority always exceeds.
//   - [Writer]: a fence.FencedWriter keeping value and fence in one hash.
//   - [FencedScript]: runs your own Lua body only when the token passes a fence.
//
// It works with any redis.UniversalClient (standalone, Sentinel, Cluster): the
// keys of one lock name, or of one protected key, share a hash tag, so each
// script touches one slot.
//
// # Token durability
//
// The token counter is an ordinary Redis key. Redis replicates asynchronously: if
// a primary acknowledges a grant and fails before a replica has it, the promoted
// replica's counter is behind and the next grant can reuse a token that was
// already handed out. A stale holder and a new one would then carry the same
// token, and fencing cannot tell them apart. Two options close that gap:
//
//   - WaitReplicas: after each grant the acquirer runs WAIT for that many
//     replicas. A grant that did not reach them in time is released and
//     reported as ErrNotReplicated; no token that could be lost is handed out.
//     (A replica that acknowledged can still lose the write if it crashes too.)
//   - TokenFloor: each token is at least the server's clock in microseconds
//     (Redis TIME). After a failover that lost the counter, the next token is
//     still larger than every earlier one, provided the new primary's clock is
//     not behind the old primary's by more than the time that passed between
//     the lost grant and the next one. Tokens are then large numbers (about
//     1.8e15 today, within the 2^53 limit until the year 2255).
//
// Without either, tokens are as durable as the counter key: fine for a single
// Redis with persistence (AOF with fsync always), not across failovers. For
// tokens that survive node loss without clock assumptions, use a consensus
// store (package etcdfence).
package redislua
