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
func faultyWriter(e *s3env, opts *s3fence.Options) func(*testing.T) (fence.FencedWriter, *faultnet.Proxy) {
	if testenv.ExternalS3() {
		return nil
	}
	return func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
		o := e.c.Options()
		u, err := url.Parse(aws.ToString(o.BaseEndpoint))
		if err != nil {
			t.Fatal(err)
		}
		p := faultnet.Start(t, u.Host)
		c := s3.New(o, func(o *s3.Options) {
			o.BaseEndpoint = aws.String(u.Scheme + "://" + p.Addr())
			o.HTTPClient = &http.Client{Transport: &http.Transport{}}
		})
		w, err := s3fence.New(c, e.bucket, opts)
		if err != nil {
			t.Fatal(err)
		}
		return w, p
	}
}
