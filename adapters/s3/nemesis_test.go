package s3fence_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// TestNemesis: clients on gofakes3 and on the real S3 server, each acquirer
// and writer on a client of its own behind a proxy of its own, call random
// lease and write operations while replies are lost, latency added, clients
// partitioned and a name's lock object deleted; the history holds
// (fencetest.NemesisSuite). An external server (FENCEKIT_S3_ENDPOINT) has
// no proxies (faultyAcquirer): its clients reach it directly, with nil
// proxies, and get only the deletions and their own pauses.
//
// The ttl is the acquirer suite's 12s, and the expiry lag the 2s + 2 x
// DateLag by which S3's whole-second, possibly lagging clock may grant an
// expired name late (see TestAcquirerConformance). Partitions then last up
// to 24s: one seed of 36s runs (three ttls, faults for 25s), the two
// servers in parallel, under a minute with the checks after it, instead of
// the suite's 4s three times, which would not hold a single ttl.
func TestNemesis(t *testing.T) { servers(t, testNemesis) }

func testNemesis(t *testing.T, e *s3env) {
	acquirer, writer := faultyAcquirer(e), faultyWriter(e, nil)
	if acquirer == nil {
		acquirer = func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) {
			return newAcquirer(t, &s3env{c: clientOfItsOwn(e), bucket: e.bucket}), nil
		}
		writer = func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) {
			return newWriter(t, &s3env{c: clientOfItsOwn(e), bucket: e.bucket}, nil), nil
		}
	}
	fencetest.NemesisSuite{
		Acquirer: acquirer,
		Writer:   writer,
		Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
			return newAcquirer(t, e), newWriter(t, e, nil)
		},
		// The name's lock object, as the acquirer suite's DeleteState; the
		// writer's object of the same name stays.
		DeleteState: func(t *testing.T, name string) {
			if _, err := e.c.DeleteObject(context.Background(), &s3.DeleteObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("fencekit-locks/" + name)}); err != nil {
				t.Errorf("deleting the lock object of %q: %v", name, err)
			}
		},
		ShortTTL:  2 * (2*time.Second + 2*s3fence.DefaultDateLag),
		ExpiryLag: 2*time.Second + 2*s3fence.DefaultDateLag,
		Duration:  36 * time.Second,
		Seeds:     1,
	}.Run(t)
}

// clientOfItsOwn returns a client with e's options and connections of its
// own, as the acquirer suite's NewOther.
func clientOfItsOwn(e *s3env) *s3.Client {
	return s3.New(e.c.Options(), func(o *s3.Options) {
		o.HTTPClient = &http.Client{Transport: &http.Transport{}}
	})
}
