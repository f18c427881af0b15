package redislua_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/benchutil"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// BenchmarkWrite compares a fenced Lua write (subject) with a plain SET of the
// same value size (baseline), interleaved in one run. Target: <= 1.3.
func BenchmarkWrite(b *testing.B) {
	c := testenv.RedisClient(b)
	w := newWriterOn(b, c, nil)
	ctx := context.Background()
	key := fencetest.Name("bench")
	value := []byte("a value of a typical small size, 64 bytes long.................")
	plain := bytes.Clone(value)
	tok := fence.Token(0)
	benchutil.Pair(b, func(i int) error {
		tok++
		value[0] = byte(i)
		return w.Write(ctx, key, value, tok)
	}, func(i int) error {
		plain[0] = byte(i)
		return c.Set(ctx, key+"-plain", plain, 0).Err()
	})
	// Both did their work: the last write of each is what the keys hold.
	if v, got, err := w.Read(ctx, key); err != nil || got != tok || !bytes.Equal(v, value) {
		b.Fatalf("after %d fenced writes the key holds %q at token %d (%v), want the last write at %d", tok, v, got, err, tok)
	}
	if v, err := c.Get(ctx, key+"-plain").Bytes(); err != nil || !bytes.Equal(v, plain) {
		b.Fatalf("after the plain SETs the key holds %q (%v), want the last SET", v, err)
	}
}

// BenchmarkAcquireRelease measures an uncontended TryAcquire + Release (subject)
// against two PINGs (baseline, the two round trips it needs), interleaved.
func BenchmarkAcquireRelease(b *testing.B) {
	c := testenv.RedisClient(b)
	a := newAcquirerOn(b, c, nil)
	ctx := context.Background()
	name := fencetest.Name("bench")
	benchutil.Pair(b, func(int) error {
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			return err
		}
		return l.Release(ctx)
	}, func(int) error {
		if err := c.Ping(ctx).Err(); err != nil {
			return err
		}
		return c.Ping(ctx).Err()
	})
}

// BenchmarkHandoff measures the time from the start of a holder's Release to
// the grant of an Acquire already waiting: of the same acquirer (the grant is
// in the release's reply), of another acquirer (published on its channel, as
// a waiter in another process hears it), or polling alone: p50 and p90.
func BenchmarkHandoff(b *testing.B) {
	c := testenv.RedisClient(b)
	for _, mode := range []string{"same-acquirer", "other-acquirer", "poll"} {
		b.Run(mode, func(b *testing.B) {
			opts := &redislua.AcquirerOptions{DisableNotify: mode == "poll"}
			holder := newAcquirerOn(b, c, opts)
			waiter := holder
			if mode == "other-acquirer" {
				waiter, _ = redislua.NewAcquirer(c, opts)
			}
			benchutil.Handoff(b, holder, waiter, fencetest.Name("handoff"))
		})
	}
}

// BenchmarkHandoffAcrossProcesses is BenchmarkHandoff with the waiter in a
// child process: the time from the start of the holder's Release to the
// child's grant, on the host's clock, p50 and p90.
func BenchmarkHandoffAcrossProcesses(b *testing.B) {
	c := testenv.RedisClient(b)
	a := newAcquirerOn(b, c, nil)
	ctx := context.Background()
	name := fencetest.Name("xhandoff")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "FENCEKIT_CHILD=handoff", "FENCEKIT_CHILD_NAME="+name)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	lines := bufio.NewScanner(stdout)
	handoffs := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i > 0 {
			if h, err = a.Acquire(ctx, name, time.Minute); err != nil {
				b.Fatal(err)
			}
		}
		fmt.Fprintln(stdin, "next")
		time.Sleep(5*time.Millisecond + time.Duration(i%20)*time.Millisecond)
		start := time.Now()
		if err := h.Release(ctx); err != nil {
			b.Fatal(err)
		}
		var at int64
		for at == 0 && lines.Scan() {
			if v, ok := strings.CutPrefix(lines.Text(), "granted "); ok {
				at, _ = strconv.ParseInt(v, 10, 64)
			}
		}
		if at == 0 {
			b.Fatal("the child process ended without a grant")
		}
		handoffs = append(handoffs, time.Unix(0, at).Sub(start))
	}
	b.StopTimer()
	slices.Sort(handoffs)
	b.ReportMetric(float64(handoffs[len(handoffs)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(handoffs[len(handoffs)*9/10].Microseconds()), "p90-µs")
}

// BenchmarkFlakyNetwork: 8 workers x 200 locked increments of one counter
// (Acquire, Read, fenced Write with the Writer, Release), the acquirer and the
// writer on one client that reaches Redis only through a fault proxy with
// 1-3 ms jitter, then with 2% cuts too (benchutil.FlakyNetwork). Run it alone,
// once:
//
//	go test -run '^$' -bench BenchmarkFlakyNetwork -benchtime 1x ./adapters/redislua/
func BenchmarkFlakyNetwork(b *testing.B) {
	benchutil.FlakyNetwork(b, benchutil.Flaky{
		Name:   "redis",
		Target: func(*testing.B) string { return testenv.RedisAddr() },
		Open: func(b *testing.B, p *faultnet.Proxy) (fence.Acquirer, benchutil.Store) {
			testenv.RedisClient(b) // skips when there is no server
			c := redis.NewClient(&redis.Options{Addr: p.Addr(), PoolSize: 16})
			b.Cleanup(func() { c.Close() })
			a := newAcquirerOn(b, c, nil)
			w := newWriterOn(b, c, nil)
			return a, w
		},
	})
}
