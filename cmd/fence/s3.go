package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http/httptest"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

// s3Timing stretches the lesson for S3 leases: S3 tells time in whole
// seconds, so an expired lease is granted again up to 2s after its ttl.
var s3Timing = timing{
	lease: time.Second, stall: 6 * time.Second, arrive: 3500 * time.Millisecond,
	bugLease: time.Second, bugStall: 3500 * time.Millisecond,
}

// openS3Backend keeps the protected data and the locks in an in-process S3
// server (gofakes3, which honours conditional PUTs): the locks are lock
// objects of s3fence.Acquirer, no other lock service. The idempotency keys of
// the payment scenarios live in SQLite (dbPath, or a temporary file).
func openS3Backend(ctx context.Context, dbPath string) (*backend, error) {
	srv := httptest.NewServer(gofakes3.New(s3mem.New()).Server())
	c := s3.New(s3.Options{
		Region: "us-east-1", BaseEndpoint: aws.String(srv.URL), UsePathStyle: true,
		Credentials: credentials.NewStaticCredentialsProvider("demo", "demo", ""),
	})
	bucket := "fence-demo"
	if _, err := c.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String(bucket)}); err != nil {
		srv.Close()
		return nil, err
	}
	w, err := s3fence.New(c, bucket, nil)
	if err != nil {
		srv.Close()
		return nil, err
	}
	a, err := s3fence.NewAcquirer(c, bucket, &s3fence.AcquirerOptions{Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		srv.Close()
		return nil, err
	}
	b, err := openSQLiteBackend(ctx, dbPath)
	if err != nil {
		srv.Close()
		return nil, err
	}
	b.name = "in-process S3 (" + srv.URL + "): data and locks; idempotency keys in " + b.name
	b.acq, b.fenced, b.timing = a, w, &s3Timing
	b.forceRelease = func(ctx context.Context, name string) error {
		// The lesson's bug on a lock object: free it without checking whose it is.
		out, err := c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(bucket), Key: aws.String("fencekit-locks/" + name)})
		if err != nil {
			return err
		}
		var st map[string]any
		err = json.NewDecoder(out.Body).Decode(&st)
		out.Body.Close()
		if err != nil {
			return err
		}
		delete(st, "holder")
		body, _ := json.Marshal(st)
		_, err = c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(bucket), Key: aws.String("fencekit-locks/" + name), Body: bytes.NewReader(body)})
		return err
	}
	b.plainPut = func(ctx context.Context, key string, value []byte) error {
		_, err := c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(bucket), Key: aws.String("plain/" + key), Body: bytes.NewReader(value)})
		return err
	}
	b.plainGet = func(ctx context.Context, key string) ([]byte, error) {
		out, err := c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String(bucket), Key: aws.String("plain/" + key)})
		var nk *types.NoSuchKey
		if errors.As(err, &nk) {
			return nil, fence.ErrNotFound
		}
		if err != nil {
			return nil, err
		}
		defer out.Body.Close()
		return io.ReadAll(out.Body)
	}
	closeLocks := b.close
	b.close = func() error { srv.Close(); return closeLocks() }
	return b, nil
}
