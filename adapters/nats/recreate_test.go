package natsfence_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/nats-io/nats.go/jetstream"
)

// TestBucketRecreatedDuringGrant: the lock bucket is deleted and re-created
// after A's create landed in the old bucket and before A reads the bucket's
// creation time for its token. A must not come back with a lease the new
// bucket does not hold, nor with a token that mixes the new creation time
// with the old bucket's revision: B, granted later in the new bucket, would
// hold a smaller token than A's, and A's writes would fence B out.
func TestBucketRecreatedDuringGrant(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-recreated-grant")
	direct := js(t)
	bucket(t, direct, cfg)
	j, p := proxied(t)
	a := newAcquirer(t, j, cfg, nil)
	for i := 0; i < 20; i++ { // move the old bucket's revisions past the new one's first
		l, err := a.TryAcquire(ctx, "warm", 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	name := fencetest.Name("recreated")
	// The read of the creation time after the grant never reaches the
	// server, and the client is kept away until the bucket is re-created.
	p.DropRequest(func(b []byte) bool { return bytes.Contains(b, []byte("STREAM.INFO.KV_"+cfg.Bucket)) })
	p.Refuse(true)
	type result struct {
		l   fence.Lease
		err error
	}
	done := make(chan result, 1)
	go func() {
		l, err := a.TryAcquire(ctx, name, 20*time.Second)
		done <- result{l, err}
	}()
	for giveUp := time.Now().Add(30 * time.Second); p.Pending() != 0; {
		if time.Now().After(giveUp) {
			t.Fatal("the grant never read the bucket's creation time")
		}
		time.Sleep(time.Millisecond)
	}
	if err := direct.DeleteKeyValue(ctx, cfg.Bucket); err != nil {
		t.Fatal(err)
	}
	bucket(t, direct, cfg)
	p.Refuse(false)
	r := <-done
	b := newAcquirer(t, js(t), cfg, nil)
	lb, err := b.TryAcquire(ctx, name, 20*time.Second)
	if r.err != nil {
		t.Logf("A's grant across the re-creation: %v", r.err)
		if err != nil {
			t.Fatalf("A got no lease, and B is refused: %v", err)
		}
		_ = lb.Release(ctx)
		return
	}
	if err == nil {
		t.Fatalf("two holders: A (token %d) came back with a lease across the re-creation, and B was granted after it (token %d)", r.l.Token(), lb.Token())
	}
	if !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("B while A holds: %v, want ErrHeld", err)
	}
	if err := r.l.Release(ctx); err != nil {
		t.Fatalf("A's release: %v", err)
	}
	lb, err = b.TryAcquire(ctx, name, 20*time.Second)
	if err != nil {
		t.Fatalf("B after A released: %v", err)
	}
	defer lb.Release(ctx)
	if lb.Token() <= r.l.Token() {
		t.Fatalf("B, granted after A, holds token %d, not above A's %d", lb.Token(), r.l.Token())
	}
}

// created returns the creation time, in Unix microseconds, of the stream of
// bucket: a lease's token less it is the lease's revision.
func created(t *testing.T, j jetstream.JetStream, bucket string) uint64 {
	t.Helper()
	s, err := j.Stream(context.Background(), "KV_"+bucket)
	if err != nil {
		t.Fatal(err)
	}
	return uint64(s.CachedInfo().Created.UnixMicro())
}

// lastSeq returns the last stream sequence of bucket.
func lastSeq(t *testing.T, j jetstream.JetStream, bucket string) uint64 {
	t.Helper()
	s, err := j.Stream(context.Background(), "KV_"+bucket)
	if err != nil {
		t.Fatal(err)
	}
	return s.CachedInfo().State.LastSeq
}

// freshBucket deletes bucket cfg if it is there and makes it anew, with n
// messages on a filler key, so its revisions go on from n.
func freshBucket(t *testing.T, j jetstream.JetStream, cfg jetstream.KeyValueConfig, n uint64) jetstream.KeyValue {
	t.Helper()
	ctx := context.Background()
	if err := j.DeleteKeyValue(ctx, cfg.Bucket); err != nil && !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Fatal(err)
	}
	kv := bucket(t, j, cfg)
	for i := uint64(0); i < n; i++ {
		if _, err := kv.Put(ctx, "filler", []byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	if got := lastSeq(t, j, cfg.Bucket); got != n {
		t.Fatalf("fresh bucket %s: last revision %d, want %d", cfg.Bucket, got, n)
	}
	return kv
}

// holdAcrossRecreation grants A the lease on name in a fresh bucket cfg, then
// deletes the bucket and makes it again, and returns A's lease, its revision
// (its token less the old bucket's creation time) and the new bucket, which
// holds rev-2 messages: a grant on name there writes a marker at rev-1 and
// its entry at rev, A's revision.
func holdAcrossRecreation(t *testing.T, cfg jetstream.KeyValueConfig, name string) (fence.Lease, uint64, jetstream.KeyValue) {
	t.Helper()
	ctx := context.Background()
	direct := js(t)
	freshBucket(t, direct, cfg, 5)
	a := newAcquirer(t, js(t), cfg, nil)
	la, err := a.TryAcquire(ctx, name, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	rev := uint64(la.Token()) - created(t, direct, cfg.Bucket)
	if rev < 2 {
		t.Fatalf("A's revision %d: the new bucket cannot grant at it", rev)
	}
	kv := freshBucket(t, direct, cfg, rev-2)
	return la, rev, kv
}

// grantAt grants B the lease on name in the re-created bucket cfg and checks
// that its entry's revision is rev (A's, from the old bucket).
func grantAt(t *testing.T, cfg jetstream.KeyValueConfig, name string, rev uint64) fence.Lease {
	t.Helper()
	direct := js(t)
	b := newAcquirer(t, js(t), cfg, nil)
	lb, err := b.TryAcquire(context.Background(), name, 20*time.Second)
	if err != nil {
		t.Fatalf("B in the re-created bucket: %v", err)
	}
	if got := uint64(lb.Token()) - created(t, direct, cfg.Bucket); got != rev {
		t.Fatalf("B's revision in the re-created bucket is %d, not A's %d: the revisions do not collide", got, rev)
	}
	return lb
}

// stillHolds checks that B's lease on name is intact after A's step: its
// context live, its renewal accepted, another acquirer refused.
func stillHolds(t *testing.T, cfg jetstream.KeyValueConfig, name string, lb fence.Lease) {
	t.Helper()
	ctx := context.Background()
	if err := lb.Context().Err(); err != nil {
		t.Fatalf("B's context ended: %v", context.Cause(lb.Context()))
	}
	c := newAcquirer(t, js(t), cfg, nil)
	if lc, err := c.TryAcquire(ctx, name, 20*time.Second); err == nil {
		_ = lc.Release(ctx)
		t.Fatalf("two holders: C was granted (token %d) while B's context is live (token %d)", lc.Token(), lb.Token())
	} else if !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("C while B holds: %v, want ErrHeld", err)
	}
	if err := lb.Renew(ctx); err != nil {
		t.Fatalf("B's renewal after A's step: %v", err)
	}
}

// renewalRefused checks that the renewal of la, a lease from the deleted
// bucket, returns ErrLost and ends la's context; in says what stands at its
// revision in the new bucket, and while what else holds (or "").
func renewalRefused(t *testing.T, la fence.Lease, in, while string) {
	t.Helper()
	if err := la.Renew(context.Background()); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's renewal of a lease from the deleted bucket, %s: %v, want ErrLost", in, err)
	}
	if la.Context().Err() == nil {
		t.Fatal("A's context is live after its renewal was refused" + while)
	}
}

// TestRenewAfterBucketRecreatedDoesNotExtendNewHolder: A holds a lease, the
// lock bucket is deleted and re-created, and B is granted the name in the new
// bucket at the revision A's lease last wrote in the old one. A's renewal
// must not take B's entry for its own: it returns ErrLost and ends A's
// context, and B's entry is untouched.
func TestRenewAfterBucketRecreatedDoesNotExtendNewHolder(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-recreated-renew")
	name := fencetest.Name("recreated-renew")
	la, rev, _ := holdAcrossRecreation(t, cfg, name)
	lb := grantAt(t, cfg, name, rev)
	renewalRefused(t, la, fmt.Sprintf("B holding revision %d in the new one", rev), ", while B holds the name")
	stillHolds(t, cfg, name, lb)
	if err := lb.Release(ctx); err != nil {
		t.Fatalf("B's release: %v", err)
	}
}

// TestRenewAfterBucketRecreatedDoesNotTakeTheName: the lock bucket is deleted
// and re-created while A holds a lease, and the new bucket's marker on the
// name (a release's, an expiry's, an operator's purge) stands at A's
// revision. A's renewal must not write its entry over that marker: A's lease
// came from the old bucket, where B may have been granted since. It returns
// ErrLost, and the name stays free for a grant with a larger token.
func TestRenewAfterBucketRecreatedDoesNotTakeTheName(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-recreated-renew-marker")
	name := fencetest.Name("recreated-renew-marker")
	la, rev, kv := holdAcrossRecreation(t, cfg, name)
	if _, err := kv.Put(ctx, "filler", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := kv.Purge(ctx, natsfence.EncodeKey(name)); err != nil {
		t.Fatal(err)
	}
	if got := lastSeq(t, js(t), cfg.Bucket); got != rev {
		t.Fatalf("the new bucket's marker is at revision %d, not A's %d", got, rev)
	}
	renewalRefused(t, la, fmt.Sprintf("over a marker at its revision %d in the new one", rev), "")
	c := newAcquirer(t, js(t), cfg, nil)
	lc, err := c.TryAcquire(ctx, name, 20*time.Second)
	if err != nil {
		t.Fatalf("C on the free name after A's renewal: %v", err)
	}
	defer lc.Release(ctx)
	if lc.Token() <= la.Token() {
		t.Fatalf("C's token %d is not above A's %d", lc.Token(), la.Token())
	}
}

// TestReleaseAfterBucketRecreatedDoesNotDeleteNewHolder: A holds a lease, the
// lock bucket is deleted and re-created, and B is granted the name in the new
// bucket at A's revision. A's release must not purge B's entry (B would lose
// the name while its context is live, and a third party be granted), and
// must not report a release: it returns ErrLost.
func TestReleaseAfterBucketRecreatedDoesNotDeleteNewHolder(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-recreated-release")
	name := fencetest.Name("recreated-release")
	la, rev, _ := holdAcrossRecreation(t, cfg, name)
	lb := grantAt(t, cfg, name, rev)
	err := la.Release(ctx)
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's release of a lease from the deleted bucket, B holding revision %d in the new one: %v, want ErrLost", rev, err)
	}
	stillHolds(t, cfg, name, lb)
	if err := lb.Release(ctx); err != nil {
		t.Fatalf("B's release: %v", err)
	}
}

// TestWriteRetriedAfterBucketRecreatedDoesNotOverwriteNewEntry: a write's
// reply is lost, and before it is sent again the fence bucket is deleted and
// re-created and another write puts the key's entry at the revision the
// first attempt expected. The entry changed since an attempt that may have
// landed: sending it again would apply it over the later write. The write
// returns ErrUnknown and the later write stays.
func TestWriteRetriedAfterBucketRecreatedDoesNotOverwriteNewEntry(t *testing.T) {
	ctx := context.Background()
	cfg := jetstream.KeyValueConfig{Bucket: "fences-recreated-retry", History: 1}
	direct := js(t)
	freshBucket(t, direct, cfg, 0)
	other := newWriter(t, direct, cfg)
	key := fencetest.Name("recreated-write")
	if err := other.Write(ctx, key, []byte("first"), 5); err != nil {
		t.Fatal(err)
	}
	j, p := proxied(t)
	w := newWriter(t, j, cfg)
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(cfg.Bucket))
	p.Refuse(true) // kept away until the bucket is re-created
	done := make(chan error, 1)
	go func() { done <- w.Write(ctx, key, []byte("late"), 7) }()
	waitLost(t, p, before)
	if got := lastSeq(t, direct, cfg.Bucket); got != 2 {
		t.Fatalf("the write whose reply was lost: the old bucket's last revision is %d, want 2", got)
	}
	freshBucket(t, direct, cfg, 0)
	if err := other.Write(ctx, key, []byte("new"), 7); err != nil {
		t.Fatal(err)
	}
	if got := lastSeq(t, direct, cfg.Bucket); got != 1 {
		t.Fatalf("the new bucket's entry is at revision %d, not 1 (the revision the lost write expected)", got)
	}
	p.Refuse(false)
	err := <-done
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a write whose reply was lost, retried after the bucket was re-created and the key written again at the revision it expected: %v, want ErrUnknown", err)
	}
	if v, tok, err := other.Read(ctx, key); err != nil || string(v) != "new" || tok != 7 {
		t.Fatalf("Read = %q %d %v, want the later write: new 7", v, tok, err)
	}
}

// TestBeginAfterBucketRecreatedDoesNotReportAnotherClaim: A's claim lands,
// and before A reads it back (for its fence) the bucket is deleted and
// re-created and B claims the same key, at the revision of A's claim. A must
// not come back with B's claim as its own: both would then arm the key and
// run the effect.
func TestBeginAfterBucketRecreatedDoesNotReportAnotherClaim(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("idem-recreated-begin")
	direct := js(t)
	freshBucket(t, direct, cfg, 0)
	j, p := proxied(t)
	a := newStore(t, j, cfg)
	b := newStore(t, direct, cfg)
	key := fencetest.Name("recreated-begin")
	// The read of the claim by its revision never reaches the server, and
	// the client is kept away until the bucket is re-created.
	p.DropRequest(func(r []byte) bool {
		return bytes.Contains(r, []byte("STREAM.MSG.GET.KV_"+cfg.Bucket)) && bytes.Contains(r, []byte(`"seq"`))
	})
	p.Refuse(true)
	type result struct {
		rec     idempotency.Record
		created bool
		err     error
	}
	done := make(chan result, 1)
	go func() {
		rec, created, err := a.Begin(ctx, key, "fp-a", "owner-a", 10*time.Second)
		done <- result{rec, created, err}
	}()
	for giveUp := time.Now().Add(30 * time.Second); p.Pending() != 0; {
		if time.Now().After(giveUp) {
			t.Fatal("A's claim was never read back")
		}
		time.Sleep(time.Millisecond)
	}
	if got := lastSeq(t, direct, cfg.Bucket); got != 1 {
		t.Fatalf("A's claim: the old bucket's last revision is %d, want 1", got)
	}
	freshBucket(t, direct, cfg, 0)
	recB, created, err := b.Begin(ctx, key, "fp-b", "owner-b", 10*time.Second)
	if err != nil || !created {
		t.Fatalf("B's claim in the re-created bucket: created %v, %v", created, err)
	}
	if got := lastSeq(t, direct, cfg.Bucket); got != 1 {
		t.Fatalf("B's claim is at revision %d, not A's 1", got)
	}
	p.Refuse(false)
	r := <-done
	if r.err == nil && r.created && r.rec.Owner != "owner-a" {
		t.Fatalf("two owners: A's Begin reports B's claim (owner %q, fence %d) as its own", r.rec.Owner, r.rec.Fence)
	}
	if r.err == nil && r.created {
		t.Fatalf("A's Begin reports a claim (fence %d) the re-created bucket does not hold: B's is there (fence %d)", r.rec.Fence, recB.Fence)
	}
	if r.err != nil && !errors.Is(r.err, fence.ErrUnknown) {
		t.Fatalf("A's Begin: %v, want ErrUnknown (or B's record, not created)", r.err)
	}
	if r.err == nil && r.rec.Owner != "owner-b" {
		t.Fatalf("A's Begin, not created, returned the record of %q, want B's", r.rec.Owner)
	}
}

// TestRenewAfterBucketDeletedReturnsErrLost: the lock bucket is deleted (and
// not made again) while A holds a lease. Nothing holds A's entry: A's
// renewal and release say so at once (ErrLost), not ErrUnknown after
// RetryFor, and A's context ends.
func TestRenewAfterBucketDeletedReturnsErrLost(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-deleted-renew")
	direct := js(t)
	freshBucket(t, direct, cfg, 0)
	a := newAcquirer(t, js(t), cfg, &natsfence.AcquirerOptions{RetryFor: time.Minute})
	la, err := a.TryAcquire(ctx, fencetest.Name("deleted-renew"), 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := direct.DeleteKeyValue(ctx, cfg.Bucket); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := la.Renew(rctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's renewal after its bucket was deleted: %v, want ErrLost", err)
	}
	if la.Context().Err() == nil {
		t.Fatal("A's context is live after its bucket was deleted and its renewal refused")
	}
	if err := la.Release(rctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's release after its bucket was deleted: %v, want ErrLost", err)
	}
}

// TestBeginRetriedAfterBucketRecreatedDoesNotOverwriteAnotherClaim: A's
// claim over a released record loses its reply, and before it is sent again
// the bucket is deleted and re-created and B claims the key at the revision
// A's claim expected. Sending A's claim again would land over B's: two
// owners of one key. A's Begin reports ErrUnknown, and B's claim stays.
func TestBeginRetriedAfterBucketRecreatedDoesNotOverwriteAnotherClaim(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("idem-recreated-claim")
	direct := js(t)
	freshBucket(t, direct, cfg, 0)
	j, p := proxied(t)
	a := newStore(t, j, cfg)
	b := newStore(t, direct, cfg)
	key := fencetest.Name("recreated-claim")
	rec, _, err := b.Begin(ctx, key, "fp-0", "owner-0", 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Released, Fence: rec.Fence, Owner: "owner-0"}); err != nil {
		t.Fatal(err)
	}
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(cfg.Bucket))
	p.Refuse(true) // kept away until the bucket is re-created
	type result struct {
		rec     idempotency.Record
		created bool
		err     error
	}
	done := make(chan result, 1)
	go func() {
		rec, created, err := a.Begin(ctx, key, "fp-a", "owner-a", 10*time.Second)
		done <- result{rec, created, err}
	}()
	waitLost(t, p, before)
	if got := lastSeq(t, direct, cfg.Bucket); got != 3 {
		t.Fatalf("A's claim whose reply was lost: the old bucket's last revision is %d, want 3", got)
	}
	freshBucket(t, direct, cfg, 1)
	if _, created, err := b.Begin(ctx, key, "fp-b", "owner-b", 10*time.Second); err != nil || !created {
		t.Fatalf("B's claim in the re-created bucket: created %v, %v", created, err)
	}
	if got := lastSeq(t, direct, cfg.Bucket); got != 2 {
		t.Fatalf("B's claim is at revision %d, not 2 (the revision A's claim expected)", got)
	}
	p.Refuse(false)
	r := <-done
	if r.err == nil && r.created {
		t.Fatalf("two owners: A's claim (owner %q, fence %d) was sent again over B's", r.rec.Owner, r.rec.Fence)
	}
	if r.err != nil && !errors.Is(r.err, fence.ErrUnknown) {
		t.Fatalf("A's Begin: %v, want ErrUnknown (or B's record, not created)", r.err)
	}
	if got, err := b.Get(ctx, key); err != nil || got.Owner != "owner-b" || got.State != idempotency.Claimed {
		t.Fatalf("the key after A's Begin: %+v %v, want B's claim", got, err)
	}
}

// TestUpdateRetriedAfterBucketRecreatedDoesNotArmAnotherClaim: A's arm loses
// its reply, and before it is sent again the bucket is deleted and
// re-created and B claims the key at the revision A's arm expected. Sending
// A's arm again would land over B's claim, and both would run the effect.
// A's Update reports ErrUnknown, and B's claim stays.
func TestUpdateRetriedAfterBucketRecreatedDoesNotArmAnotherClaim(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("idem-recreated-arm")
	direct := js(t)
	freshBucket(t, direct, cfg, 0)
	j, p := proxied(t)
	a := newStore(t, j, cfg)
	b := newStore(t, direct, cfg)
	key := fencetest.Name("recreated-arm")
	rec, created, err := a.Begin(ctx, key, "fp-a", "owner-a", 10*time.Second)
	if err != nil || !created {
		t.Fatalf("A's claim: created %v, %v", created, err)
	}
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(cfg.Bucket))
	p.Refuse(true) // kept away until the bucket is re-created
	done := make(chan error, 1)
	go func() {
		_, err := a.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "owner-a", Lease: 10 * time.Second})
		done <- err
	}()
	waitLost(t, p, before)
	if got := lastSeq(t, direct, cfg.Bucket); got != 2 {
		t.Fatalf("A's arm whose reply was lost: the old bucket's last revision is %d, want 2", got)
	}
	freshBucket(t, direct, cfg, 0)
	if _, created, err := b.Begin(ctx, key, "fp-b", "owner-b", 10*time.Second); err != nil || !created {
		t.Fatalf("B's claim in the re-created bucket: created %v, %v", created, err)
	}
	if got := lastSeq(t, direct, cfg.Bucket); got != 1 {
		t.Fatalf("B's claim is at revision %d, not 1 (the revision A's arm expected)", got)
	}
	p.Refuse(false)
	if err := <-done; !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("A's arm sent again after the bucket was re-created and B claimed at the revision it expected: %v, want ErrUnknown", err)
	}
	if got, err := b.Get(ctx, key); err != nil || got.Owner != "owner-b" || got.State != idempotency.Claimed {
		t.Fatalf("the key after A's arm: %+v %v, want B's claim", got, err)
	}
}

// interfereBeforeCreate runs f once, just before the first create of a grant
// on key is sent (after the grant read the key and wrote or chose its
// marker).
func interfereBeforeCreate(t *testing.T, key string, f func()) *atomic.Int32 {
	t.Helper()
	var n atomic.Int32
	natsfence.SetCreateHook(func(k string) {
		if k == key && n.Add(1) == 1 {
			f()
		}
	})
	t.Cleanup(func() { natsfence.SetCreateHook(nil) })
	return &n
}

// TestOperatorDeleteBetweenMarkerAndCreate: an operator's `kv del` or `kv
// purge` (a marker that never ages out) lands between a grant's marker and
// its create. The grant goes on to one lease (its create refused, it looks
// again and reserves anew), and the name then has one holder: another
// acquirer is refused.
func TestOperatorDeleteBetweenMarkerAndCreate(t *testing.T) {
	ctx := context.Background()
	j := js(t)
	kv := bucket(t, j, lockBucket)
	a := newAcquirer(t, j, lockBucket, nil)
	b := newAcquirer(t, js(t), lockBucket, nil)
	for _, op := range []struct {
		what string
		do   func(key string) error
	}{
		{"kv del", func(key string) error { return kv.Delete(ctx, key) }},
		{"kv purge", func(key string) error { return kv.Purge(ctx, key) }},
	} {
		name := fencetest.Name("opdel")
		key := natsfence.EncodeKey(name)
		n := interfereBeforeCreate(t, key, func() {
			if err := op.do(key); err != nil {
				t.Errorf("%s: %v", op.what, err)
			}
		})
		l, err := a.TryAcquire(ctx, name, 10*time.Second)
		if err != nil {
			t.Fatalf("a grant with an operator's %s before its create: %v", op.what, err)
		}
		if n.Load() < 2 {
			t.Errorf("%s: the grant's first create was not refused (%d creates)", op.what, n.Load())
		}
		if lb, err := b.TryAcquire(ctx, name, 10*time.Second); err == nil {
			t.Fatalf("two holders after an operator's %s: A token %d, B token %d", op.what, l.Token(), lb.Token())
		}
		if err := l.Release(ctx); err != nil {
			t.Fatalf("release: %v", err)
		}
		natsfence.SetCreateHook(nil)
	}
}

// TestBucketRecreatedBetweenMarkerAndCreate: the bucket is
// deleted and re-created after a grant wrote its marker and before its
// create. The grant ends in one lease of the new bucket, with a token above
// every token of the old one, and another acquirer is refused while it
// holds.
func TestBucketRecreatedBetweenMarkerAndCreate(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-recreated-marker")
	j := js(t)
	a := newAcquirer(t, j, cfg, nil)
	var last fence.Token
	for i := 0; i < 10; i++ {
		l, err := a.TryAcquire(ctx, "warm", 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		last = l.Token()
		_ = l.Release(ctx)
	}
	name := fencetest.Name("recreated-marker")
	key := natsfence.EncodeKey(name)
	var b *natsfence.Acquirer
	var lb fence.Lease
	interfereBeforeCreate(t, key, func() {
		old, err := j.Stream(ctx, "KV_"+cfg.Bucket)
		if err != nil {
			t.Error(err)
			return
		}
		marker := old.CachedInfo().State.LastSeq // the revision A's create expects
		if err := j.DeleteKeyValue(ctx, cfg.Bucket); err != nil {
			t.Error(err)
			return
		}
		if _, err := j.CreateOrUpdateKeyValue(ctx, cfg); err != nil {
			t.Error(err)
			return
		}
		// Another client of the new bucket reserves the key, so the
		// marker it writes has the revision A's create expects.
		bj := js(t)
		b, err = natsfence.NewAcquirer(ctx, bj, cfg.Bucket, nil)
		if err != nil {
			t.Error(err)
			return
		}
		kv, err := bj.KeyValue(ctx, cfg.Bucket)
		if err != nil {
			t.Error(err)
			return
		}
		for i := uint64(1); i < marker; i++ {
			if _, err := kv.Put(ctx, "pad", nil); err != nil {
				t.Error(err)
				return
			}
		}
		if err := kv.Purge(ctx, key, jetstream.PurgeTTL(time.Second)); err != nil {
			t.Error(err)
		}
		if m, err := kv.Get(ctx, "pad"); err != nil || m.Revision() != marker-1 {
			t.Errorf("padding: %v, %v", m, err)
		}
	})
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatalf("a grant across the re-creation: %v", err)
	}
	defer l.Release(ctx)
	if l.Token() <= last {
		t.Fatalf("the grant across the re-creation: token %d, not above the old bucket's %d", l.Token(), last)
	}
	if b == nil {
		t.FailNow()
	}
	if lb, err = b.TryAcquire(ctx, name, 10*time.Second); err == nil {
		t.Fatalf("two holders: A token %d, B token %d", l.Token(), lb.Token())
	}
	li, err := b.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if !li.Held || li.Token != l.Token() {
		t.Fatalf("the new bucket holds %+v, want A's lease, token %d", li, l.Token())
	}
}
