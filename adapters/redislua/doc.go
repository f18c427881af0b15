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
//   - [IdempotencyStore]: an idempotency.Store keeping one hash per key,
//     changed only by scripts that compare and set on the server's clock.
//
// It works with any redis.UniversalClient (standalone, Sentinel, Cluster): the
// keys of one lock name, or of one protected key, share a hash tag, so each
// script touches one slot.
//
// # Replies that say a step did not run
//
// Redis refuses a command without running it while another client's script
// runs past busy-reply-threshold (BUSY), while it loads its data (LOADING),
// and with OOM, READONLY, MASTERDOWN, TRYAGAIN, CLUSTERDOWN, NOREPLICAS or
// MISCONF. Every step of the Acquirer, Writer, FencedScript and
// IdempotencyStore sends such a step again, paced, until Redis runs it or the
// caller's context ends; then the error matches ErrNotRun and the context's
// error (a waiting Acquire's also fence.ErrHeld; also when it was its grant
// channel's SUBSCRIBE that Redis refused). A Release that Redis did not run
// is sent again in the background for up to the ttl; a waiter's leave for as
// long as its place in line can still be granted (the longer of the ttl and
// the place's life, five polls, plus a second), and at once when its acquirer
// hears of a grant to it; both go again within about 100ms of a reply that said
// they did not run. A FencedScript body should not return error replies with
// these codes.
//
// # Token durability
//
// The token counter is an ordinary Redis key, and it can be lost: a DEL or
// FLUSHALL, eviction under maxmemory, a restart without persistence, or an
// asynchronous failover (a primary acknowledges a grant and fails before a
// replica has it). A counter that restarted would hand out a token below one
// already handed out, and a paused holder's write would beat the new holder's.
// So by default every token is at least the server's clock in microseconds
// (Redis TIME), and one more than the counter: after the counter is lost, the
// next token is still larger than every earlier one, provided the clock of
// the Redis that grants it (the same server, or the promoted replica) is not
// behind the clock that granted the last token by more than the time that
// passed between the two grants. Tokens are large numbers (about 1.8e15
// today, within the 2^53 limit until the year 2255).
//
//   - CounterTokens turns the floor off (tokens 1, 2, 3, ...): tokens are then
//     as durable as the counter key, fine only for a Redis that never loses
//     it (AOF with fsync always, no eviction, no failover, nobody deletes
//     keys under the prefix).
//   - WaitReplicas: after each grant the acquirer runs WAIT for that many
//     replicas. A grant that did not reach them in time is released and
//     reported as ErrNotReplicated; no token that could be lost is handed out.
//     (A replica that acknowledged can still lose the write if it crashes too.)
//
// Redlock keeps a counter on each node and does not use the clock: it relies
// on nodes not losing their data (see Redlock). For tokens that survive node
// loss without clock assumptions, use a consensus store (package etcdfence).
package redislua
