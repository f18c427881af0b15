package azfence_test

import (
	"bytes"
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/azcore/streaming"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// counting counts the requests sent through it.
type counting struct {
	n  atomic.Int64
	rt http.RoundTripper
}

func (c *counting) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.rt.RoundTrip(r)
}

// BenchmarkWrite compares a fenced write (subject: properties read +
// conditional Put Blob) with a plain Put Blob of the same 4 KiB (baseline),
// interleaved, on Azurite (target <= 2.0).
func BenchmarkWrite(b *testing.B) {
	e := newEnv(b)
	w := newWriter(b, e.c, nil)
	ctx := context.Background()
	value := bytes.Repeat([]byte("v"), 4096)
	plain := e.c.NewBlockBlobClient(fencetest.Name("plain"))
	key := fencetest.Name("fenced")
	tok := fence.Token(0)
	benchutil.Pair(b, func(i int) error {
		tok++
		value[0] = byte(i)
		return w.Write(ctx, key, value, tok)
	}, func(i int) error {
		value[0] = byte(i)
		_, err := plain.Upload(ctx, streaming.NopCloser(bytes.NewReader(value)), nil)
		return err
	})
}

// BenchmarkAcquireRelease measures an uncontended TryAcquire + Release on
// Azurite and counts the requests each pair sends: from an acquirer that
// wrote the name's token last (remembered ETag) and from two acquirers taking
// turns (each reads the token first).
func BenchmarkAcquireRelease(b *testing.B) {
	ctx := context.Background()
	e := newEnv(b)
	for _, mode := range []string{"same-acquirer", "alternating"} {
		b.Run(mode, func(b *testing.B) {
			cnt := &counting{rt: &http.Transport{}}
			c := newClientVia(b, e.srv, e.srv.ServiceURL, e.container, cnt)
			acqs := []fence.Acquirer{newAcquirer(b, c)}
			if mode == "alternating" {
				acqs = append(acqs, newAcquirer(b, c))
			}
			name := fencetest.Name("bench")
			// The name's first grant creates the lock blob and waits up to a
			// second for Azure's clock: keep it out of the timing.
			for _, a := range acqs {
				l, err := a.TryAcquire(ctx, name, 30*time.Second)
				if err != nil {
					b.Fatal(err)
				}
				if err := l.Release(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.ResetTimer()
			before := cnt.n.Load()
			for i := 0; i < b.N; i++ {
				l, err := acqs[i%len(acqs)].TryAcquire(ctx, name, 30*time.Second)
				if err != nil {
					b.Fatal(err)
				}
				if err := l.Release(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(cnt.n.Load()-before)/float64(b.N), "requests/op")
		})
	}
}
