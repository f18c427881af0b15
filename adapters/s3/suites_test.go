package s3fence_test

import (
	"net/http"
	"net/url"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
)

// faultyWriter returns the WriterSuite's Faulty: a writer with opts on a
// client of its own that reaches e's server only through a new faultnet
// proxy. It is nil for an external server (FENCEKIT_S3_ENDPOINT), whose TLS
// name a loopback proxy would not match.
func faultyWriter(e *s3env, opts *s3fence.WriterOptions) func(*testing.T) (fence.FencedWriter, *faultnet.Proxy) {
	if testenv.ExternalS3() {
		return nil
	}
	return func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
		c, p := proxiedClient(t, e)
		w, err := s3fence.NewWriter(c, e.bucket, opts)
		if err != nil {
			t.Fatal(err)
		}
		return w, p
	}
}

// faultyAcquirer returns the AcquirerSuite's Faulty: an acquirer (with the
// suite's options, newAcquirer) on a client of its own that reaches e's
// server only through a new faultnet proxy; nil for an external server, as
// faultyWriter.
func faultyAcquirer(e *s3env) func(*testing.T) (fence.Acquirer, *faultnet.Proxy) {
	if testenv.ExternalS3() {
		return nil
	}
	return func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
		c, p := proxiedClient(t, e)
		return newAcquirer(t, &s3env{c: c, bucket: e.bucket}), p
	}
}

// proxiedClient returns a client of e's server that reaches it only through
// a new proxy (clientVia), and the proxy.
func proxiedClient(t testing.TB, e *s3env) (*s3.Client, *faultnet.Proxy) {
	p := faultnet.Start(t, serverHost(t, e))
	return clientVia(e, p), p
}

// serverHost is the host:port of e's server, a proxy's target.
func serverHost(t testing.TB, e *s3env) string {
	u, err := url.Parse(aws.ToString(e.c.Options().BaseEndpoint))
	if err != nil {
		t.Fatal(err)
	}
	return u.Host
}

// clientVia returns a client with e's options and connections of its own
// that reaches e's server through p.
func clientVia(e *s3env, p *faultnet.Proxy) *s3.Client {
	return s3.New(e.c.Options(), func(o *s3.Options) {
		u, _ := url.Parse(aws.ToString(o.BaseEndpoint))
		o.BaseEndpoint = aws.String(u.Scheme + "://" + p.Addr())
		o.HTTPClient = &http.Client{Transport: &http.Transport{}}
	})
}
