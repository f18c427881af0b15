package etcdfence

import (
	"context"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The lease pool takes the etcd lease grant off the path of a grant. A
// release whose lease was only ever used by its own grant deletes the lock
// key (a transaction conditional on the key being on that lease) instead of
// revoking the lease, and keeps the lease, now holding no key, for the next
// grant of the same ttl: a grant is then one transaction and a release one
// delete, as many Raft writes as a concurrency.Mutex with its session's
// lease (a put and a delete), instead of a lease grant, a transaction and a
// revoke.
//
// A lease is used by one grant at a time, never shared: while a grant holds
// it, only that grant's renewals keep it alive, so a holder that stops
// renewing loses the lock at its ttl whatever its process does, and a dead
// holder's lock frees itself at its ttl. A lease goes back to the pool only
// when nothing the grant sent may still reach etcd and change it: the
// release's delete was confirmed, no Renew was under way, and every renewal
// was confirmed or refused (a keep-alive whose answer never came could land
// later and extend the next holder's lease). Any other lease is revoked, as
// before; a lease that reached the pool is never named by a request of the
// grant that used it (a second Release sends nothing).
//
// A pooled lease's etcd clock started at its last confirmed grant or
// keep-alive, and the next grant's local deadline counts from when that
// request was sent: a grant from the pool may hold up to a tenth of its ttl
// (at most 10s) less than one granted on the spot. A lease released more
// than half that window after that send is refreshed by one keep-alive (not
// a Raft write) before it is pooled; one unused for the window is revoked
// in the background, never handed out. One that etcd no longer has (revoked
// by an operator) fails the grant's transaction, which then creates nothing,
// and the grant takes a lease on the spot. Close revokes the pooled leases.

// poolWindow is how long after its last confirmed grant or keep-alive was
// sent a pooled lease of ttl may be handed out: a tenth of the ttl, at most
// maxPoolWindow.
func poolWindow(ttl time.Duration) time.Duration { return min(ttl/10, maxPoolWindow) }

// maxPoolWindow bounds the pool window of long ttls: a lease no grant takes
// for this long is revoked.
const maxPoolWindow = 10 * time.Second

// poolSlots bounds the ttls pooled at once (one lease each).
const poolSlots = 8

// pool holds etcd leases that hold no key, at most one for each ttl in
// whole seconds (the etcd lease's ttl). It is safe for concurrent use.
type pool struct {
	c      *clientv3.Client
	window func(ttl time.Duration) time.Duration // poolWindow; tests may widen it

	mu      sync.Mutex
	closed  bool
	slots   map[int64]*slot
	refresh sync.WaitGroup // keep-alives under way
}

// slot is one ttl's pooled lease.
type slot struct {
	id         clientv3.LeaseID // 0: none pooled
	sent       time.Time        // when id's last confirmed grant or keep-alive was sent
	timer      *time.Timer      // revokes id once its window has passed
	refreshing bool             // a keep-alive of a lease to pool is under way
}

func newPool(c *clientv3.Client) *pool {
	return &pool{c: c, window: poolWindow, slots: map[int64]*slot{}}
}

// take returns a pooled lease for ttl with the send time from which its
// etcd clock counts, or ok false.
func (p *pool) take(ttl time.Duration) (id clientv3.LeaseID, sent time.Time, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.slots[seconds(ttl)]
	if p.closed || s == nil || s.id == 0 {
		return 0, time.Time{}, false
	}
	id, sent = s.id, s.sent
	s.timer.Stop()
	s.id, s.timer = 0, nil
	if time.Since(sent) >= p.window(ttl) {
		p.revoke(id, ttl) // aged past its window before its timer ran
		return 0, time.Time{}, false
	}
	return id, sent, true
}

// put pools lease id of ttl, which holds no key and whose etcd clock counts
// from sent, refreshing it first when more than half its window has passed;
// it revokes the lease when the pool is closed, the slot is taken, or the
// pool has no room.
func (p *pool) put(id clientv3.LeaseID, sent time.Time, ttl time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	secs := seconds(ttl)
	s := p.slots[secs]
	if s == nil && !p.closed && p.room() {
		s = &slot{}
		p.slots[secs] = s
	}
	if p.closed || s == nil || s.id != 0 || s.refreshing {
		p.revoke(id, ttl)
		return
	}
	if time.Since(sent) < p.window(ttl)/2 {
		p.keep(s, id, sent, ttl)
		return
	}
	s.refreshing = true
	p.refresh.Add(1)
	go p.renew(s, id, ttl)
}

// renew sends one keep-alive of lease id and pools it once confirmed; a
// lease etcd no longer has is dropped, and one whose keep-alive was not
// confirmed (it may land later) is revoked.
func (p *pool) renew(s *slot, id clientv3.LeaseID, ttl time.Duration) {
	defer p.refresh.Done()
	ctx, cancel := context.WithTimeout(p.c.Ctx(), p.window(ttl)/2)
	sent := time.Now()
	_, again, err := keepAliveOnce(ctx, p.c, id)
	cancel()
	p.mu.Lock()
	defer p.mu.Unlock()
	s.refreshing = false
	switch {
	case err == nil && !again:
		p.keep(s, id, sent, ttl)
	case isLeaseNotFound(err):
		// Gone already: nothing to revoke.
	default:
		// Not confirmed, or a copy may land later: never pooled.
		p.revoke(id, ttl)
	}
}

// room makes room for a new slot, dropping slots that pool nothing, and
// reports whether there is room. It runs with p.mu held.
func (p *pool) room() bool {
	if len(p.slots) < poolSlots {
		return true
	}
	for secs, s := range p.slots {
		if s.id == 0 && !s.refreshing {
			delete(p.slots, secs)
		}
	}
	return len(p.slots) < poolSlots
}

// keep pools lease id (its etcd clock counting from sent) in slot s, or
// revokes it when the pool is closed or id is past its window. It runs with
// p.mu held.
func (p *pool) keep(s *slot, id clientv3.LeaseID, sent time.Time, ttl time.Duration) {
	left := p.window(ttl) - time.Since(sent)
	if p.closed || s.id != 0 || left <= 0 {
		p.revoke(id, ttl)
		return
	}
	s.id, s.sent = id, sent
	s.timer = time.AfterFunc(left, func() { p.expire(s, id, ttl) })
}

// expire revokes lease id if slot s still pools it: its window has passed
// unused.
func (p *pool) expire(s *slot, id clientv3.LeaseID, ttl time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if s.id == id {
		s.id, s.timer = 0, nil
		p.revoke(id, ttl)
	}
}

// revoke revokes id in the background (see Acquirer.revoke).
func (p *pool) revoke(id clientv3.LeaseID, ttl time.Duration) {
	revokeLease(p.c, id, ttl)
}

// close stops pooling, waits for the keep-alives under way (each gives up
// within half a window; a lease they would pool is revoked instead), and
// revokes every pooled lease, waiting up to ctx for etcd's answers; it
// returns the first revoke that failed.
func (p *pool) close(ctx context.Context) error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.refresh.Wait()
	p.mu.Lock()
	var ids []clientv3.LeaseID
	for _, s := range p.slots {
		if s.id != 0 {
			s.timer.Stop()
			ids = append(ids, s.id)
			s.id, s.timer = 0, nil
		}
	}
	p.mu.Unlock()
	var first error
	for _, id := range ids {
		if _, err := p.c.Revoke(ctx, id); err != nil && first == nil && !isLeaseNotFound(err) {
			first = err
		}
	}
	return first
}

// keepAliveOnce sends one keep-alive of lease id and waits for its answer,
// sending it again after a break of the connection (gRPC's Unavailable or
// Internal) until ctx ends, as the client's KeepAliveOnce does; unlike it,
// it reports whether a copy was sent whose answer never came (again): such
// a copy may still reach etcd later (held on its way, or in a member's
// forward to the leader) and extend the lease then, so a lease renewed with
// again set is never pooled. A lease etcd no longer has returns
// rpctypes.ErrLeaseNotFound.
func keepAliveOnce(ctx context.Context, c *clientv3.Client, id clientv3.LeaseID) (resp *pb.LeaseKeepAliveResponse, again bool, err error) {
	lc := pb.NewLeaseClient(c.ActiveConnection())
	for {
		var sent bool
		resp, sent, err = keepAliveAttempt(ctx, lc, id)
		if err == nil {
			if resp.TTL <= 0 {
				err = rpctypes.ErrLeaseNotFound
			}
			return resp, again, err
		}
		again = again || sent
		if ctx.Err() != nil {
			return nil, again, ctx.Err()
		}
		if s, ok := status.FromError(err); !ok || (s.Code() != codes.Unavailable && s.Code() != codes.Internal) {
			return nil, again, rpctypes.Error(err)
		}
	}
}

// keepAliveAttempt is one try of keepAliveOnce on a stream of its own; sent
// reports whether the request may have left.
func keepAliveAttempt(ctx context.Context, lc pb.LeaseClient, id clientv3.LeaseID) (*pb.LeaseKeepAliveResponse, bool, error) {
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := lc.LeaseKeepAlive(cctx, grpc.WaitForReady(true))
	if err != nil {
		return nil, false, err
	}
	if err := stream.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)}); err != nil {
		return nil, true, err
	}
	resp, err := stream.Recv()
	if err != nil {
		return nil, true, err
	}
	return resp, false, nil
}
