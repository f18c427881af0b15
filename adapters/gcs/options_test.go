package gcsfence_test

import (
	"errors"
	"strings"
	"testing"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
)

// TestBadBucketNames: a bucket handle whose name GCS cannot have
// is refused by New and NewAcquirer with fence.ErrInvalid naming the bucket,
// not at the first write.
func TestBadBucketNames(t *testing.T) {
	e := fakeGCS(t)
	for _, name := range []string{"", "ab", "Upper", "under space", strings.Repeat("b", 64), "-dash-first", "dot-last.", "a/b"} {
		b := e.c.Bucket(name)
		var ie *fence.InvalidError
		if _, err := gcsfence.NewWriter(b, nil); !errors.As(err, &ie) || ie.Arg != "bucket" {
			t.Errorf("New on bucket %q = %v, want ErrInvalid naming bucket", name, err)
		}
		if _, err := gcsfence.NewAcquirer(b, nil); !errors.As(err, &ie) || ie.Arg != "bucket" {
			t.Errorf("NewAcquirer on bucket %q = %v, want ErrInvalid naming bucket", name, err)
		}
	}
	for _, name := range []string{e.bucket, "a_b", "a.b-c", strings.Repeat("b", 63)} {
		if _, err := gcsfence.NewWriter(e.c.Bucket(name), nil); err != nil {
			t.Errorf("New on bucket %q: %v", name, err)
		}
	}
}

// TestBadOwner: Owner goes into every lock object's custom
// metadata, which GCS limits to 8 KiB in all and keeps as UTF-8 text: an
// Owner it cannot keep is refused by NewAcquirer, naming Owner, not by
// every grant on GCS.
func TestBadOwner(t *testing.T) {
	e := fakeGCS(t)
	for _, owner := range []string{strings.Repeat("o", 9000), "bad \xff", "nul\x00"} {
		_, err := gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{Owner: owner})
		var ie *fence.InvalidError
		if !errors.As(err, &ie) || ie.Arg != "Owner" {
			t.Errorf("Owner of %d bytes %.12q: %v, want ErrInvalid naming Owner", len(owner), owner, err)
		}
	}
}
