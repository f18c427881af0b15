package azfence_test

import (
	"bytes"
	"context"
	"errors"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/streaming"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blockblob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/lease"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// status returns err's HTTP status and Azure error code ("" for none).
func status(err error) (int, string) {
	var re *azcore.ResponseError
	if errors.As(err, &re) {
		return re.StatusCode, re.ErrorCode
	}
	return 0, ""
}

func wantStatus(t *testing.T, what string, err error, code int, ecodes ...string) {
	t.Helper()
	s, c := status(err)
	if s != code || !slices.Contains(ecodes, c) {
		t.Errorf("%s: %d %s (%v), want %d %v", what, s, c, err, code, ecodes)
	} else {
		t.Logf("%s: %d %s", what, s, c)
	}
}

// TestServerSemantics asserts what the package relies on, as the server
// behaves (the README's table comes from this test's log): the status codes
// of each failed condition, that the blob index tag condition is enforced,
// that lease operations leave the ETag alone, that a lease is granted again
// to the ID that holds it, and that responses carry a Date.
func TestServerSemantics(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	name := fencetest.Name("sem")
	bc := e.c.NewBlockBlobClient(name)
	up := func(mac *blob.ModifiedAccessConditions, lac *blob.LeaseAccessConditions, tags map[string]string) (blockblob.UploadResponse, error) {
		return bc.Upload(ctx, streaming.NopCloser(bytes.NewReader([]byte("x"))), &blockblob.UploadOptions{Tags: tags,
			AccessConditions: &blob.AccessConditions{ModifiedAccessConditions: mac, LeaseAccessConditions: lac}})
	}
	star := azcore.ETagAny
	bad := azcore.ETag(`"0x1"`)
	_, err := up(&blob.ModifiedAccessConditions{IfMatch: &bad}, nil, nil)
	wantStatus(t, "If-Match on a missing blob", err, 412, "ConditionNotMet")
	r1, err := up(&blob.ModifiedAccessConditions{IfNoneMatch: &star}, nil, map[string]string{"fencewrite": "a"})
	if err != nil {
		t.Fatal(err)
	}
	if r1.Date == nil {
		t.Error("no Date header on a Put Blob answer")
	}
	_, err = up(&blob.ModifiedAccessConditions{IfNoneMatch: &star}, nil, nil)
	wantStatus(t, "If-None-Match: * on an existing blob", err, 409, "BlobAlreadyExists")
	_, err = up(&blob.ModifiedAccessConditions{IfMatch: &bad}, nil, nil)
	wantStatus(t, "If-Match on another ETag", err, 412, "ConditionNotMet")
	wrong := `"fencewrite" = 'b'`
	rw, err := up(&blob.ModifiedAccessConditions{IfMatch: r1.ETag, IfTags: &wrong}, nil, map[string]string{"fencewrite": "a"})
	if e.srv.External {
		// Azure documents x-ms-if-tags on Put Blob: the ABA guard.
		wantStatus(t, "If-Match on the current ETag with another write id tag", err, 412, "ConditionNotMet")
	} else if err == nil {
		// Azurite 3.37.0 ignores x-ms-if-tags on Put Blob: the writer's
		// tag guard against a reused ETag holds on Azure only.
		t.Logf("If-Match on the current ETag with another write id tag: accepted (the server ignores x-ms-if-tags on Put Blob)")
		r1 = rw
	}
	right := `"fencewrite" = 'a'`
	r2, err := up(&blob.ModifiedAccessConditions{IfMatch: r1.ETag, IfTags: &right}, nil, map[string]string{"fencewrite": "c"})
	if err != nil {
		t.Fatalf("If-Match and the right tag: %v", err)
	}
	if *r2.ETag == *r1.ETag {
		t.Errorf("a rewrite kept the ETag %s", *r1.ETag)
	}

	id1, id2 := "11111111-1111-4111-8111-111111111111", "22222222-2222-4222-8222-222222222222"
	l1, _ := lease.NewBlobClient(e.c.NewBlobClient(name), &lease.BlobClientOptions{LeaseID: &id1})
	l2, _ := lease.NewBlobClient(e.c.NewBlobClient(name), &lease.BlobClientOptions{LeaseID: &id2})
	if _, err := l1.AcquireLease(ctx, 15, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := l1.AcquireLease(ctx, 15, nil); err != nil {
		t.Errorf("acquire again with the holding lease ID: %v, want it granted (how a lost acquire is recognised)", err)
	}
	_, err = l2.AcquireLease(ctx, 15, nil)
	wantStatus(t, "acquire with another lease ID", err, 409, "LeaseAlreadyPresent")
	_, err = up(nil, nil, nil)
	wantStatus(t, "a write without the lease ID", err, 412, "LeaseIdMissing")
	_, err = up(nil, &blob.LeaseAccessConditions{LeaseID: &id2}, nil)
	wantStatus(t, "a write with another lease ID", err, 412, "LeaseIdMismatchWithBlobOperation")
	_, err = l2.RenewLease(ctx, nil)
	wantStatus(t, "renew with another lease ID", err, 409, "LeaseIdMismatchWithLeaseOperation")
	if _, err := l1.RenewLease(ctx, nil); err != nil {
		t.Error(err)
	}
	p, err := e.c.NewBlobClient(name).GetProperties(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if *p.ETag != *r2.ETag {
		t.Errorf("lease acquire/renew changed the ETag: %s, was %s", *p.ETag, *r2.ETag)
	}
	if _, err := l1.ReleaseLease(ctx, nil); err != nil {
		t.Error(err)
	}
	_, err = l1.ReleaseLease(ctx, nil)
	// Azure documents LeaseNotPresentWithLeaseOperation; Azurite 3.37.0 answers
	// LeaseIdMismatchWithLeaseOperation.
	wantStatus(t, "release of a released lease", err, 409, "LeaseNotPresentWithLeaseOperation", "LeaseIdMismatchWithLeaseOperation")
	_, err = l1.RenewLease(ctx, nil)
	wantStatus(t, "renew of a released lease", err, 409, "LeaseNotPresentWithLeaseOperation", "LeaseIdMismatchWithLeaseOperation")
	if _, err := l1.AcquireLease(ctx, 15, nil); err != nil {
		t.Fatal(err)
	}
	zero := int32(0)
	if _, err := l2.BreakLease(ctx, &lease.BlobBreakOptions{BreakPeriod: &zero}); err != nil {
		t.Fatal(err)
	}
	_, err = l1.RenewLease(ctx, nil)
	wantStatus(t, "renew of a broken lease", err, 409, "LeaseIsBrokenAndCannotBeRenewed")
	p, _ = e.c.NewBlobClient(name).GetProperties(ctx, nil)
	if *p.ETag != *r2.ETag {
		t.Errorf("lease release/break changed the ETag: %s, was %s", *p.ETag, *r2.ETag)
	}
	for _, d := range []int32{14, 61} {
		_, err = l1.AcquireLease(ctx, d, nil)
		if s, _ := status(err); s != 400 {
			t.Errorf("a %d s lease: %v, want 400", d, err)
		}
	}
}

// TestDeletedLockBlob: a lock blob broken and deleted while its
// holder runs: the next grant's token is above the old holder's, and the
// holder learns at its next Renew that it lost the lease.
func TestDeletedLockBlob(t *testing.T) {
	e := newEnv(t)
	a, b := newAcquirer(t, e.c), newAcquirer(t, e.other(t))
	ctx := context.Background()
	name := fencetest.Name("deleted")
	la, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ { // a few grants, so the counter is past its start
		if err := la.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if la, err = a.TryAcquire(ctx, name, 30*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	deleteLock(t, e.c, name)
	lb, err := b.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer lb.Release(ctx)
	if lb.Token() <= la.Token() {
		t.Fatalf("after the lock blob was deleted, the new grant has token %d, not above the old holder's %d", lb.Token(), la.Token())
	}
	// The clock read for the new blob's first token (a snapshot) leaves no
	// snapshot behind.
	pfx := "fencekit-locks/" + name
	pager := e.c.NewListBlobsFlatPager(&container.ListBlobsFlatOptions{Prefix: &pfx, Include: container.ListBlobsInclude{Snapshots: true}})
	n := 0
	for pager.More() {
		page, err := pager.NextPage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		n += len(page.Segment.BlobItems)
	}
	if n != 1 {
		t.Errorf("%d blobs and snapshots under %s, want the lock blob alone", n, pfx)
	}
	if err := la.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew of the deleted blob's lease: %v, want ErrLost", err)
	}
	w := newWriter(t, e.c, nil)
	if err := w.Write(ctx, name, []byte("new"), lb.Token()); err != nil {
		t.Fatal(err)
	}
	var se *fence.StaleError
	if err := w.Write(ctx, name, []byte("old"), la.Token()); !errors.As(err, &se) {
		t.Errorf("the old holder's write after the new one: %v, want *fence.StaleError", err)
	}
}

// TestNamesByteExact: names that differ only in case, Unicode
// normalisation or a trailing space are different locks and different keys.
func TestNamesByteExact(t *testing.T) {
	e := newEnv(t)
	a, w := newAcquirer(t, e.c), newWriter(t, e.c, nil)
	ctx := context.Background()
	base := fencetest.Name("exact")
	names := []string{base + "-Lock", base + "-lock", base + "-caf\u00e9", base + "-cafe\u0301", base + "-x ", base + "-x"}
	for i, n := range names {
		l, err := a.TryAcquire(ctx, n, 30*time.Second)
		if err != nil {
			t.Fatalf("TryAcquire(%q) with the others held: %v", n, err)
		}
		defer l.Release(ctx)
		if err := w.Write(ctx, n, []byte(strconv.Itoa(i)), fence.Token(i+1)); err != nil {
			t.Fatal(err)
		}
	}
	for i, n := range names {
		v, tok, err := w.Read(ctx, n)
		if err != nil || string(v) != strconv.Itoa(i) || tok != fence.Token(i+1) {
			t.Errorf("Read(%q) = %q, %d, %v; want %d, %d", n, v, tok, err, i, i+1)
		}
	}
}

// TestBadOptions: every option is checked by the constructors.
func TestBadOptions(t *testing.T) {
	e := newEnv(t)
	for _, o := range []*azfence.WriterOptions{{MaxAttempts: -1}, {Prefix: "bad\xff"}, {Prefix: "nul\x00"}, {Prefix: strings.Repeat("p", azfence.MaxKeyBytes)}} {
		if _, err := azfence.NewWriter(e.c, o); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("New(%+v): %v, want ErrInvalid", o, err)
		}
	}
	if _, err := azfence.NewWriter(nil, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("New(nil): %v, want ErrInvalid", err)
	}
	for _, o := range []*azfence.AcquirerOptions{{Drift: -1}, {MaxAttempts: -1}, {Drift: math.MaxInt64}, {Drift: azfence.MaxAcquirerTTL},
		{Backoff: fence.Backoff{Min: -1}}, {Prefix: "bad\xff"}, {Owner: "nul\x00"}} {
		if _, err := azfence.NewAcquirer(e.c, o); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewAcquirer(%+v): %v, want ErrInvalid", o, err)
		}
	}
	if _, err := azfence.NewAcquirer(nil, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("NewAcquirer(nil): %v, want ErrInvalid", err)
	}
	a, err := azfence.NewAcquirer(e.c, &azfence.AcquirerOptions{Drift: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	fencetest.DriftRefusesShortTTL(t, a, 20*time.Second, "ttl")
}

// TestUnfencedBlobs: a blob another tool wrote reads as token 0 and any
// fenced write replaces it; with RefuseUnfenced both are refused.
func TestUnfencedBlobs(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	key := fencetest.Name("plain")
	if _, err := e.c.NewBlockBlobClient(key).Upload(ctx, streaming.NopCloser(bytes.NewReader([]byte("by hand"))), nil); err != nil {
		t.Fatal(err)
	}
	strict := newWriter(t, e.c, &azfence.WriterOptions{RefuseUnfenced: true})
	if _, _, err := strict.Read(ctx, key); !errors.Is(err, azfence.ErrUnfenced) {
		t.Errorf("strict Read of an unfenced blob: %v, want ErrUnfenced", err)
	}
	if err := strict.Write(ctx, key, []byte("x"), 1); !errors.Is(err, azfence.ErrUnfenced) {
		t.Errorf("strict Write over an unfenced blob: %v, want ErrUnfenced", err)
	}
	w := newWriter(t, e.c, nil)
	if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "by hand" || tok != 0 {
		t.Errorf("Read of an unfenced blob = %q, %d, %v; want its body with token 0", v, tok, err)
	}
	if err := w.Write(ctx, key, []byte("fenced"), 1); err != nil {
		t.Fatal(err)
	}
	if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "fenced" || tok != 1 {
		t.Errorf("after a fenced write: %q, %d, %v", v, tok, err)
	}
}
