package azfence

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
// The write id is random for every write. Azure's ETags do not hash the body
// (Azurite's are its clock in milliseconds times a random number, so two
// writes in one millisecond can share one), so the write id is also kept in
// a blob index tag that every conditional write requires along with the
// ETag (see Writer), and it lets a writer recognise its own write after a lost
// reply. Another tool reads the value by skipping the first line; the token
// and write id are also in the blob's metadata.
const magic = "fencekit-v1"

// envelope is a parsed stored object.
type envelope struct {
	token   fence.Token
	writeID string
	deleted bool
	value   []byte
}

func (e envelope) encode() []byte {
	var b bytes.Buffer
	b.Grow(len(magic) + 48 + len(e.value))
	fmt.Fprintf(&b, "%s %d %s", magic, uint64(e.token), e.writeID)
	if e.deleted {
		b.WriteString(" deleted")
	}
	b.WriteByte('\n')
	b.Write(e.value)
	return b.Bytes()
}

// errNoEnvelope marks an object that fencekit did not write.
var errNoEnvelope = errors.New("azfence: object has no fencekit envelope")

// parseEnvelope reads a stored object. An object that does not start with the
// envelope header returns errNoEnvelope; a malformed header returns another error.
func parseEnvelope(b []byte) (envelope, error) {
	nl := bytes.IndexByte(b, '\n')
	if !bytes.HasPrefix(b, []byte(magic+" ")) || nl < 0 {
		return envelope{}, errNoEnvelope
	}
	fields := bytes.Split(b[len(magic)+1:nl], []byte{' '})
	if len(fields) < 2 || len(fields) > 3 {
		return envelope{}, fmt.Errorf("azfence: malformed envelope header %q", b[:nl])
	}
	tok, err := strconv.ParseUint(string(fields[0]), 10, 64)
	// Only the canonical form (no leading zeros) is a token: one token, one
	// header, found by FuzzEnvelope.
	if err != nil || !fence.Token(tok).Valid() || strconv.FormatUint(tok, 10) != string(fields[0]) {
		return envelope{}, fmt.Errorf("azfence: malformed token in envelope header %q", b[:nl])
	}
	if len(fields[1]) == 0 {
		return envelope{}, fmt.Errorf("azfence: empty write id in envelope header %q", b[:nl])
	}
	e := envelope{token: fence.Token(tok), writeID: string(fields[1])}
	if len(fields) == 3 {
		if string(fields[2]) != "deleted" {
			return envelope{}, fmt.Errorf("azfence: malformed envelope header %q", b[:nl])
		}
		e.deleted = true
		if nl+1 != len(b) {
			return envelope{}, fmt.Errorf("azfence: tombstone with a value")
		}
		return e, nil
	}
	e.value = b[nl+1:]
	return e, nil
}
