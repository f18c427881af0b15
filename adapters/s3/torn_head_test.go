package s3fence_test

import (
	"context"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
)

// tornHead answers its first HEAD of an existing object as versitygw v1.8.0
// can when a PUT is published between its reads of an object's metadata and
// of its ETag: the metadata of the object as it was, the ETag of the object
// after between (another writer's write) ran. With strip, every answer also
// lacks MetaBodyMD5 (an object written before it existed, or by another
// tool), so the writer cannot check the ETag against it.
type tornHead struct {
	s3fence.API
	between func()
	strip   bool
	torn    bool
	heads   int
}

func (h *tornHead) HeadObject(ctx context.Context, in *s3.HeadObjectInput, o ...func(*s3.Options)) (*s3.HeadObjectOutput, error) {
	h.heads++
	out, err := h.API.HeadObject(ctx, in, o...)
	if err == nil && !h.torn {
		h.torn = true
		h.between()
		later, lerr := h.API.HeadObject(ctx, in, o...)
		if lerr != nil {
			return nil, lerr
		}
		out.ETag = later.ETag
	}
	if err == nil && h.strip {
		delete(out.Metadata, s3fence.MetaBodyMD5)
	}
	return out, err
}

// TestTornHeadRefused: a HEAD that pairs an old token (3) with the ETag of a
// newer write (token 10) must not let a write with token 5 through. Before
// the writer checked a HEAD's ETag against its metadata's MD5 (or a second
// HEAD), Write(token 5) returned nil and the object held token 5 after 10.
func TestTornHeadRefused(t *testing.T) {
	for _, strip := range []bool{false, true} {
		name := map[bool]string{false: "md5-checked", true: "no-md5-second-head"}[strip]
		t.Run(name, func(t *testing.T) {
			e := fakeS3(t)
			ctx := context.Background()
			good := newWriter(t, e, nil)
			if err := good.Write(ctx, "k", []byte("v3"), 3); err != nil {
				t.Fatal(err)
			}
			api := &tornHead{API: e.c, strip: strip, between: func() {
				if err := good.Write(ctx, "k", []byte("v10"), 10); err != nil {
					t.Fatal(err)
				}
			}}
			stale, err := s3fence.New(api, e.bucket, nil)
			if err != nil {
				t.Fatal(err)
			}
			werr := stale.Write(ctx, "k", []byte("v5"), 5)
			v, tok, rerr := good.Read(ctx, "k")
			if !api.torn {
				t.Fatal("the HEAD was never torn: the case shows nothing")
			}
			if werr == nil || tok != 10 || string(v) != "v10" || rerr != nil {
				t.Fatalf("after a torn HEAD, Write(token 5) after token 10: %v; the object holds %q token %d (%v)", werr, v, tok, rerr)
			}
			t.Logf("Write(token 5): %v, after %d HEADs", werr, api.heads)
		})
	}
}
