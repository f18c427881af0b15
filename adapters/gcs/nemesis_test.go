package gcsfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"cloud.google.com/go/storage"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// TestNemesis: clients on fake-gcs-server, each acquirer and writer on a
// client of its own behind a proxy of its own, call random lease and write
// operations while replies are lost, latency added, clients partitioned and
// a name's lock object deleted; the history holds (fencetest.NemesisSuite).
//
// On the fake the ttl is the acquirer suite's 300ms (it stamps objects in
// microseconds), with the suite's default runs. On real GCS (when
// configured) there is no proxy (faultyAcquirer: its TLS name): the clients,
// each on a client of its own, get nil proxies and only the deletions and
// their own pauses; the ttl is the acquirer suite's 4s (one write a second
// per object), so each seed runs 24s and two run, about a minute.
func TestNemesis(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		s := fencetest.NemesisSuite{
			Acquirer: faultyAcquirer(e),
			Writer:   faultyWriter(e, nil),
			Direct: func(t *testing.T) (fence.Acquirer, fence.FencedWriter) {
				return newAcquirer(t, e), newWriter(t, e, nil)
			},
			// The lock object, as the acquirer suite's DeleteState; the
			// writer's object of the same name stays.
			DeleteState: func(t *testing.T, name string) {
				err := e.b().Object("fencekit-locks/" + name).Delete(context.Background())
				if err != nil && !errors.Is(err, storage.ErrObjectNotExist) {
					t.Errorf("deleting the lock object of %q: %v", name, err)
				}
			},
			ShortTTL: 300 * time.Millisecond,
		}
		if e.url == "" {
			s.Acquirer = func(t *testing.T) (fence.Acquirer, *faultnet.Proxy) { return newAcquirer(t, realGCS(t)), nil }
			s.Writer = func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy) { return newWriter(t, realGCS(t), nil), nil }
			s.ShortTTL, s.Duration, s.Seeds = 4*time.Second, 24*time.Second, 2
		}
		s.Run(t)
	})
}
