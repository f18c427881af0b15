package azfence_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
)

// Locks on Azure blob leases and fenced blobs, here on Azurite's default
// port with its development account: with Azure only the URL and the
// credential change. A write with an older token is refused. (Not run by go
// test, which has no Azurite on a fixed port; TestExample runs its body.)
func Example() {
	cred, err := azblob.NewSharedKeyCredential("devstoreaccount1", "<the account key>")
	if err != nil {
		log.Fatal(err)
	}
	client, err := azblob.NewClientWithSharedKeyCredential("http://127.0.0.1:10000/devstoreaccount1/", cred, nil)
	if err != nil {
		log.Fatal(err)
	}
	reports := client.ServiceClient().NewContainerClient("reports")
	if _, err := reports.Create(context.Background(), nil); err != nil {
		log.Fatal(err)
	}
	lines, err := nightly(context.Background(), reports)
	if err != nil {
		log.Fatal(err)
	}
	for _, l := range lines {
		fmt.Println(l)
	}
}

// nightly is Example's body: two runs under the lock, then a late write.
func nightly(ctx context.Context, reports *container.Client) ([]string, error) {
	locks, err := azfence.NewAcquirer(reports, nil)
	if err != nil {
		return nil, err
	}
	blobs, err := azfence.NewWriter(reports, nil)
	if err != nil {
		return nil, err
	}
	var tokens []fence.Token
	for _, run := range []string{"first run", "second run"} {
		// Azure leases last 15 to 60 s; Hold renews every ttl/3.
		err := fence.Hold(ctx, locks, "nightly", 30*time.Second, func(ctx context.Context, l fence.Lease) error {
			tokens = append(tokens, l.Token())
			return blobs.Write(ctx, "nightly.csv", []byte(run), l.Token())
		})
		if err != nil {
			return nil, err
		}
	}
	err = blobs.Write(ctx, "nightly.csv", []byte("late"), tokens[0])
	v, tok, rerr := blobs.Read(ctx, "nightly.csv")
	if rerr != nil {
		return nil, rerr
	}
	return []string{
		fmt.Sprint("the second run's token is above the first's: ", tokens[1] > tokens[0]),
		fmt.Sprint("a late write with the first run's token is stale: ", errors.Is(err, fence.ErrStale)),
		fmt.Sprintf("stored %q with the second run's token: %v", v, tok == tokens[1]),
	}, nil
}

func TestExample(t *testing.T) {
	e := newEnv(t)
	lines, err := nightly(context.Background(), e.c)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"the second run's token is above the first's: true",
		"a late write with the first run's token is stale: true",
		`stored "second run" with the second run's token: true`,
	}
	if fmt.Sprint(lines) != fmt.Sprint(want) {
		t.Errorf("example printed %q, want %q", lines, want)
	}
}
