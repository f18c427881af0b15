package fencetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// WriterSuite is the conformance suite for a fence.FencedWriter. The optional
// capabilities fence.Reader and fence.Deleter are found by type assertion and
// tested only when the writer has them.
type WriterSuite struct {
	// New returns a writer on a live backend. Tests use fresh random keys, so one
	// backend may serve every test. Required.
	New func(t *testing.T) fence.FencedWriter

	// BadKeys are keys the backend cannot store, beside the empty key, which every
	// writer must refuse with ErrInvalid.
	BadKeys []string

	// Writers and WritesEach size the concurrency test. Default: 16 x 20.
	Writers, WritesEach int

	// Faulty, when set, returns a writer with a client of its own that reaches
	// the backend only through the returned proxy, and nothing else uses that
	// proxy. The lost-reply cases arm the proxy to lose the reply of the next
	// request after a warm-up write, and check the outcome through a writer
	// from New. When Faulty is nil, or the environment variable named by
	// LostReplyEnv is "0", they are skipped with a logged reason.
	Faulty func(t *testing.T) (fence.FencedWriter, *faultnet.Proxy)
}

// Run runs every test of the suite as a subtest of t.
func (s WriterSuite) Run(t *testing.T) {
	if s.New == nil {
		t.Fatal("fencetest: WriterSuite.New is nil")
	}
	if s.Writers <= 0 {
		s.Writers = 16
	}
	if s.WritesEach <= 0 {
		s.WritesEach = 20
	}
	tests := []struct {
		name string
		fn   func(*testing.T)
	}{
		{"FirstWriteAccepted", s.testFirstWrite},
		{"EqualTokenAccepted", s.testEqualToken},
		{"LowerTokenRejected", s.testLowerToken},
		{"HigherTokenOverwrites", s.testHigherToken},
		{"EmptyAndLargeValues", s.testValues},
		{"ConcurrentWriters", s.testConcurrent},
		{"BadInput", s.testBadInput},
		{"KeysIndependent", s.testKeysIndependent},
		{"LostReplyWrite", s.lostReply(s.testLostReplyWrite)},
		{"LostReplyDelete", s.lostReply(s.testLostReplyDelete)},
	}
	// The optional capabilities are tested only where the writer has them, as
	// testing/fstest does; their tests are not registered otherwise.
	probe := s.New(t)
	if _, ok := probe.(fence.Reader); ok {
		tests = append(tests, struct {
			name string
			fn   func(*testing.T)
		}{"ReadMissing", s.testReadMissing}, struct {
			name string
			fn   func(*testing.T)
		}{"ValueNotAliased", s.testNotAliased})
	} else {
		t.Logf("fencetest: %T has no Read: read-back checks are left out", probe)
	}
	if _, ok := probe.(fence.Deleter); ok {
		tests = append(tests, struct {
			name string
			fn   func(*testing.T)
		}{"DeleteKeepsFence", s.testDelete})
	} else {
		t.Logf("fencetest: %T has no fenced Delete: its tests are left out", probe)
	}
	for _, tc := range tests {
		t.Run(tc.name, tc.fn)
	}
}

func mustWrite(t *testing.T, w fence.FencedWriter, key string, v []byte, tok fence.Token) {
	t.Helper()
	if err := w.Write(ctxT(t), key, v, tok); err != nil {
		t.Fatalf("Write(%q, token %d): %v", key, tok, err)
	}
}

// expect checks the stored value and token when w can read.
func expect(t *testing.T, w fence.FencedWriter, key string, want []byte, wantTok fence.Token) {
	t.Helper()
	r, ok := w.(fence.Reader)
	if !ok {
		return
	}
	v, tok, err := r.Read(ctxT(t), key)
	if err != nil {
		t.Fatalf("Read(%q): %v", key, err)
	}
	if !bytes.Equal(v, want) || tok != wantTok {
		t.Fatalf("Read(%q) = %q token %d, want %q token %d", key, trim(v), tok, trim(want), wantTok)
	}
}

func trim(b []byte) []byte {
	if len(b) > 40 {
		return append(b[:40:40], "..."...)
	}
	return b
}

func expectStale(t *testing.T, err error, key string, offered, current fence.Token) {
	t.Helper()
	if !errors.Is(err, fence.ErrStale) {
		t.Fatalf("write with token %d after %d: err = %v, want ErrStale", offered, current, err)
	}
	var se *fence.StaleError
	if !errors.As(err, &se) {
		t.Fatalf("stale write: %v is not a *fence.StaleError", err)
	}
	if se.Key != key || se.Offered != offered || se.Current != current {
		t.Fatalf("StaleError = {Key %q, Offered %d, Current %d}, want {%q, %d, %d}", se.Key, se.Offered, se.Current, key, offered, current)
	}
}

func (s WriterSuite) testFirstWrite(t *testing.T) {
	w := s.New(t)
	key := Name("first")
	mustWrite(t, w, key, []byte("v1"), 7)
	expect(t, w, key, []byte("v1"), 7)
}

func (s WriterSuite) testEqualToken(t *testing.T) {
	w := s.New(t)
	key := Name("equal")
	mustWrite(t, w, key, []byte("one"), 3)
	mustWrite(t, w, key, []byte("two"), 3)
	expect(t, w, key, []byte("two"), 3)
}

func (s WriterSuite) testLowerToken(t *testing.T) {
	w := s.New(t)
	key := Name("lower")
	mustWrite(t, w, key, []byte("newer"), 5)
	err := w.Write(ctxT(t), key, []byte("stale"), 4)
	expectStale(t, err, key, 4, 5)
	expect(t, w, key, []byte("newer"), 5)
	// The lowest valid token is rejected too.
	expectStale(t, w.Write(ctxT(t), key, []byte("stale"), 1), key, 1, 5)
	expect(t, w, key, []byte("newer"), 5)
}

func (s WriterSuite) testHigherToken(t *testing.T) {
	w := s.New(t)
	key := Name("higher")
	mustWrite(t, w, key, []byte("a"), 1)
	mustWrite(t, w, key, []byte("b"), 2)
	mustWrite(t, w, key, []byte("c"), fence.MaxToken)
	expect(t, w, key, []byte("c"), fence.MaxToken)
	expectStale(t, w.Write(ctxT(t), key, []byte("d"), fence.MaxToken-1), key, fence.MaxToken-1, fence.MaxToken)
}

func (s WriterSuite) testValues(t *testing.T) {
	w := s.New(t)
	key := Name("values")
	mustWrite(t, w, key, nil, 1)
	expect(t, w, key, []byte{}, 1)
	big := bytes.Repeat([]byte{0, 1, 2, 0xff}, 256*1024) // 1 MiB, with NUL and high bytes
	mustWrite(t, w, key, big, 2)
	expect(t, w, key, big, 2)
}

// testNotAliased: the writer keeps no reference to the caller's buffer, and
// Read hands out no reference to what it stores: changing either buffer
// afterwards leaves the stored value as written.
func (s WriterSuite) testNotAliased(t *testing.T) {
	w := s.New(t)
	r := w.(fence.Reader)
	key := Name("alias")
	buf := []byte("original")
	mustWrite(t, w, key, buf, 1)
	copy(buf, "CHANGED!")
	expect(t, w, key, []byte("original"), 1)
	v, _, err := r.Read(ctxT(t), key)
	if err != nil {
		t.Fatalf("Read(%q): %v", key, err)
	}
	for i := range v {
		v[i] = 'Z'
	}
	expect(t, w, key, []byte("original"), 1)
}

// testKeysIndependent: keys that differ in any byte are different keys, also
// where a collation or a conversion would fold them into one (case, a
// trailing space, 4-byte characters, Unicode normalisation, a tab, a long
// key's last byte, a path a file system resolves). A key spelled as such a
// path may instead be refused with ErrInvalid. A larger token on one key of a pair must not fence the
// other, and each keeps its own value.
func (s WriterSuite) testKeysIndependent(t *testing.T) {
	w := s.New(t)
	for _, p := range confusablePairs(Name("keys")) {
		if p.skip(s.BadKeys) {
			continue
		}
		err := w.Write(ctxT(t), p.a, []byte("first"), 10)
		if errors.Is(err, fence.ErrInvalid) && p.long {
			err2 := w.Write(ctxT(t), p.b, []byte("second"), 5)
			if errors.Is(err2, fence.ErrInvalid) {
				t.Logf("%s: both keys refused with ErrInvalid (a length limit below %d bytes): %v", p.what, len(p.a), err)
				continue
			}
			t.Errorf("%s: one key refused (%v), the other of the same length not (%v)", p.what, err, err2)
			continue
		}
		if errors.Is(err, fence.ErrInvalid) && p.path {
			// Refused rather than merged: the plain key must still work.
			if err2 := w.Write(ctxT(t), p.b, []byte("second"), 5); err2 != nil {
				t.Errorf("%s: %s refused (%v), and Write(%s, token 5): %v, want success", p.what, shortName(p.a), err, shortName(p.b), err2)
			} else if r, ok := w.(fence.Reader); ok {
				if v, tok, err := r.Read(ctxT(t), p.b); err != nil || string(v) != "second" || tok != 5 {
					t.Errorf("%s: Read(%s) = %q token %d, %v; want \"second\" token 5", p.what, shortName(p.b), trim(v), tok, err)
				}
			}
			t.Logf("%s: key %s refused with ErrInvalid: %v", p.what, shortName(p.a), err)
			continue
		}
		if err != nil {
			t.Errorf("%s: Write(%s, token 10): %v", p.what, shortName(p.a), err)
			continue
		}
		if err := w.Write(ctxT(t), p.b, []byte("second"), 5); err != nil {
			t.Errorf("%s: after Write(%s, token 10), Write(%s, token 5): %v, want success: the two keys share one fence", p.what, shortName(p.a), shortName(p.b), err)
			continue
		}
		r, ok := w.(fence.Reader)
		if !ok {
			continue
		}
		for _, k := range []struct {
			key string
			v   string
			tok fence.Token
		}{{p.a, "first", 10}, {p.b, "second", 5}} {
			v, tok, err := r.Read(ctxT(t), k.key)
			if err != nil || string(v) != k.v || tok != k.tok {
				t.Errorf("%s: Read(%s) = %q token %d, %v; want %q token %d: the two keys share one row", p.what, shortName(k.key), trim(v), tok, err, k.v, k.tok)
			}
		}
	}
}

func (s WriterSuite) testReadMissing(t *testing.T) {
	r := s.New(t).(fence.Reader)
	_, _, err := r.Read(ctxT(t), Name("missing"))
	if !errors.Is(err, fence.ErrNotFound) {
		t.Fatalf("Read of a missing key: err = %v, want ErrNotFound", err)
	}
}

func (s WriterSuite) testDelete(t *testing.T) {
	w := s.New(t)
	d := w.(fence.Deleter)
	key := Name("delete")
	mustWrite(t, w, key, []byte("v"), 4)
	expectStale(t, d.Delete(ctxT(t), key, 3), key, 3, 4)
	expect(t, w, key, []byte("v"), 4)
	if err := d.Delete(ctxT(t), key, 5); err != nil {
		t.Fatalf("Delete with token 5: %v", err)
	}
	if r, ok := w.(fence.Reader); ok {
		if _, _, err := r.Read(ctxT(t), key); !errors.Is(err, fence.ErrNotFound) {
			t.Fatalf("Read after Delete: err = %v, want ErrNotFound", err)
		}
	}
	// The tombstone keeps the fence: a stale writer cannot recreate the key.
	expectStale(t, w.Write(ctxT(t), key, []byte("zombie"), 4), key, 4, 5)
	if r, ok := w.(fence.Reader); ok {
		if _, _, err := r.Read(ctxT(t), key); !errors.Is(err, fence.ErrNotFound) {
			t.Fatalf("Read after a rejected write to a deleted key: err = %v, want ErrNotFound", err)
		}
	}
	// Deleting a deleted key again with the same token is accepted; a lower one is not.
	if err := d.Delete(ctxT(t), key, 5); err != nil {
		t.Fatalf("Delete again with an equal token: %v", err)
	}
	expectStale(t, d.Delete(ctxT(t), key, 2), key, 2, 5)
	mustWrite(t, w, key, []byte("reborn"), 5)
	expect(t, w, key, []byte("reborn"), 5)
	// Deleting a key never written leaves a tombstone too.
	fresh := Name("delete-fresh")
	if err := d.Delete(ctxT(t), fresh, 9); err != nil {
		t.Fatalf("Delete of a key never written: %v", err)
	}
	expectStale(t, w.Write(ctxT(t), fresh, []byte("x"), 8), fresh, 8, 9)
}

type writeRecord struct {
	token      fence.Token
	accepted   bool
	current    fence.Token // for a rejected write, the token the key held
	start, end time.Time
}

// testConcurrent runs many writers with random tokens on one key. It checks that
// the writes the store accepted are consistent with a fenced register: a write
// that finished before another began never has a larger accepted token than it;
// every rejection names a larger token that some write offered; and the final
// value is that of the largest token.
func (s WriterSuite) testConcurrent(t *testing.T) {
	w := s.New(t)
	key := Name("concurrent")
	var (
		mu  sync.Mutex
		log []writeRecord
	)
	var wg sync.WaitGroup
	for g := 0; g < s.Writers; g++ {
		wg.Add(1)
		go func(seed uint64) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, 42))
			for i := 0; i < s.WritesEach; i++ {
				tok := fence.Token(1 + rng.IntN(200))
				rec := writeRecord{token: tok, start: time.Now()}
				err := w.Write(context.Background(), key, []byte(fmt.Sprintf("token=%d", tok)), tok)
				rec.end = time.Now()
				var se *fence.StaleError
				switch {
				case err == nil:
					rec.accepted = true
				case errors.As(err, &se):
					rec.current = se.Current
				default:
					t.Errorf("Write(token %d): %v", tok, err)
					return
				}
				mu.Lock()
				log = append(log, rec)
				mu.Unlock()
			}
		}(uint64(g))
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	offered := map[fence.Token]bool{}
	var maxTok fence.Token
	for _, r := range log {
		offered[r.token] = true
		if r.token > maxTok {
			maxTok = r.token
		}
	}
	var accepted []writeRecord
	for _, r := range log {
		if r.accepted {
			accepted = append(accepted, r)
			continue
		}
		if r.current <= r.token || !offered[r.current] {
			t.Errorf("write with token %d rejected naming current token %d, which is not a larger offered token", r.token, r.current)
		}
	}
	// Real-time order: if a finished before b started, b's token must not be lower.
	sort.Slice(accepted, func(i, j int) bool { return accepted[i].end.Before(accepted[j].end) })
	for i, a := range accepted {
		for _, b := range accepted[i+1:] {
			if a.end.Before(b.start) && b.token < a.token {
				t.Errorf("accepted token %d after an earlier accepted write with token %d had finished", b.token, a.token)
			}
		}
	}
	// A write with the largest offered token can never be rejected.
	for _, r := range log {
		if r.token == maxTok && !r.accepted {
			t.Errorf("a write with the largest token %d was rejected", maxTok)
		}
	}
	// Any rejection must be because some accepted write was larger than it.
	for _, r := range log {
		if !r.accepted && r.current > maxTok {
			t.Errorf("rejection names token %d, above every offered token", r.current)
		}
	}
	expect(t, w, key, []byte(fmt.Sprintf("token=%d", maxTok)), maxTok)
	t.Logf("%d writes, %d accepted, largest token %d", len(log), len(accepted), maxTok)
}

func (s WriterSuite) testBadInput(t *testing.T) {
	w := s.New(t)
	ctx := ctxT(t)
	key := Name("bad")
	for _, tok := range []fence.Token{0, fence.MaxToken + 1, ^fence.Token(0)} {
		if err := w.Write(ctx, key, []byte("x"), tok); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("Write with token %d: err = %v, want ErrInvalid", uint64(tok), err)
		}
	}
	short := func(k string) string {
		if len(k) > 40 {
			return fmt.Sprintf("%.40q... (%d bytes)", k, len(k))
		}
		return fmt.Sprintf("%q", k)
	}
	for _, k := range append([]string{""}, s.BadKeys...) {
		if err := w.Write(ctx, k, []byte("x"), 1); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("Write with key %s: err = %v, want ErrInvalid", short(k), err)
		}
		if d, ok := w.(fence.Deleter); ok {
			if err := d.Delete(ctx, k, 1); !errors.Is(err, fence.ErrInvalid) {
				t.Errorf("Delete with key %s: err = %v, want ErrInvalid", short(k), err)
			}
		}
		if r, ok := w.(fence.Reader); ok {
			if _, _, err := r.Read(ctx, k); !errors.Is(err, fence.ErrInvalid) {
				t.Errorf("Read with key %s: err = %v, want ErrInvalid", short(k), err)
			}
		}
	}
	var nilCtx context.Context
	if err := w.Write(nilCtx, key, []byte("x"), 1); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("Write with a nil context: err = %v, want ErrInvalid", err)
	}
	if d, ok := w.(fence.Deleter); ok {
		if err := d.Delete(nilCtx, key, 1); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("Delete with a nil context: err = %v, want ErrInvalid", err)
		}
	}
	if r, ok := w.(fence.Reader); ok {
		if _, _, err := r.Read(nilCtx, key); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("Read with a nil context: err = %v, want ErrInvalid", err)
		}
	}
	if d, ok := w.(fence.Deleter); ok {
		if err := d.Delete(ctx, key, 0); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("Delete with token 0: err = %v, want ErrInvalid", err)
		}
		if err := d.Delete(ctx, "", 1); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("Delete with empty key: err = %v, want ErrInvalid", err)
		}
	}
	if r, ok := w.(fence.Reader); ok {
		if _, _, err := r.Read(ctx, ""); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("Read with empty key: err = %v, want ErrInvalid", err)
		}
		// Nothing was written by the refused calls.
		if _, _, err := r.Read(ctx, key); !errors.Is(err, fence.ErrNotFound) {
			t.Errorf("Read after refused writes: err = %v, want ErrNotFound", err)
		}
	}
}
