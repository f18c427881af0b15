package fencetest_test

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/internal/nemesisrun"
)

// The in-memory server over TCP, one request line and one reply line at a
// time, so that a faultnet proxy between it and a memClient can lose a reply
// (the AcquirerSuite's Faulty harness). Requests:
//
//	G <name> <ttl> [<nonce> <wait>] grant: OK <token> | HELD | EXHAUSTED
//	C <name> <nonce> <ttl> leave: out of the line, the nonce refused for a
//	                      while, its grant released: OK
//	K <name> <nonce>      release the nonce's grant only (the
//	                      cleanup-gives-up mutant sends it): OK
//	E <name> <token> <ttl> extend (ttl 0: release): OK | NO
//	H <name>              holder:  <token> <1 if live, else 0>
//	W <key> <token> <value> fenced write: OK | STALE <token held>
//	P <key> <token> <value> unfenced put (only the write-retry-unfenced mutant sends it): OK
//	R <key>               read:    VAL <token> <value> | NOTFOUND
//
// Names, keys and values travel hex-encoded, durations in nanoseconds. Any
// request may be answered BUSY instead (NemesisSuite.NotRun): not run.

// serveMem serves s on a loopback port until t ends and returns its address.
func serveMem(t *testing.T, s *memServer) string {
	t.Helper()
	return nemesisrun.ServeLines(t, func(req []byte) []byte { return []byte(s.answer(string(req))) })
}

// answer runs one request line on s.
func (s *memServer) answer(req string) string {
	f := strings.Fields(req)
	if len(f) < 2 {
		return "ERR malformed"
	}
	nb, err := hex.DecodeString(f[1])
	if err != nil {
		return "ERR name"
	}
	name := string(nb)
	s.mu.Lock()
	busy := s.now().Before(s.busyUntil)
	s.mu.Unlock()
	if busy {
		return "BUSY"
	}
	num := func(i int) int64 {
		if i >= len(f) {
			return -1
		}
		n, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil {
			return -1
		}
		return n
	}
	switch f[0] {
	case "C", "K":
		if len(f) < 3 {
			return "ERR malformed"
		}
		s.leave(name, f[2], time.Duration(num(3)), f[0] == "C")
		return "OK"
	case "G":
		nonce := ""
		if len(f) > 3 && f[3] != "-" {
			nonce = f[3]
		}
		tok, left, err := s.grantNonce(name, time.Duration(num(2)), nonce, num(4) == 1)
		switch {
		case err == nil:
			return fmt.Sprintf("OK %d %d", uint64(tok), int64(left))
		case errors.Is(err, fence.ErrHeld):
			return "HELD"
		case errors.Is(err, fence.ErrTokensExhausted):
			return "EXHAUSTED"
		}
		return "ERR " + err.Error()
	case "E":
		if s.extend(name, fence.Token(num(2)), time.Duration(num(3))) {
			return "OK"
		}
		return "NO"
	case "W", "P":
		var value []byte
		if len(f) > 3 {
			if value, err = hex.DecodeString(f[3]); err != nil {
				return "ERR value"
			}
		}
		tok := fence.Token(num(2))
		if f[0] == "P" {
			s.mu.Lock()
			defer s.mu.Unlock()
			s.rows[s.fold("key", name)] = &memRow{value: value, token: tok}
			return "OK"
		}
		err := memWriter{s: s}.Write(context.Background(), name, value, tok)
		var se *fence.StaleError
		switch {
		case err == nil:
			return "OK"
		case errors.As(err, &se):
			return "STALE " + strconv.FormatUint(uint64(se.Current), 10)
		}
		return "ERR " + err.Error()
	case "R":
		v, tok, err := memWriter{s: s}.Read(context.Background(), name)
		switch {
		case err == nil:
			return fmt.Sprintf("VAL %d %x", uint64(tok), v)
		case errors.Is(err, fence.ErrNotFound):
			return "NOTFOUND"
		}
		return "ERR " + err.Error()
	case "H":
		s.mu.Lock()
		defer s.mu.Unlock()
		l := s.lock(name)
		live := 0
		if l.holder != 0 && s.now().Before(l.expires) {
			live = 1
		}
		return fmt.Sprintf("%d %d", l.holder, live)
	}
	return "ERR unknown request"
}

// memClient reaches a memServer over TCP, on one connection that it dials
// again after an error.
type memClient struct {
	addr string

	mu   sync.Mutex
	conn net.Conn
	r    *bufio.Reader
}

// call sends one request line and returns the reply line. An error means the
// request may have been acted on.
func (c *memClient) call(ctx context.Context, format string, args ...any) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn == nil {
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", c.addr)
		if err != nil {
			return "", err
		}
		c.conn, c.r = conn, bufio.NewReader(conn)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(10 * time.Second)
	}
	_ = c.conn.SetDeadline(deadline)
	line, err := func() (string, error) {
		if _, err := fmt.Fprintf(c.conn, format+"\n", args...); err != nil {
			return "", err
		}
		return c.r.ReadString('\n')
	}()
	if err != nil {
		c.conn.Close()
		c.conn = nil
		return "", err
	}
	return strings.TrimSpace(line), nil
}

// close closes c's connection, if open.
func (c *memClient) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != nil {
		c.conn.Close()
		c.conn = nil
	}
}

// setBusy makes the server answer BUSY to every request over TCP for d.
func (s *memServer) setBusy(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.busyUntil = s.now().Add(d)
}

// grant asks for name; it returns the token and how much of its lease is
// left.
func (c *memClient) grant(ctx context.Context, name string, ttl time.Duration, nonce string, wait bool) (fence.Token, time.Duration, error) {
	w := 0
	if wait {
		w = 1
	}
	if nonce == "" {
		nonce = "-"
	}
	r, err := c.call(ctx, "G %x %d %s %d", name, int64(ttl), nonce, w)
	switch {
	case err != nil:
		return 0, 0, fmt.Errorf("mem: acquire %q: %w: %v", name, fence.ErrUnknown, err)
	case r == "BUSY":
		return 0, 0, fmt.Errorf("mem: acquire %q: %w", name, errMemNotRun)
	case r == "HELD":
		return 0, 0, fence.ErrHeld
	case r == "EXHAUSTED":
		return 0, 0, fmt.Errorf("mem: acquire %q: %w", name, fence.ErrTokensExhausted)
	case strings.HasPrefix(r, "OK "):
		var tok uint64
		var left int64
		if _, err := fmt.Sscanf(r, "OK %d %d", &tok, &left); err != nil {
			return 0, 0, fmt.Errorf("mem: acquire %q: reply %q", name, r)
		}
		return fence.Token(tok), time.Duration(left), nil
	}
	return 0, 0, fmt.Errorf("mem: acquire %q: reply %q", name, r)
}

func (c *memClient) extend(ctx context.Context, name string, tok fence.Token, ttl time.Duration) (bool, error) {
	r, err := c.call(ctx, "E %x %d %d", name, uint64(tok), int64(ttl))
	if err != nil {
		return false, err
	}
	if r == "BUSY" {
		return false, errMemNotRun
	}
	return r == "OK", nil
}

// holds reports whether tok holds name, live, on the server.
func (c *memClient) holds(ctx context.Context, name string, tok fence.Token) (bool, error) {
	r, err := c.call(ctx, "H %x", name)
	if err != nil {
		return false, err
	}
	return r == fmt.Sprintf("%d 1", uint64(tok)), nil
}

// memNetWriter is a fence.FencedWriter with Read on a memServer over TCP
// (through a faultnet proxy, for the nemesis).
type memNetWriter struct {
	s   *memServer
	via *memClient
}

// Write stores value under key unless key holds a larger token; an answer
// lost on the way is ErrUnknown. The write-retry-unfenced mutant sends a
// write whose answer was lost again as an unfenced put, as a "repair" path
// that skips the fence would.
func (w memNetWriter) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	if err := (memWriter{s: w.s}).check("write", ctx, key); err != nil {
		return err
	}
	if err := leasekit.CheckToken("write", token); err != nil {
		return err
	}
	r, err := w.via.call(ctx, "W %x %d %x", key, uint64(token), value)
	if err != nil {
		if w.s.bug == "write-retry-unfenced" {
			if r, err2 := w.via.call(ctx, "P %x %d %x", key, uint64(token), value); err2 == nil && r == "OK" {
				return nil
			}
		}
		return fmt.Errorf("mem: write %q: %w: %v", key, fence.ErrUnknown, err)
	}
	switch {
	case r == "OK":
		return nil
	case strings.HasPrefix(r, "STALE "):
		cur, err := strconv.ParseUint(strings.TrimPrefix(r, "STALE "), 10, 64)
		if err != nil {
			return fmt.Errorf("mem: write %q: reply %q", key, r)
		}
		return &fence.StaleError{Key: key, Offered: token, Current: fence.Token(cur)}
	}
	return fmt.Errorf("mem: write %q: reply %q", key, r)
}

// Read returns the value and token under key.
func (w memNetWriter) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	if err := (memWriter{s: w.s}).check("read", ctx, key); err != nil {
		return nil, 0, err
	}
	r, err := w.via.call(ctx, "R %x", key)
	if err != nil {
		return nil, 0, fmt.Errorf("mem: read %q: %v", key, err)
	}
	if r == "NOTFOUND" {
		return nil, 0, fence.ErrNotFound
	}
	f := strings.Fields(r)
	if len(f) < 2 || f[0] != "VAL" {
		return nil, 0, fmt.Errorf("mem: read %q: reply %q", key, r)
	}
	tok, err := strconv.ParseUint(f[1], 10, 64)
	if err != nil {
		return nil, 0, fmt.Errorf("mem: read %q: reply %q", key, r)
	}
	var v []byte
	if len(f) > 2 {
		if v, err = hex.DecodeString(f[2]); err != nil {
			return nil, 0, fmt.Errorf("mem: read %q: reply %q", key, r)
		}
	}
	return v, fence.Token(tok), nil
}

var (
	_ fence.FencedWriter = memNetWriter{}
	_ fence.Reader       = memNetWriter{}
)
