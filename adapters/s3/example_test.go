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
	objects, err := s3fence.NewWriter(client, "reports", nil)
	if err != nil {
		log.Fatal(err)
	}

	// Every grant's token is at least S3's clock in microseconds (not
	// the last token plus one), so tokens stay above those of a lock
	// object that was deleted or restored from an older version.
	var tokens []fence.Token
	for _, run := range []string{"first run", "second run"} {
		err := fence.Hold(ctx, locks, "nightly", 10*time.Second, func(ctx context.Context, l fence.Lease) error {
			tokens = append(tokens, l.Token())
			return objects.Write(ctx, "nightly.csv", []byte(run), l.Token())
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	fmt.Println("the second run's token is above the first's:", tokens[1] > tokens[0])
	err = objects.Write(ctx, "nightly.csv", []byte("late"), tokens[0])
	fmt.Println("a late write with the first run's token is stale:", errors.Is(err, fence.ErrStale))
	v, tok, err := objects.Read(ctx, "nightly.csv")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("stored %q with the second run's token: %v\n", v, tok == tokens[1])
	// Output:
	// the second run's token is above the first's: true
	// a late write with the first run's token is stale: true
	// stored "second run" with the second run's token: true
}
