package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"time"

	"cloud.google.com/go/storage"
	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fsouza/fake-gcs-server/fakestorage"
	"google.golang.org/api/option"
)

// connectGCS returns a bucket of the GCS server the flags name (credentials
// from Application Default Credentials), checking that it answers; or, when
// -gcs-bucket is empty, a new bucket of an in-process fake-gcs-server, which
// honours ifGenerationMatch. An operator's command never gets the in-process
// server (checkOperator refuses first). close ends the client (and server).
func connectGCS(ctx context.Context, cfg backendConfig) (b *storage.BucketHandle, c *storage.Client, name string, close func(), err error) {
	if cfg.gcsBucket == "" {
		srv, err := fakestorage.NewServerWithOptions(fakestorage.Options{Scheme: "http", Host: "127.0.0.1"})
		if err != nil {
			return nil, nil, "", nil, err
		}
		srv.CreateBucketWithOpts(fakestorage.CreateBucketOpts{Name: "fence-demo"})
		c, err := storage.NewClient(ctx, option.WithEndpoint(srv.URL()+"/storage/v1/"), option.WithoutAuthentication(), storage.WithJSONReads())
		if err != nil {
			srv.Stop()
			return nil, nil, "", nil, err
		}
		return c.Bucket("fence-demo"), c, "in-process GCS (fake-gcs-server at " + srv.URL() + ")", func() { c.Close(); srv.Stop() }, nil
	}
	opts := []option.ClientOption{storage.WithJSONReads()}
	where := "GCS"
	if cfg.gcsEndpoint != "" {
		if err := checkURLUserinfo("-gcs-endpoint", cfg.gcsEndpoint); err != nil {
			return nil, nil, "", nil, err
		}
		if u, err := url.Parse(cfg.gcsEndpoint); err != nil || u.Scheme == "" || u.Host == "" {
			return nil, nil, "", nil, usagef("GCS endpoint %s is not a URL such as http://127.0.0.1:4443/storage/v1/", redactConn(cfg.gcsEndpoint))
		}
		opts = append(opts, option.WithEndpoint(cfg.gcsEndpoint))
		if u, _ := url.Parse(cfg.gcsEndpoint); u.Scheme == "http" {
			// A plain-HTTP endpoint is an emulator (GCS itself is HTTPS
			// only): no credentials, as STORAGE_EMULATOR_HOST would do.
			opts = append(opts, option.WithoutAuthentication())
		}
		where = redactConn(cfg.gcsEndpoint)
	}
	c, err = storage.NewClient(ctx, opts...)
	if err != nil {
		return nil, nil, "", nil, err
	}
	hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := c.Bucket(cfg.gcsBucket).Attrs(hctx); err != nil {
		c.Close()
		return nil, nil, "", nil, fmt.Errorf("gcs bucket %q at %s: %w", cfg.gcsBucket, where, err)
	}
	return c.Bucket(cfg.gcsBucket), c, fmt.Sprintf("gcs bucket %q at %s", cfg.gcsBucket, where), func() { c.Close() }, nil
}

// openGCSBackend keeps the protected data and the locks in GCS (connectGCS):
// the locks are lock objects of gcsfence.Acquirer, no other lock service. The
// idempotency keys of the payment scenarios live in SQLite (dbPath, or a
// temporary file).
func openGCSBackend(ctx context.Context, cfg backendConfig) (*backend, error) {
	bucket, _, name, closeGCS, err := connectGCS(ctx, cfg)
	if err != nil {
		return nil, err
	}
	w, err := gcsfence.NewWriter(bucket, nil)
	if err != nil {
		closeGCS()
		return nil, err
	}
	a, err := gcsfence.NewAcquirer(bucket, &gcsfence.AcquirerOptions{Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		closeGCS()
		return nil, err
	}
	b, err := openSQLiteBackend(ctx, cfg.dbPath)
	if err != nil {
		closeGCS()
		return nil, err
	}
	b.name = name + ": data and locks; idempotency keys in " + b.name
	b.acq, b.fenced = a, w
	b.forceRelease = func(ctx context.Context, lock string) error {
		// The lesson's bug on a lock object: free it without checking whose it is.
		obj := bucket.Object("fencekit-locks/" + lock)
		attrs, err := obj.Attrs(ctx)
		if err != nil {
			return err
		}
		meta := attrs.Metadata
		delete(meta, "fence-holder")
		wr := obj.NewWriter(ctx)
		wr.Metadata = meta
		return wr.Close()
	}
	b.plainPut = func(ctx context.Context, key string, value []byte) error {
		wr := bucket.Object("plain/" + key).NewWriter(ctx)
		if _, err := wr.Write(value); err != nil {
			_ = wr.Close()
			return err
		}
		return wr.Close()
	}
	b.plainGet = func(ctx context.Context, key string) ([]byte, error) {
		r, err := bucket.Object("plain/" + key).NewReader(ctx)
		if errors.Is(err, storage.ErrObjectNotExist) {
			return nil, fence.ErrNotFound
		}
		if err != nil {
			return nil, err
		}
		defer r.Close()
		return io.ReadAll(r)
	}
	closeLocks := b.close
	b.close = func() error { closeGCS(); return closeLocks() }
	return b, nil
}
