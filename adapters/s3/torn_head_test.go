package s3fence_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
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
			stale, err := s3fence.NewWriter(api, e.bucket, nil)
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

// tearingAPI tears HEADs of an existing object the way versitygw v1.8.0 can
// (its metadata read, then a PUT lands, then its ETag read): every HEAD while
// tearing is set, and only the HEADs of the object key (not the writer's
// short-key probe). between runs in the gap. lostPuts makes the next PUTs
// land and then report a broken connection (an ambiguous attempt).
type tearingAPI struct {
	s3fence.API
	tearing  int // HEADs left to tear; -1: every HEAD
	between  func()
	lostPuts int
	// tearAfterLost HEADs are torn once a PUT's reply was lost.
	tearAfterLost int
	heads         int
	torn          int
}

func (h *tearingAPI) HeadObject(ctx context.Context, in *s3.HeadObjectInput, o ...func(*s3.Options)) (*s3.HeadObjectOutput, error) {
	h.heads++
	out, err := h.API.HeadObject(ctx, in, o...)
	if err != nil || h.tearing == 0 {
		return out, err
	}
	if h.tearing > 0 {
		h.tearing--
	}
	h.torn++
	h.between()
	later, lerr := h.API.HeadObject(ctx, in, o...)
	if lerr != nil {
		return nil, lerr
	}
	out.ETag = later.ETag
	return out, nil
}

func (h *tearingAPI) PutObject(ctx context.Context, in *s3.PutObjectInput, o ...func(*s3.Options)) (*s3.PutObjectOutput, error) {
	out, err := h.API.PutObject(ctx, in, o...)
	if err == nil && h.lostPuts > 0 {
		h.lostPuts--
		h.tearing += h.tearAfterLost
		return nil, errors.New("injected: connection reset after the PUT landed")
	}
	return out, err
}

// TestTornHeadEveryTimeIsContention: while other writers keep landing
// PUTs (each between a HEAD's metadata read and its ETag read), the writer
// gives up after 9 HEADs. The object "kept changing under the write", which is
// what ErrContention documents; a caller that retries on ErrContention (or
// tells a refusal from an unknown outcome by the documented classes) gets an
// error that matches none of them.
func TestTornHeadEveryTimeIsContention(t *testing.T) {
	e := fakeS3(t)
	ctx := context.Background()
	other := newWriter(t, e, nil)
	if err := other.Write(ctx, "k", []byte("o"), 1); err != nil {
		t.Fatal(err)
	}
	api := &tearingAPI{API: e.c, tearing: -1}
	api.between = func() { _ = other.Write(ctx, "k", []byte("o"), 1) }
	w, err := s3fence.NewWriter(api, e.bucket, nil)
	if err != nil {
		t.Fatal(err)
	}
	werr := w.Write(ctx, "k", []byte("mine"), 2)
	t.Logf("Write(token 2) under constant change: %v (%d HEADs, %d torn)", werr, api.heads, api.torn)
	if werr == nil {
		return
	}
	for _, class := range []error{s3fence.ErrContention, fence.ErrStale, fence.ErrUnknown, fence.ErrInvalid} {
		if errors.Is(werr, class) {
			if class != s3fence.ErrContention {
				t.Fatalf("matches %v, want ErrContention", class)
			}
			return
		}
	}
	t.Fatalf("the write gave up because the object kept changing, but the error matches no documented class (want s3fence.ErrContention): %v", werr)
}

// tearingWriter returns a writer through a tearingAPI on e that tears tearing
// HEADs (see tearingAPI), in whose gap good writes token 10 ("v10") to "k".
func tearingWriter(t *testing.T, e *s3env, good *s3fence.Writer, tearing int, o *s3fence.WriterOptions) (*s3fence.Writer, *tearingAPI) {
	t.Helper()
	api := &tearingAPI{API: e.c, tearing: tearing}
	api.between = func() {
		if err := good.Write(context.Background(), "k", []byte("v10"), 10); err != nil {
			t.Error(err)
		}
	}
	w, err := s3fence.NewWriter(api, e.bucket, o)
	if err != nil {
		t.Fatal(err)
	}
	return w, api
}

// readAfterTears reads "k" through good, after checking that api tore
// exactly one HEAD.
func readAfterTears(t *testing.T, api *tearingAPI, good *s3fence.Writer) ([]byte, fence.Token, error) {
	t.Helper()
	v, tok, rerr := good.Read(context.Background(), "k")
	if api.torn != 1 {
		t.Fatalf("torn %d HEADs, want 1", api.torn)
	}
	return v, tok, rerr
}

// TestTornHeadReuseETagAfter412: a ReuseETag writer's cached ETag gets a
// 412; the HEAD that follows is torn (an old token 4 beside the ETag of
// token 10). Token 5 must not replace token 10.
func TestTornHeadReuseETagAfter412(t *testing.T) {
	e := fakeS3(t)
	ctx := context.Background()
	good := newWriter(t, e, nil)
	w, api := tearingWriter(t, e, good, 0, &s3fence.WriterOptions{ReuseETag: true})
	if err := w.Write(ctx, "k", []byte("v3"), 3); err != nil {
		t.Fatal(err)
	}
	if err := good.Write(ctx, "k", []byte("v4"), 4); err != nil {
		t.Fatal(err)
	}
	api.tearing = 1
	werr := w.Write(ctx, "k", []byte("v5"), 5)
	v, tok, rerr := readAfterTears(t, api, good)
	if !errors.Is(werr, fence.ErrStale) || tok != 10 || string(v) != "v10" || rerr != nil {
		t.Fatalf("Write(token 5) after a 412 and a torn HEAD: %v; object holds %q token %d (%v)", werr, v, tok, rerr)
	}
}

// TestTornHeadAfterAmbiguousPut: the writer's PUT (token 5) lands but its
// reply is lost; the HEAD that looks for it is torn: its own write id and
// token beside the ETag of a newer write (token 10). Trusting it, a
// ReuseETag writer would remember that ETag as its own write and its next
// write (token 6) would replace token 10.
func TestTornHeadAfterAmbiguousPut(t *testing.T) {
	e := fakeS3(t)
	ctx := context.Background()
	good := newWriter(t, e, nil)
	if err := good.Write(ctx, "k", []byte("v1"), 1); err != nil {
		t.Fatal(err)
	}
	w, api := tearingWriter(t, e, good, 0, &s3fence.WriterOptions{ReuseETag: true})
	api.lostPuts, api.tearAfterLost = 1, 1
	werr := w.Write(ctx, "k", []byte("v5"), 5)
	t.Logf("Write(token 5), reply lost, torn HEAD: %v", werr)
	if werr != nil && !errors.Is(werr, fence.ErrUnknown) {
		t.Fatalf("a write that landed reported as %v, want nil or ErrUnknown", werr)
	}
	werr6 := w.Write(ctx, "k", []byte("v6"), 6)
	v, tok, rerr := readAfterTears(t, api, good)
	if werr6 == nil || tok != 10 || string(v) != "v10" || rerr != nil {
		t.Fatalf("Write(token 6) after token 10: %v; object holds %q token %d (%v)", werr6, v, tok, rerr)
	}
}

// TestTornHeadBeforeDelete: a Delete (tombstone) with token 5 after a torn
// HEAD (token 3's metadata, token 10's ETag) must not bury token 10.
func TestTornHeadBeforeDelete(t *testing.T) {
	e := fakeS3(t)
	ctx := context.Background()
	good := newWriter(t, e, nil)
	if err := good.Write(ctx, "k", []byte("v3"), 3); err != nil {
		t.Fatal(err)
	}
	w, api := tearingWriter(t, e, good, 1, nil)
	derr := w.Delete(ctx, "k", 5)
	v, tok, rerr := readAfterTears(t, api, good)
	if !errors.Is(derr, fence.ErrStale) || tok != 10 || string(v) != "v10" || rerr != nil {
		t.Fatalf("Delete(token 5) after a torn HEAD: %v; object holds %q token %d (%v)", derr, v, tok, rerr)
	}
}

// TestTornHeadSameTokenRewriteThenStale: the torn HEAD pairs the metadata
// of a token-7 write with the ETag of a token-9 tombstone that followed a
// rewrite of the same value and token (a new write id, so a new body and
// ETag). Token 8 must be refused, and Read must still see the tombstone.
func TestTornHeadSameTokenRewriteThenStale(t *testing.T) {
	e := fakeS3(t)
	ctx := context.Background()
	good := newWriter(t, e, nil)
	if err := good.Write(ctx, "k", []byte("same"), 7); err != nil {
		t.Fatal(err)
	}
	w, api := tearingWriter(t, e, good, 1, nil)
	api.between = func() {
		// Same value and token, new write id; then a tombstone of token 9.
		if err := good.Write(ctx, "k", []byte("same"), 7); err != nil {
			t.Error(err)
		}
		if err := good.Delete(ctx, "k", 9); err != nil {
			t.Error(err)
		}
	}
	werr := w.Write(ctx, "k", []byte("late"), 8)
	_, _, rerr := readAfterTears(t, api, good)
	if !errors.Is(werr, fence.ErrStale) || !errors.Is(rerr, fence.ErrNotFound) {
		t.Fatalf("Write(token 8) after a tombstone of token 9 (torn HEAD): %v; Read: %v", werr, rerr)
	}
	if strings.Contains(werr.Error(), "9 HEADs") {
		t.Fatalf("gave up reading: %v", werr)
	}
}
