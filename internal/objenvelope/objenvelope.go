// Package objenvelope is the stored form of a fenced object (S3) or blob
// (Azure): one header line with the token and a random write id, then the
// value. Users must not depend on it; the format is documented in
// docs/backends.md (S3).
package objenvelope

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"

	"github.com/fencekit/fencekit/fence"
)

// The stored object is an envelope: one header line, then the value.
//
//	fencekit-v1 <token> <write id>\n<value>
//	fencekit-v1 <token> <write id> deleted\n        (a tombstone: no value)
//
// The write id is random for every write, so two writes never store the same
// bytes: on S3, whose ETag hashes the body, they never share an ETag, even when
// their values are equal, and an ETag read before a newer grant's write can
// never match after it (no ABA). The id also lets a writer recognise its own
// write after a lost reply. Another tool reads the value by skipping the first
// line; the token and write id are also in the object's metadata.
const magic = "fencekit-v1"

// Envelope is a parsed stored object.
type Envelope struct {
	Token   fence.Token
	WriteID string
	Deleted bool // a tombstone: the fence stays, the value is gone
	Value   []byte
}

// Encode returns the stored bytes of e.
func (e Envelope) Encode() []byte {
	var b bytes.Buffer
	b.Grow(len(magic) + 48 + len(e.Value))
	fmt.Fprintf(&b, "%s %d %s", magic, uint64(e.Token), e.WriteID)
	if e.Deleted {
		b.WriteString(" deleted")
	}
	b.WriteByte('\n')
	b.Write(e.Value)
	return b.Bytes()
}

// ErrNoEnvelope marks an object that fencekit did not write.
var ErrNoEnvelope = errors.New("object has no fencekit envelope")

// Parse reads a stored object. An object that does not start with the
// envelope header returns ErrNoEnvelope; a malformed header returns another
// error. Only the canonical encoding parses: Parse(b).Encode() is b.
func Parse(b []byte) (Envelope, error) {
	nl := bytes.IndexByte(b, '\n')
	if !bytes.HasPrefix(b, []byte(magic+" ")) || nl < 0 {
		return Envelope{}, ErrNoEnvelope
	}
	fields := bytes.Split(b[len(magic)+1:nl], []byte{' '})
	if len(fields) < 2 || len(fields) > 3 {
		return Envelope{}, fmt.Errorf("malformed envelope header %q", b[:nl])
	}
	tok, err := strconv.ParseUint(string(fields[0]), 10, 64)
	// Only the canonical form (no leading zeros) is a token: one token, one
	// header, found by FuzzEnvelope.
	if err != nil || !fence.Token(tok).Valid() || strconv.FormatUint(tok, 10) != string(fields[0]) {
		return Envelope{}, fmt.Errorf("malformed token in envelope header %q", b[:nl])
	}
	if len(fields[1]) == 0 {
		return Envelope{}, fmt.Errorf("empty write id in envelope header %q", b[:nl])
	}
	e := Envelope{Token: fence.Token(tok), WriteID: string(fields[1])}
	if len(fields) == 3 {
		if string(fields[2]) != "deleted" {
			return Envelope{}, fmt.Errorf("malformed envelope header %q", b[:nl])
		}
		e.Deleted = true
		if nl+1 != len(b) {
			return Envelope{}, fmt.Errorf("tombstone with a value")
		}
		return e, nil
	}
	e.Value = b[nl+1:]
	return e, nil
}

// Decode returns the value and token a reader sees in the stored bytes b: a
// tombstone is fence.ErrNotFound; bytes without an envelope (another tool's
// object) are the value with token 0, or errUnfenced when refuseUnfenced.
func Decode(b []byte, refuseUnfenced bool, errUnfenced error) ([]byte, fence.Token, error) {
	e, err := Parse(b)
	switch {
	case errors.Is(err, ErrNoEnvelope):
		if refuseUnfenced {
			return nil, 0, errUnfenced
		}
		return b, 0, nil
	case err != nil:
		return nil, 0, err
	case e.Deleted:
		return nil, 0, fence.ErrNotFound
	}
	if e.Value == nil {
		e.Value = []byte{}
	}
	return e.Value, e.Token, nil
}
