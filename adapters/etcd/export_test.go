package etcdfence

import (
	"time"

	"github.com/fencekit/fencekit/fence"
)

// PooledLease reports the etcd lease a's pool holds for ttl, and when its
// grant was sent (tests only).
func PooledLease(a *Acquirer, ttl time.Duration) (id int64, sent time.Time, ok bool) {
	if a.pool == nil {
		return 0, time.Time{}, false
	}
	a.pool.mu.Lock()
	defer a.pool.mu.Unlock()
	s := a.pool.slots[seconds(ttl)]
	if s == nil || s.id == 0 {
		return 0, time.Time{}, false
	}
	return int64(s.id), s.sent, true
}

// LeaseID is the etcd lease of a lease granted by an Acquirer (tests only).
func LeaseID(l fence.Lease) int64 { return int64(l.(*lease).id) }

// SetPoolWindow replaces how long a's pooled leases of a ttl may be handed
// out after their send (tests only; call it before a's first grant).
func SetPoolWindow(a *Acquirer, window func(ttl time.Duration) time.Duration) {
	a.pool.mu.Lock()
	defer a.pool.mu.Unlock()
	a.pool.window = window
}
