package azfence_test

import (
	"context"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/bloberror"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/lease"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// TestNemesis: clients on Azurite, each acquirer and writer on a client of
// its own behind a proxy of its own, call random lease and write operations
// while replies are lost, latency added, clients partitioned and a name's
// lock blob deleted; the history holds (fencetest.NemesisSuite). An
// external account (FENCEKIT_AZURE_URL) has no proxies (e.proxied needs a
// plain-HTTP server): its clients, each on a client of its own, get nil
// proxies and only the deletions and their own pauses.
//
// The ttl is the acquirer suite's, Azure's shortest blob lease, 15s:
// partitions then last up to 30s, so one seed of 45s runs (three ttls,
// faults for 31.5s), under a minute with the checks after it, instead of
// the suite's 4s three times, which would not hold a single ttl.
func TestNemesis(t *testing.T) {
	e := newEnv(t)
	s := fencetest.NemesisSuite{
		Acquirer: func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
			c, p := e.proxied(t)
			return newAcquirer(t, c), p
		},
		Writer: func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			c, p := e.proxied(t)
			return newWriter(t, c, nil), p
		},
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			return newAcquirer(t, e.c), newWriter(t, e.c, nil)
		},
		DeleteState: func(t *testing.T, name string) { deleteLockRacing(t, e.c, name) },
		ShortTTL:    azfence.MinLeaseDuration,
		Duration:    45 * time.Second,
		Seeds:       1,
	}
	if e.srv.External {
		s.Acquirer = func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) { return newAcquirer(t, e.other(t)), nil }
		s.Writer = func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) { return newWriter(t, e.other(t), nil), nil }
	}
	s.Run(t)
}

// deleteLockRacing is deleteLock for the nemesis, which calls it from a
// goroutine of its own while clients grant the name: a name with no lock
// blob yet is fine, and a client that leases the blob between the break and
// the delete makes it break and delete again.
func deleteLockRacing(t *testing.T, c *container.Client, name string) {
	ctx := context.Background()
	bc := c.NewBlobClient("fencekit-locks/" + name)
	lc, err := lease.NewBlobClient(bc, nil)
	if err != nil {
		t.Errorf("a lease client of %q: %v", name, err)
		return
	}
	zero := int32(0)
	incl := blob.DeleteSnapshotsOptionTypeInclude
	for range 5 {
		_, _ = lc.BreakLease(ctx, &lease.BlobBreakOptions{BreakPeriod: &zero})
		_, err = bc.Delete(ctx, &blob.DeleteOptions{DeleteSnapshots: &incl})
		if err == nil || bloberror.HasCode(err, bloberror.BlobNotFound) {
			return
		}
		if !bloberror.HasCode(err, bloberror.LeaseIDMissing, bloberror.LeaseIDMismatchWithBlobOperation) {
			break
		}
	}
	t.Errorf("deleting lock blob %q: %v", name, err)
}
