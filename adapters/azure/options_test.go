package azfence_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/bloberror"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestOptionsRefusedAtConstruction: an Owner that cannot go into
// an HTTP header as Azure signs it (a line break, a control character,
// non-ASCII, spaces at either end) and a Prefix with a "." or ".." path
// segment made every later call fail (net/http's invalid header value, 403
// AuthorizationFailure from the server, or ErrInvalid for every name): the
// constructors must refuse them with fence.ErrInvalid instead. The same
// options, accepted, must work.
func TestOptionsRefusedAtConstruction(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	for _, o := range []*azfence.AcquirerOptions{{Owner: "a\nb"}, {Owner: "a\x01b"}, {Owner: "Zo\u00eb"}, {Owner: " pad"}, {Owner: "pad "},
		{Prefix: "x/./"}, {Prefix: "../"}, {Prefix: "x/../y/"}} {
		a, err := azfence.NewAcquirer(e.c, o)
		if errors.Is(err, fence.ErrInvalid) {
			continue
		}
		if err != nil {
			t.Errorf("NewAcquirer(%#v): %v, want ErrInvalid", *o, err)
			continue
		}
		l, err := a.TryAcquire(ctx, fencetest.Name("opt"), 15*time.Second)
		if err == nil {
			_ = l.Release(ctx)
		}
		t.Errorf("NewAcquirer(%#v) accepted the options; TryAcquire then: %v", *o, err)
	}
	for _, o := range []*azfence.WriterOptions{{Prefix: "x/./"}, {Prefix: "../"}, {Prefix: "x/../y/"}} {
		w, err := azfence.NewWriter(e.c, o)
		if errors.Is(err, fence.ErrInvalid) {
			continue
		}
		if err != nil {
			t.Errorf("New(%#v): %v, want ErrInvalid", *o, err)
			continue
		}
		t.Errorf("New(%#v) accepted the options; Write then: %v", *o, w.Write(ctx, fencetest.Name("opt"), []byte("v"), 1))
	}
	// Near misses that Azure stores as given are accepted and work.
	for _, o := range []*azfence.AcquirerOptions{{Owner: "host-1/42 (worker a)"}, {Prefix: "x/.y/"}, {Prefix: "x/."}, {Prefix: "..x/"}} {
		a, err := azfence.NewAcquirer(e.c, o)
		if err != nil {
			t.Errorf("NewAcquirer(%#v): %v", *o, err)
			continue
		}
		l, err := a.TryAcquire(ctx, fencetest.Name("opt"), 15*time.Second)
		if err != nil {
			t.Errorf("NewAcquirer(%#v), then TryAcquire: %v", *o, err)
			continue
		}
		if err := l.Release(ctx); err != nil {
			t.Error(err)
		}
	}
	for _, o := range []*azfence.WriterOptions{{Prefix: "x/."}, {Prefix: "x/.y/"}} {
		w := newWriter(t, e.c, o)
		if err := w.Write(ctx, fencetest.Name("opt"), []byte("v"), 1); err != nil {
			t.Errorf("New(%#v), then Write: %v", *o, err)
		}
	}
}

// TestMissingContainer (bad input): a client of a container that does not
// exist. Every call must say so (Azure's ContainerNotFound in the chain),
// not answer that the key was not found (Read) or that the blob kept changing
// (Write, Delete, TryAcquire, after a burst of requests).
func TestMissingContainer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	c := newClient(t, e.srv, e.srv.ServiceURL, "no-such-"+strings.ToLower(strings.ReplaceAll(fencetest.Name("c"), "_", "-")))
	w, a := newWriter(t, c, nil), newAcquirer(t, c)
	ctx := context.Background()
	check := func(what string, err error) {
		t.Helper()
		switch {
		case err == nil:
			t.Errorf("%s in a missing container: no error", what)
		case errors.Is(err, fence.ErrNotFound) || errors.Is(err, azfence.ErrContention) || !bloberror.HasCode(err, bloberror.ContainerNotFound):
			t.Errorf("%s in a missing container: %v, want Azure's ContainerNotFound", what, err)
		default:
			t.Logf("%s: %v", what, err)
		}
	}
	check("Write", w.Write(ctx, "k", []byte("v"), 1))
	check("Delete", w.Delete(ctx, "k", 1))
	_, _, err := w.Read(ctx, "k")
	check("Read", err)
	_, err = a.TryAcquire(ctx, "n", 15*time.Second)
	check("TryAcquire", err)
}
