package objenvelope

import (
	"bytes"
	"testing"

	"github.com/fencekit/fencekit/fence"
)

// FuzzEnvelope: any bytes parse without panicking; what parses re-encodes to the
// same bytes and has a valid token; what is encoded parses back.
func FuzzEnvelope(f *testing.F) {
	for _, seed := range [][]byte{
		[]byte("fencekit-v1 1 abc\nvalue"),
		[]byte("fencekit-v1 9007199254740991 w\n"),
		[]byte("fencekit-v1 5 w deleted\n"),
		[]byte("fencekit-v1 0 w\nzero token"),
		[]byte("fencekit-v1 9007199254740992 w\ntoo big"),
		[]byte("fencekit-v1 5 w deleted\ntrailing"),
		[]byte("fencekit-v1 5  \n"),
		[]byte("fencekit-v1 -1 w\n"),
		[]byte("plain bytes from another tool"),
		[]byte("fencekit-v1 7 w\nline1\nline2\x00\xff"),
		{},
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := Parse(b)
		if err != nil {
			return
		}
		if !e.Token.Valid() || e.WriteID == "" {
			t.Fatalf("parsed %q into token %d, write id %q", b, e.Token, e.WriteID)
		}
		if got := e.Encode(); !bytes.Equal(got, b) {
			t.Fatalf("parse then encode changed %q into %q", b, got)
		}
	})
}

func FuzzEnvelopeRoundTrip(f *testing.F) {
	f.Add(uint64(1), "abc", []byte("v"), false)
	f.Add(uint64(fence.MaxToken), "0123456789abcdef", []byte{}, true)
	f.Fuzz(func(t *testing.T, tok uint64, id string, value []byte, deleted bool) {
		if !fence.Token(tok).Valid() || id == "" || bytes.ContainsAny([]byte(id), " \n") {
			return
		}
		if deleted {
			value = nil
		}
		e := Envelope{Token: fence.Token(tok), WriteID: id, Deleted: deleted, Value: value}
		got, err := Parse(e.Encode())
		if err != nil {
			t.Fatalf("encoded %+v does not parse: %v", e, err)
		}
		if got.Token != e.Token || got.WriteID != e.WriteID || got.Deleted != e.Deleted || !bytes.Equal(got.Value, e.Value) {
			t.Fatalf("round trip %+v -> %+v", e, got)
		}
	})
}
