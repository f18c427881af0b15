// Package etcdfence grants fenced leases from etcd, a consensus store: grants are
// linearizable, and the token is the revision at which the holder's lock key was
// created, which the whole cluster agrees on and which only grows, across
// leader changes and the loss of a minority of members.
//
// The package has one type, [Acquirer] (made by [NewAcquirer], configured by
// [AcquirerOptions]), a fence.Acquirer and fence.Inspector.
//
// Each grant has an etcd lease of its own with the ttl (whole seconds; etcd
// may round it up to its minimum) and a key under prefix/name/ attached to
// it, created in one transaction that succeeds only if the name's line is
// empty: a TryAcquire that loses never enters the line. The etcd lease is
// granted on the spot, or taken from the acquirer's pool of leases that an
// earlier grant released and that hold no key (see [Acquirer]). The holder is the
// key with the lowest create revision; waiters queue in creation order and
// each watches the key just before its own, as
// go.etcd.io/etcd/client/v3/concurrency.Mutex does, so a release wakes
// exactly the next waiter and nobody polls. A waiter's key is on
// a short lease ([WaiterTTL]) that it keeps alive while it waits, so a waiter
// that dies leaves the line within WaiterTTL, not the lock's ttl; at the head
// of the line its key moves to a lease with the lock's ttl, keeping its create
// revision (the token). Names are escaped into keys and compared byte for byte.
//
// The line is FIFO under these conditions: a waiter whose connection is cut
// for less than WaiterTTL keeps its place (its key stays; it reads its
// predecessor and watches again); one cut off for longer loses it and joins
// the line again at its end, within its context; and an attempt that fails for the network's sake (a
// grant whose answer was lost and whose key is not found, a key found only
// after the lease's local deadline passed) is given back and Acquire starts
// again, within its context, at the end of the line.
//
// Cleanup (revoking the lease of a waiter that gave up, of a grant whose
// answer was lost, of a loser when the pool is off) runs in the background
// and tries again until the lease is gone or could not outlive its ttl;
// since a key can only be created on a live lease, a late request that lands
// after the revoke fails. A lease such a request may still name is never
// pooled (see [Acquirer]).
//
// Tokens are revisions of the whole cluster: deleting the lock keys (or the
// whole prefix) does not restart them. It does free the names, though: the
// next TryAcquire or waiter is granted while the holder is not told until
// its next Renew, which finds its key gone, returns fence.ErrLost and ends
// its context (fence.Hold renews every ttl/3); until then only the fence, the
// new token being larger, refuses the old holder's writes. To take a lock
// away, revoke the holder's etcd lease (the key's lease) or delete its key:
// its next Renew returns fence.ErrLost, but its context stays live until
// then, and the next grant does not wait for it. Restoring a cluster from a snapshot
// does set the revision back to the snapshot's: restore with etcdutl snapshot
// restore --bump-revision (by more than the revisions since the snapshot) and
// --mark-compacted, or tokens granted after the snapshot are handed out again.
//
// Once granted, the lease lives as long as it is renewed: Renew sends one
// keep-alive, and fence.Hold renews every ttl/3. A holder that stops renewing
// (paused, partitioned from the cluster's majority) loses the lease when etcd's
// leader expires it, and its next write is refused by the fence.
package etcdfence
