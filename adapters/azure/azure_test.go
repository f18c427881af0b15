package azfence_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore/streaming"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/blockblob"
	"github.com/fencekit/fencekit/internal/linetest"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/lease"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
)

// azenv is a container on the test's Azure server.
type azenv struct {
	srv       *testenv.AzureServer
	container string
	c         *container.Client
}

// newClient returns a container client of srv, with its own connections,
// reaching the server at serviceURL.
func newClient(t testing.TB, srv *testenv.AzureServer, serviceURL, name string) *container.Client {
	return newClientVia(t, srv, serviceURL, name, &http.Transport{})
}

// newClientVia is newClient with the given transport.
func newClientVia(t testing.TB, srv *testenv.AzureServer, serviceURL, name string, rt http.RoundTripper) *container.Client {
	cred, err := azblob.NewSharedKeyCredential(srv.Account, srv.Key)
	if err != nil {
		t.Fatal(err)
	}
	sc, err := azblob.NewClientWithSharedKeyCredential(serviceURL, cred, &azblob.ClientOptions{ClientOptions: azcore.ClientOptions{
		Transport: &http.Client{Transport: rt},
		Retry:     policy.RetryOptions{TryTimeout: 10 * time.Second},
	}})
	if err != nil {
		t.Fatal(err)
	}
	return sc.ServiceClient().NewContainerClient(name)
}

// newEnv starts (or finds) the Azure server and makes a fresh container.
// localOnly skips t, or fails it under CI, when the tests run on an external
// Azure (FENCEKIT_AZURE_URL): what needs the fault proxy or a transport of the
// test's own runs only on the Azurite the tests start, and CI must run it.
func localOnly(t testing.TB, e *azenv, why string) {
	t.Helper()
	if !e.srv.External {
		return
	}
	testenv.SkipUnlessCI(t, "not run on the external Azure that FENCEKIT_AZURE_URL names ("+why+"); unset it to run on the Azurite the tests start")
}

// suiteFaultsLocalOnly says that a suite's fault cases do not run on an
// external Azure, and fails t under CI; the suite's other cases still run.
func suiteFaultsLocalOnly(t *testing.T, e *azenv) {
	t.Helper()
	if !e.srv.External {
		return
	}
	msg := "the suite's fault cases are not run on the external Azure that FENCEKIT_AZURE_URL names (the fault proxy needs a plain-HTTP server); unset it to run them on the Azurite the tests start"
	if os.Getenv("CI") != "" {
		t.Error(msg)
		return
	}
	t.Log(msg)
}

func newEnv(t testing.TB) *azenv {
	srv := testenv.RealAzure(t)
	e := &azenv{srv: srv, container: srv.Container}
	if e.container == "" {
		e.container = strings.ToLower(strings.ReplaceAll(fencetest.Name("fencekit"), "_", "-"))
		e.c = newClient(t, srv, srv.ServiceURL, e.container)
		if _, err := e.c.Create(context.Background(), nil); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = e.c.Delete(context.Background(), nil) })
		return e
	}
	e.c = newClient(t, srv, srv.ServiceURL, e.container)
	return e
}

// other returns a client of e's container with connections of its own.
func (e *azenv) other(t testing.TB) *container.Client {
	return newClient(t, e.srv, e.srv.ServiceURL, e.container)
}

// proxied returns a client of e's container that reaches the server only
// through a new faultnet proxy, and the proxy; nil for an external account.
func (e *azenv) proxied(t testing.TB) (*container.Client, *faultnet.Proxy) {
	p := faultnet.Start(t, e.srv.Host)
	u := strings.Replace(e.srv.ServiceURL, e.srv.Host, p.Addr(), 1)
	return newClient(t, e.srv, u, e.container), p
}

func newWriter(t testing.TB, c *container.Client, o *azfence.WriterOptions) *azfence.Writer {
	w, err := azfence.NewWriter(c, o)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func newAcquirer(t testing.TB, c *container.Client) *azfence.Acquirer {
	a, err := azfence.NewAcquirer(c, &azfence.AcquirerOptions{Backoff: fence.Backoff{Min: 20 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// deleteLock deletes name's lock blob, breaking its lease first.
func deleteLock(t *testing.T, c *container.Client, name string) {
	bc := c.NewBlobClient("fencekit-locks/" + name)
	lc, err := lease.NewBlobClient(bc, nil)
	if err != nil {
		t.Fatal(err)
	}
	zero := int32(0)
	_, _ = lc.BreakLease(context.Background(), &lease.BlobBreakOptions{BreakPeriod: &zero})
	incl := blob.DeleteSnapshotsOptionTypeInclude
	if _, err := bc.Delete(context.Background(), &blob.DeleteOptions{DeleteSnapshots: &incl}); err != nil {
		t.Fatalf("deleting lock blob %q: %v", name, err)
	}
}

func TestWriterConformance(t *testing.T) {
	e := newEnv(t)
	w := newWriter(t, e.c, nil)
	s := fencetest.WriterSuite{
		New:     func(*testing.T) fence.FencedWriter { return w },
		BadKeys: []string{"nul\x00", "bad \xff", "dot.", "slash/", "back\\slash", "a/../b", "a//b", "./a", "/a", strings.Repeat("k", azfence.MaxKeyBytes+1)},
		// 8 writers, as on S3 and GCS: with the default 16 on one blob, a
		// write lost its conditional put 8 times in a row (MaxAttempts,
		// ErrContention) on a loaded machine.
		Writers: 8, WritesEach: 20,
	}
	if !e.srv.External {
		s.Faulty = func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			c, p := e.proxied(t)
			return newWriter(t, c, nil), p
		}
	}
	suiteFaultsLocalOnly(t, e)
	s.Run(t)
}

func TestAcquirerConformance(t *testing.T) {
	e := newEnv(t)
	a := newAcquirer(t, e.c)
	s := fencetest.AcquirerSuite{
		New:      func(*testing.T) fence.Acquirer { return a },
		NewOther: func(t *testing.T) fence.Acquirer { return newAcquirer(t, e.other(t)) },
		ShortTTL: azfence.MinLeaseDuration,
		MaxTTL:   azfence.MaxAcquirerTTL,
		BadNames: []string{"nul\x00", "bad \xff", "dot.", "slash/", "back\\slash", "a/./b", "a//b", "x/../b", "/a", strings.Repeat("n", azfence.MaxKeyBytes)},
		Parallel: true,
		// The lock blob deleted while a lease may be held on it: its lease
		// broken first (Azure refuses to delete a leased blob otherwise).
		DeleteState: func(t *testing.T, name string) { deleteLock(t, e.c, name) },
		SetCounter: func(t *testing.T, name string, tok fence.Token) {
			v := strconv.FormatUint(uint64(tok), 10)
			_, err := e.c.NewBlockBlobClient("fencekit-locks/"+name).Upload(context.Background(), streaming.NopCloser(bytes.NewReader(nil)),
				&blockblob.UploadOptions{Metadata: map[string]*string{azfence.MetaToken: &v}})
			if err != nil {
				t.Fatal(err)
			}
		},
	}
	if !e.srv.External {
		s.Faulty = func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
			c, p := e.proxied(t)
			return newAcquirer(t, c), p
		}
	}
	suiteFaultsLocalOnly(t, e)
	s.Run(t)
}

// TestAcquireLineOrder: the waiting Acquire calls of one acquirer are granted
// in the order they began, and a holder that releases and asks again joins at
// the back (linetest.Order).
func TestAcquireLineOrder(t *testing.T) {
	e := newEnv(t)
	a := newAcquirer(t, e.c)
	// A grant statement slower than wakeup.Stall on a loaded machine lets
	// the waiters behind the head try out of turn, by design (the same check
	// once saw [0 4 1 2 3 -1] on PostgreSQL); the order itself is what is
	// checked here.
	azfence.SetLineStall(a, time.Minute)
	linetest.Order(t, a, func(name string) int { return azfence.LineLen(a, name) }, 30*time.Second)
}

// leaseAction returns the x-ms-lease-action of r ("" for none): azcore sets
// its headers with lower-case keys, which Header.Get does not find.
func leaseAction(r *http.Request) string {
	for k, v := range r.Header {
		if len(v) > 0 && http.CanonicalHeaderKey(k) == "X-Ms-Lease-Action" {
			return v[0]
		}
	}
	return ""
}

func expectHeldBy(t *testing.T, b *azfence.Acquirer, name string) {
	t.Helper()
	if l, err := b.TryAcquire(context.Background(), name, 15*time.Second); !errors.Is(err, fence.ErrHeld) {
		if err == nil {
			_ = l.Release(context.Background())
		}
		t.Fatalf("another TryAcquire while the name is held: %v, want ErrHeld", err)
	}
}
