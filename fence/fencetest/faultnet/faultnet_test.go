package faultnet_test

import (
	"bufio"
	"bytes"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
)

// The proxy is tested against the real Redis server with its inline protocol,
// so every fault is seen from the server's side too.

func redisTarget(t *testing.T) string {
	addr := testenv.RedisAddr()
	if err := testenv.Dial(addr); err != nil {
		testenv.Missing(t, "Redis", err)
	}
	return addr
}

type conn struct {
	t *testing.T
	c net.Conn
	r *bufio.Reader
}

func dial(t *testing.T, addr string) *conn {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &conn{t: t, c: c, r: bufio.NewReader(c)}
}

// do sends one inline command and returns its reply line, or the read error.
func (c *conn) do(cmd string) (string, error) {
	c.c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.c.Write([]byte(cmd + "\r\n")); err != nil {
		return "", err
	}
	line, err := c.r.ReadString('\n')
	return strings.TrimSpace(line), err
}

func (c *conn) must(cmd string) string {
	c.t.Helper()
	r, err := c.do(cmd)
	if err != nil {
		c.t.Fatalf("%s: %v", cmd, err)
	}
	return r
}

func key(t *testing.T) string {
	return "faultnet:" + t.Name() + ":" + time.Now().Format("150405.000000000")
}

func TestForwards(t *testing.T) {
	p := faultnet.Start(t, redisTarget(t))
	c := dial(t, p.Addr())
	if r := c.must("PING"); r != "+PONG" {
		t.Fatalf("PING through the proxy: %q", r)
	}
}

func TestLoseReplyAppliesAndCuts(t *testing.T) {
	target := redisTarget(t)
	p := faultnet.Start(t, target)
	k := key(t)
	direct := dial(t, target)
	direct.must("DEL " + k)
	c := dial(t, p.Addr())
	c.must("PING") // a chunk that must not match
	p.LoseReply(func(b []byte) bool { return bytes.Contains(b, []byte("INCR")) })
	if r, err := c.do("INCR " + k); err == nil {
		t.Fatalf("INCR whose reply was lost answered %q", r)
	}
	if r := direct.must("GET " + k); r != "$1" {
		t.Fatalf("GET after a lost INCR reply: %q, want the bulk header of \"1\" (the server applied it)", r)
	}
	if s := p.Stats(); s.LostReplies != 1 {
		t.Fatalf("stats %+v, want 1 lost reply", s)
	}
	if p.Pending() != 0 {
		t.Fatal("the fault is still armed")
	}
	c2 := dial(t, p.Addr())
	if r := c2.must("INCR " + k); r != ":2" {
		t.Fatalf("INCR on a new connection after the fault: %q, want :2 (one-shot)", r)
	}
}

func TestDropRequestNeverReachesServer(t *testing.T) {
	target := redisTarget(t)
	p := faultnet.Start(t, target)
	k := key(t)
	direct := dial(t, target)
	direct.must("DEL " + k)
	c := dial(t, p.Addr())
	p.DropRequest(nil)
	if r, err := c.do("INCR " + k); err == nil {
		t.Fatalf("a dropped INCR answered %q", r)
	}
	if r := direct.must("EXISTS " + k); r != ":0" {
		t.Fatalf("EXISTS after a dropped INCR: %q, want :0", r)
	}
}

func TestPartitionHoldsThenDelivers(t *testing.T) {
	target := redisTarget(t)
	p := faultnet.Start(t, target)
	k := key(t)
	direct := dial(t, target)
	direct.must("DEL " + k)
	c := dial(t, p.Addr())
	c.must("PING")
	p.Partition()
	type res struct {
		r   string
		err error
	}
	done := make(chan res, 1)
	go func() { r, err := c.do("INCR " + k); done <- res{r, err} }()
	// While partitioned the server must not see the command: poll it directly
	// for longer than a loopback round trip takes many times over.
	for i := 0; i < 20; i++ {
		if r := direct.must("EXISTS " + k); r != ":0" {
			t.Fatalf("the server saw a command sent during the partition: EXISTS %q", r)
		}
		select {
		case r := <-done:
			t.Fatalf("a command answered during the partition: %+v", r)
		default:
		}
		time.Sleep(5 * time.Millisecond)
	}
	p.Heal()
	r := <-done
	if r.err != nil || r.r != ":1" {
		t.Fatalf("INCR held by the partition: %q, %v; want :1 after Heal", r.r, r.err)
	}
}

func TestCutAfterDeliversOnlyThePrefix(t *testing.T) {
	target := redisTarget(t)
	p := faultnet.Start(t, target)
	k := key(t)
	direct := dial(t, target)
	direct.must("DEL " + k)
	c := dial(t, p.Addr())
	p.CutAfter(4) // "SET " reaches the server, the rest does not
	if _, err := c.do("SET " + k + " v"); err == nil {
		t.Fatal("a cut SET answered")
	}
	if r := direct.must("EXISTS " + k); r != ":0" {
		t.Fatalf("EXISTS after a SET cut after 4 bytes: %q, want :0", r)
	}
}

func TestCutAllAndRefuse(t *testing.T) {
	p := faultnet.Start(t, redisTarget(t))
	c := dial(t, p.Addr())
	c.must("PING")
	p.CutAll()
	if _, err := c.do("PING"); err == nil {
		t.Fatal("PING on a cut connection answered")
	}
	p.Refuse(true)
	c2 := dial(t, p.Addr())
	if _, err := c2.do("PING"); err == nil {
		t.Fatal("PING on a refused connection answered")
	}
	p.Refuse(false)
	if r := dial(t, p.Addr()).must("PING"); r != "+PONG" {
		t.Fatalf("PING after Refuse(false): %q", r)
	}
}

func TestLatencyDelays(t *testing.T) {
	p := faultnet.Start(t, redisTarget(t))
	c := dial(t, p.Addr())
	c.must("PING")
	p.Latency(20*time.Millisecond, 20*time.Millisecond)
	start := time.Now()
	c.must("PING")
	// Two chunks (request and reply), each delayed 20ms: the round trip
	// cannot be shorter than 40ms, however fast the machine.
	if d := time.Since(start); d < 40*time.Millisecond {
		t.Fatalf("round trip with 20ms each way took %v", d)
	}
}

func TestCutRateCutsSome(t *testing.T) {
	p := faultnet.Start(t, redisTarget(t))
	p.CutRate(0.5)
	failed := 0
	for i := 0; i < 40; i++ {
		c := dial(t, p.Addr())
		if _, err := c.do("PING"); err != nil {
			failed++
		}
	}
	// 40 tries at 50%: all-pass or all-fail has probability 2^-39.
	if failed == 0 || failed == 40 {
		t.Fatalf("%d of 40 PINGs failed at a 50%% cut rate", failed)
	}
}

// TestReplyWindow: with a reply window, a lost reply's connection is cut the
// window after its request, not at the server's first bytes nor after
// DefaultReplyWait: the request was applied (INCR), the client sees its
// connection end no earlier than the window, and a chunk that gets no reply
// at all (CLIENT REPLY OFF, as an HTTP/2 control frame gets none) is cut at
// the window too.
func TestReplyWindow(t *testing.T) {
	target := redisTarget(t)
	p := faultnet.Start(t, target)
	const window = 400 * time.Millisecond
	p.ReplyWindow(window)
	k := key(t)
	direct := dial(t, target)
	direct.must("DEL " + k)

	c := dial(t, p.Addr())
	c.must("PING")
	p.LoseReply(func(b []byte) bool { return bytes.Contains(b, []byte("INCR")) })
	sent := time.Now()
	if r, err := c.do("INCR " + k); err == nil {
		t.Fatalf("INCR whose reply was lost answered %q", r)
	}
	if took := time.Since(sent); took < window {
		t.Errorf("the connection was cut %v after the request, before the %v window (at the reply)", took, window)
	}
	if r := direct.must("GET " + k); r != "$1" {
		t.Fatalf("GET after a lost INCR reply: %q, want the bulk header of \"1\" (applied)", r)
	}

	c2 := dial(t, p.Addr())
	c2.must("PING")
	p.LoseReply(func(b []byte) bool { return bytes.Contains(b, []byte("REPLY")) })
	sent = time.Now()
	if r, err := c2.do("CLIENT REPLY OFF"); err == nil {
		t.Fatalf("a chunk whose reply was lost answered %q", r)
	}
	if took := time.Since(sent); took < window || took > faultnet.DefaultReplyWait-time.Second {
		t.Errorf("a chunk with no reply: cut after %v, want about the %v window (not %v)", took, window, faultnet.DefaultReplyWait)
	}
	if s := p.Stats(); s.LostReplies != 2 || p.Pending() != 0 {
		t.Fatalf("stats %+v, %d pending: want 2 lost replies, none pending", s, p.Pending())
	}
}

// TestLoseReplyWithoutReply: a lost reply's request that gets no reply
// (CLIENT REPLY OFF, as MySQL's COM_STMT_CLOSE gets none) is cut as soon as
// the client sends its next request, not DefaultReplyWait later: the server
// acted on the first (replies stay off on that connection until it ends,
// and the next request never reached it).
func TestLoseReplyWithoutReply(t *testing.T) {
	p := faultnet.Start(t, redisTarget(t))
	c := dial(t, p.Addr())
	c.must("PING")
	p.LoseReply(func(b []byte) bool { return bytes.Contains(b, []byte("REPLY")) })
	if _, err := c.c.Write([]byte("CLIENT REPLY OFF\r\n")); err != nil {
		t.Fatal(err)
	}
	for p.Pending() != 0 {
		time.Sleep(time.Millisecond) // until the proxy has taken the request
	}
	sent := time.Now()
	if r, err := c.do("PING"); err == nil {
		t.Fatalf("the request after one whose reply was lost answered %q", r)
	}
	if took := time.Since(sent); took > faultnet.DefaultReplyWait/2 {
		t.Errorf("the connection was cut %v after the client's next request, want at once (not DefaultReplyWait %v)", took, faultnet.DefaultReplyWait)
	}
	if s := p.Stats(); s.LostReplies != 1 {
		t.Errorf("stats %+v, want 1 lost reply", s)
	}
}
