package s3fence_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http/httptest"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

// Locks and fenced objects on S3 alone, here on an in-process S3 (gofakes3):
// with AWS or MinIO only the client changes. A write with an older token is
// refused.
func Example() {
	srv := httptest.NewServer(gofakes3.New(s3mem.New()).Server())
	defer srv.Close()
	client := s3.New(s3.Options{
		Region: "us-east-1", BaseEndpoint: aws.String(srv.URL), UsePathStyle: true,
		Credentials: credentials.NewStaticCredentialsProvider("key", "secret", ""),
	})
	ctx := context.Background()
	if _, err := client.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("reports")}); err != nil {
		log.Fatal(err)
	}
	locks, err := s3fence.NewAcquirer(client, "reports", nil)
	if err != nil {
		log.Fatal(err)
	}
	objects, err := s3fence.New(client, "reports", nil)
	if err != nil {
		log.Fatal(err)
	}

	for _, run := range []string{"first run", "second run"} {
		err := fence.Hold(ctx, locks, "nightly", 10*time.Second, func(ctx context.Context, l fence.Lease) error {
			fmt.Printf("%s holds token %d\n", run, l.Token())
			return objects.Write(ctx, "nightly.csv", []byte(run), l.Token())
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	err = objects.Write(ctx, "nightly.csv", []byte("late"), 1)
	fmt.Println("late write with token 1 is stale:", errors.Is(err, fence.ErrStale))
	v, tok, err := objects.Read(ctx, "nightly.csv")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("stored %q with token %d\n", v, tok)
	// Output:
	// first run holds token 1
	// second run holds token 2
	// late write with token 1 is stale: true
	// stored "second run" with token 2
}
