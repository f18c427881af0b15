package gcsfence_test

import (
	"net/url"
	"testing"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// faultyWriter returns the WriterSuite's Faulty: a writer with opts on a
// client of its own that reaches e's fake only through a new faultnet proxy.
// It is nil for real GCS, whose TLS name a loopback proxy would not match.
func faultyWriter(e *gcsEnv, opts *gcsfence.WriterOptions) func(*testing.T) (fence.FencedWriter, *faultnet.Proxy) {
	if e.url == "" {
		return nil
	}
	return func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
		env, p := proxied(t, e)
		return newWriter(t, env, opts), p
	}
}

// faultyAcquirer returns the AcquirerSuite's Faulty, as faultyWriter.
func faultyAcquirer(e *gcsEnv) func(*testing.T) (fence.Acquirer, *faultnet.Proxy) {
	if e.url == "" {
		return nil
	}
	return func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
		env, p := proxied(t, e)
		return newAcquirer(t, env), p
	}
}

// proxied returns e's bucket on a client of its own that reaches the fake
// only through a new proxy, and the proxy.
func proxied(t testing.TB, e *gcsEnv) (*gcsEnv, *faultnet.Proxy) {
	u, err := url.Parse(e.url)
	if err != nil {
		t.Fatal(err)
	}
	p := faultnet.Start(t, u.Host)
	base := "http://" + p.Addr()
	return &gcsEnv{c: newClient(t, base), bucket: e.bucket, url: base}, p
}
