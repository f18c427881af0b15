package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"net/url"
	"os"
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
// seconds, and a server that caches its Date header may tell it up to the
// acquirer's DateLag (2s by default) later still, so an expired lease is
// granted again up to 2s + 2 x DateLag (6s) after its ttl. The slow step
// (stall) outlasts the 1s lease plus those 6s by 3s: without the watchdog's
// renewals B would be granted during it.
var s3Timing = timing{
	lease: time.Second, stall: time.Second + 2*time.Second + 2*s3fence.DefaultDateLag + 3*time.Second,
	bugLease: time.Second,
}

// s3Client is an S3 client with its bucket and a name for messages.
type s3Client struct {
	c      *s3.Client
	bucket string
	name   string
	close  func()
}

// connectS3 returns a client of the S3 server and bucket the flags name
// (credentials from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
// AWS_SESSION_TOKEN), checking that the bucket answers; or, when neither
// -s3-endpoint nor -s3-bucket is set, of an in-process S3 server (gofakes3,
// which honours conditional PUTs) with a new bucket. An operator's command
// never gets the in-process server (checkOperator refuses first).
func connectS3(ctx context.Context, cfg backendConfig) (*s3Client, error) {
	if cfg.s3Endpoint == "" && cfg.s3Bucket == "" {
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
		return &s3Client{c: c, bucket: bucket, name: "in-process S3 (" + srv.URL + ")", close: srv.Close}, nil
	}
	if cfg.s3Bucket == "" {
		return nil, usagef("-s3-endpoint needs -s3-bucket")
	}
	// The endpoint the AWS environment names, as the AWS CLI and SDKs read it.
	endpoint := cmp.Or(cfg.s3Endpoint, os.Getenv("AWS_ENDPOINT_URL_S3"), os.Getenv("AWS_ENDPOINT_URL"))
	region := cmp.Or(cfg.s3Region, os.Getenv("AWS_REGION"), "us-east-1")
	opts := s3.Options{
		Region: region,
		Credentials: credentials.NewStaticCredentialsProvider(
			os.Getenv("AWS_ACCESS_KEY_ID"), os.Getenv("AWS_SECRET_ACCESS_KEY"), os.Getenv("AWS_SESSION_TOKEN")),
	}
	where := "AWS " + region
	if endpoint != "" {
		if err := checkURLUserinfo("-s3-endpoint", endpoint); err != nil {
			return nil, err
		}
		u, err := url.Parse(endpoint)
		if err != nil || u.Scheme == "" || u.Host == "" {
			return nil, usagef("S3 endpoint %s is not a URL such as http://127.0.0.1:9000", redactConn(endpoint))
		}
		opts.BaseEndpoint, opts.UsePathStyle = aws.String(endpoint), true
		where = redactConn(endpoint)
	}
	c := s3.New(opts)
	hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := c.HeadBucket(hctx, &s3.HeadBucketInput{Bucket: aws.String(cfg.s3Bucket)}); err != nil {
		return nil, fmt.Errorf("s3 bucket %q at %s: %w", cfg.s3Bucket, where, err)
	}
	return &s3Client{c: c, bucket: cfg.s3Bucket, name: fmt.Sprintf("s3 bucket %q at %s", cfg.s3Bucket, where), close: func() {}}, nil
}

// openS3Backend keeps the protected data and the locks in S3 (connectS3):
// the locks are lock objects of s3fence.Acquirer, no other lock service. The
// idempotency keys of the payment scenarios live in SQLite (dbPath, or a
// temporary file).
func openS3Backend(ctx context.Context, cfg backendConfig) (*backend, error) {
	sc, err := connectS3(ctx, cfg)
	if err != nil {
		return nil, err
	}
	c, bucket := sc.c, sc.bucket
	w, err := s3fence.NewWriter(c, bucket, nil)
	if err != nil {
		sc.close()
		return nil, err
	}
	a, err := s3fence.NewAcquirer(c, bucket, &s3fence.AcquirerOptions{Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		sc.close()
		return nil, err
	}
	b, err := openSQLiteBackend(ctx, cfg.dbPath)
	if err != nil {
		sc.close()
		return nil, err
	}
	b.name = sc.name + ": data and locks; idempotency keys in " + b.name
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
	b.close = func() error { sc.close(); return closeLocks() }
	return b, nil
}
