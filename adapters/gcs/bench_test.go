package gcsfence_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/benchutil"
)

// BenchmarkWrite compares a fenced write (subject) with a plain upload of the
// same size (baseline), interleaved, on the in-process fake: with the
// attributes read before every upload (target <= 2.0) and reusing the
// generation of the writer's own last write (target <= 1.1).
func BenchmarkWrite(b *testing.B) {
	for _, mode := range []string{"read", "reuse-generation"} {
		b.Run(mode, func(b *testing.B) {
			e := fakeGCS(b)
			w := newWriter(b, e, &gcsfence.WriterOptions{ReuseGeneration: mode == "reuse-generation"})
			ctx := context.Background()
			value := bytes.Repeat([]byte("v"), 4096)
			tok := fence.Token(0)
			plain := e.b().Object("plain")
			benchutil.Pair(b, func(i int) error {
				tok++
				value[0] = byte(i)
				return w.Write(ctx, "obj", value, tok)
			}, func(i int) error {
				value[0] = byte(i)
				wr := plain.NewWriter(ctx)
				wr.ChunkSize = 0
				if _, err := wr.Write(value); err != nil {
					return err
				}
				return wr.Close()
			})
		})
	}
}

// BenchmarkAcquireRelease measures an uncontended TryAcquire + Release on the
// fake, counting the requests each pair sends (target <= 3).
func BenchmarkAcquireRelease(b *testing.B) {
	ctx := context.Background()
	e := fakeGCS(b)
	a := newAcquirer(b, e)
	name := fencetest.Name("bench")
	// The name's first grant creates its lock object: keep it out.
	if l, err := a.TryAcquire(ctx, name, time.Minute); err != nil {
		b.Fatal(err)
	} else if err := l.Release(ctx); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	before := e.f.reqs.Load()
	for i := 0; i < b.N; i++ {
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(e.f.reqs.Load()-before)/float64(b.N), "requests/op")
}
