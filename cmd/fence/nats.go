package main

import (
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"os"
	"strings"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/natstest"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// natsTiming stretches the lesson for NATS, whose key TTLs are whole seconds
// (at least one) and expire on the server within about a second after.
var natsTiming = timing{
	lease: time.Second, stall: 4 * time.Second,
	bugLease: time.Second,
}

// The buckets of the NATS backend: locks (natsfence.LockBucket), fenced data,
// idempotency records and the demo's unfenced "before".
const (
	natsLockBucket  = "fencekit_locks"
	natsDataBucket  = "fencekit_data"
	natsIdemBucket  = "fencekit_idempotency"
	natsPlainBucket = "fencekit_demo_plain"
)

// natsMinServer is the oldest NATS Server whose JetStream has the per-key
// TTLs and limit markers natsfence.LockBucket asks for.
const natsMinServer = "2.11"

// connectNATS connects to url (user and password in the URL, or
// NATS_USER/NATS_PASSWORD) and checks that JetStream answers.
func connectNATS(ctx context.Context, url string) (*nats.Conn, jetstream.JetStream, error) {
	if err := checkURLUserinfo("-nats-url", url); err != nil {
		return nil, nil, err
	}
	opts := []nats.Option{nats.Name("fence"), nats.Timeout(5 * time.Second)}
	if u, p := os.Getenv("NATS_USER"), os.Getenv("NATS_PASSWORD"); u != "" {
		opts = append(opts, nats.UserInfo(u, p))
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("nats at %s: %w", redactNATS(url), err)
	}
	js, err := jetstream.New(nc)
	if err == nil {
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err = js.AccountInfo(actx)
		cancel()
	}
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("nats JetStream at %s: %w", redactNATS(url), err)
	}
	return nc, js, nil
}

// openNATSBackend keeps the locks, the fenced data and the idempotency
// records in JetStream KV buckets of the server at url (created when
// missing), or of an in-process server in a temporary directory when url is
// empty.
func openNATSBackend(ctx context.Context, url string) (*backend, error) {
	stop := func() {}
	name := "nats (" + redactNATS(url) + ")"
	if url == "" {
		dir, err := os.MkdirTemp("", "fence-nats-")
		if err != nil {
			return nil, err
		}
		srv, err := natstest.Start(dir)
		if err != nil {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("in-process nats: %w", err)
		}
		stop = func() { srv.Shutdown(); srv.WaitForShutdown(); os.RemoveAll(dir) }
		url = srv.ClientURL()
		name = "in-process nats (" + url + ")"
	}
	b, err := natsBackend(ctx, url, name)
	if err != nil {
		stop()
		return nil, err
	}
	closeConn := b.close
	b.close = func() error { err := closeConn(); stop(); return err }
	return b, nil
}

func natsBackend(ctx context.Context, url, name string) (*backend, error) {
	nc, js, err := connectNATS(ctx, url)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*backend, error) { nc.Close(); return nil, err }
	for _, cfg := range []jetstream.KeyValueConfig{
		natsfence.LockBucket(natsLockBucket),
		{Bucket: natsDataBucket, History: 1},
		natsfence.LockBucket(natsIdemBucket),
		{Bucket: natsPlainBucket, History: 1},
	} {
		if _, err := js.CreateOrUpdateKeyValue(ctx, cfg); err != nil {
			if errors.Is(err, jetstream.ErrLimitMarkerTTLNotSupported) {
				// The server is too old for natsfence's buckets: say which
				// version answered and which one they need.
				return fail(fmt.Errorf("nats bucket %s: the server at %s is NATS Server %s, and natsfence's lock buckets need %s or later (per-key TTLs and limit markers): %w",
					cfg.Bucket, redactNATS(url), nc.ConnectedServerVersion(), natsMinServer, err))
			}
			return fail(fmt.Errorf("nats bucket %s: %w", cfg.Bucket, err))
		}
	}
	a, err := natsfence.NewAcquirer(ctx, js, natsLockBucket, nil)
	if err != nil {
		return fail(err)
	}
	w, err := natsfence.NewWriter(ctx, js, natsDataBucket, nil)
	if err != nil {
		return fail(err)
	}
	idem, err := natsfence.NewIdempotencyStore(ctx, js, natsIdemBucket, nil)
	if err != nil {
		return fail(err)
	}
	plain, err := js.KeyValue(ctx, natsPlainBucket)
	if err != nil {
		return fail(err)
	}
	locks, err := js.KeyValue(ctx, natsLockBucket)
	if err != nil {
		return fail(err)
	}
	return &backend{
		name:   name,
		acq:    a,
		fenced: w,
		idem:   idem,
		timing: &natsTiming,
		plainPut: func(ctx context.Context, key string, value []byte) error {
			_, err := plain.Put(ctx, natsfence.EncodeKey(key), value)
			return err
		},
		plainGet: func(ctx context.Context, key string) ([]byte, error) {
			e, err := plain.Get(ctx, natsfence.EncodeKey(key))
			if errors.Is(err, jetstream.ErrKeyNotFound) {
				return nil, fence.ErrNotFound
			}
			if err != nil {
				return nil, err
			}
			return e.Value(), nil
		},
		forceRelease: func(ctx context.Context, lock string) error {
			// The lesson's bug on NATS: purge the lock key, whoever holds it.
			return locks.Purge(ctx, natsfence.EncodeKey(lock))
		},
		close: func() error { nc.Close(); return nil },
	}, nil
}

// openNATSOperator opens the lock bucket (and, with keys, the data bucket)
// on the server the operator named, creating nothing.
func openNATSOperator(ctx context.Context, c backendConfig, keys bool) (*backend, error) {
	if c.natsBucket == "" {
		c.natsBucket = natsLockBucket
	}
	if c.natsDataBucket == "" {
		c.natsDataBucket = natsDataBucket
	}
	nc, js, err := connectNATS(ctx, c.natsURL)
	if err != nil {
		return nil, err
	}
	a, err := natsfence.NewAcquirer(ctx, js, c.natsBucket, nil)
	if err != nil {
		nc.Close()
		return nil, err
	}
	b := &backend{name: "nats (" + redactNATS(c.natsURL) + ", bucket " + c.natsBucket + ")", acq: a, close: func() error { nc.Close(); return nil }}
	if keys {
		if b.fenced, err = natsfence.NewWriter(ctx, js, c.natsDataBucket, nil); err != nil {
			nc.Close()
			return nil, err
		}
	}
	return b, nil
}

// natsUserinfo returns the user information of each server URL in a
// -nats-url (a comma-separated list, nats:// implied without a scheme), as
// written up to the URL's last @, with the index where it starts in url. The
// nats client sends user information without a colon as a token.
func natsUserinfo(url string) (infos []string, starts []int) {
	off := 0
	for part := range strings.SplitSeq(url, ",") {
		start := off
		off += len(part) + 1
		if i := strings.Index(part, "://"); i >= 0 {
			start += i + 3
			part = part[i+3:]
		}
		if at := strings.LastIndex(part, "@"); at >= 0 {
			infos, starts = append(infos, part[:at]), append(starts, start)
		}
	}
	return infos, starts
}

// natsSecrets returns the passwords and tokens in a -nats-url, as written and
// unescaped.
func natsSecrets(url string) []string {
	var out []string
	infos, _ := natsUserinfo(url)
	for _, ui := range infos {
		if _, pw, ok := strings.Cut(ui, ":"); ok {
			ui = pw
		}
		if ui == "" || ui == redacted {
			continue
		}
		out = append(out, ui)
		if dec, err := neturl.PathUnescape(ui); err == nil && dec != ui {
			out = append(out, dec)
		}
	}
	return out
}

// redactNATS returns a -nats-url for display: each password, and each token
// (user information without a colon), replaced by xxxxx.
func redactNATS(url string) string {
	infos, starts := natsUserinfo(url)
	for i := len(infos) - 1; i >= 0; i-- {
		ui, at := infos[i], starts[i]
		keep := ""
		if user, _, ok := strings.Cut(ui, ":"); ok {
			keep = user + ":"
		}
		url = url[:at] + keep + redacted + url[at+len(ui):]
	}
	return url
}
