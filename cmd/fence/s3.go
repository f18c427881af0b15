package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http/httptest"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

// openS3Backend keeps the protected data in an in-process S3 server (gofakes3,
// which honours conditional PUTs) and takes the locks from SQLite (dbPath, or a
// temporary file): object stores grant no leases themselves.
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
	b, err := openSQLiteBackend(ctx, dbPath)
	if err != nil {
		srv.Close()
		return nil, err
	}
	b.name = "in-process S3 (" + srv.URL + "), locks in " + b.name
	b.fenced = w
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
