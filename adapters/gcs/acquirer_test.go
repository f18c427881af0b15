package gcsfence_test

import (
	"testing"
	"time"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

func newAcquirer(t testing.TB, e *gcsEnv) *gcsfence.Acquirer {
	a, err := gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{Backoff: fence.Backoff{Min: 5 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// TestAcquirerConformance runs the acquirer suite on the fake and on real GCS
// (when configured). The fake stamps objects in microseconds, so expiry is
// precise: the short ttl is 300ms. Real GCS takes about one write a second
// per object, so there the short ttl is 4s.
func TestAcquirerConformance(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		t.Parallel()
		a := newAcquirer(t, e)
		short := 300 * time.Millisecond
		if e.url == "" {
			short = 4 * time.Second
		}
		fencetest.AcquirerSuite{
			New: func(*testing.T) fence.Acquirer { return a },
			// Another process: an acquirer on a client (and connections) of its own.
			NewOther: func(t *testing.T) fence.Acquirer {
				if e.url == "" {
					return newAcquirer(t, realGCS(t))
				}
				return newAcquirer(t, &gcsEnv{c: newClient(t, e.url), bucket: e.bucket, url: e.url})
			},
			Faulty:   faultyAcquirer(e),
			ShortTTL: short,
			MaxTTL:   gcsfence.MaxAcquirerTTL,
			BadNames: []string{"nul\x00", "bad \xff", "line\nfeed"},
			Workers:  4, Increments: 5,
		}.Run(t)
	})
}
