package gcsfence_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"cloud.google.com/go/storage"
	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fsouza/fake-gcs-server/fakestorage"
	"google.golang.org/api/option"
)

// Locks and fenced objects on Google Cloud Storage alone, here on an
// in-process fake-gcs-server: with GCS itself only the client changes
// (storage.NewClient(ctx) with Application Default Credentials). A write
// with an older token is refused.
func Example() {
	srv, err := fakestorage.NewServerWithOptions(fakestorage.Options{Scheme: "http", Host: "127.0.0.1"})
	if err != nil {
		log.Fatal(err)
	}
	defer srv.Stop()
	srv.CreateBucketWithOpts(fakestorage.CreateBucketOpts{Name: "reports"})
	ctx := context.Background()
	client, err := storage.NewClient(ctx, option.WithEndpoint(srv.URL()+"/storage/v1/"),
		option.WithoutAuthentication(), storage.WithJSONReads())
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	bucket := client.Bucket("reports")
	locks, err := gcsfence.NewAcquirer(bucket, nil)
	if err != nil {
		log.Fatal(err)
	}
	objects, err := gcsfence.NewWriter(bucket, nil)
	if err != nil {
		log.Fatal(err)
	}

	// Every grant's token is at least GCS's clock in microseconds (not
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
