package azfence_test

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore"
	"github.com/Azure/azure-sdk-for-go/sdk/azcore/policy"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/sas"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// TestNoSASSignatureInErrors: a container client made from a
// SAS URL carries the signature in every request's query; a request that
// gets no answer (a refused connection, a reset, a timeout) comes back from
// net/http as a *url.Error holding the whole URL. No error the Writer, the
// Acquirer or a lease returns may contain the signature.
func TestNoSASSignatureInErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	localOnly(t, e, "the fault proxy needs a plain-HTTP server")
	sasURL, err := e.c.GetSASURL(sas.ContainerPermissions{Read: true, Add: true, Create: true, Write: true, Delete: true, Tag: true},
		time.Now().Add(time.Hour), nil)
	if err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(sasURL)
	if err != nil {
		t.Fatal(err)
	}
	sig := u.Query().Get("sig")
	if sig == "" {
		t.Fatalf("no signature in the SAS URL %s", sasURL)
	}
	p := faultnet.Start(t, e.srv.Host)
	u.Host = p.Addr()
	c, err := container.NewClientWithNoCredential(u.String(), &container.ClientOptions{ClientOptions: azcore.ClientOptions{
		Retry: policy.RetryOptions{MaxRetries: 1, RetryDelay: 10 * time.Millisecond, TryTimeout: 5 * time.Second},
	}})
	if err != nil {
		t.Fatal(err)
	}
	w, a := newWriter(t, c, nil), newAcquirer(t, c)
	ctx := context.Background()
	name := fencetest.Name("sas")
	if err := w.Write(ctx, name, []byte("v"), 1); err != nil {
		t.Fatalf("a write through the SAS client: %v", err)
	}
	l, err := a.TryAcquire(ctx, name, 15*time.Second)
	if err != nil {
		t.Fatalf("a grant through the SAS client: %v", err)
	}
	p.Refuse(true)
	p.CutAll()
	check := func(what string, err error) {
		t.Helper()
		if err == nil {
			t.Fatalf("%s with every connection refused: no error", what)
		}
		if msg := err.Error(); strings.Contains(msg, sig) || strings.Contains(msg, url.QueryEscape(sig)) {
			t.Errorf("%s: the error holds the SAS signature: %v", what, err)
		} else {
			t.Logf("%s: %v", what, err)
		}
	}
	tctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	check("Write", w.Write(tctx, name, []byte("w"), 2))
	check("Delete", w.Delete(tctx, name, 2))
	_, _, err = w.Read(tctx, name)
	check("Read", err)
	_, err = a.TryAcquire(tctx, name+"-other", 15*time.Second)
	check("TryAcquire", err)
	check("Renew", l.Renew(tctx))
	check("Release", l.Release(tctx))
}
