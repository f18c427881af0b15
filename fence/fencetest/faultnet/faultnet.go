// Package faultnet is a TCP fault proxy for tests: put a Proxy between any
// client and its real server (PostgreSQL, MySQL, Redis, etcd, an S3 endpoint)
// and make the network misbehave the way real networks do — a partition that
// holds bytes both ways and delivers them on heal, latency with jitter, a
// connection cut now, after some bytes, or at random, and a request that
// reaches the server while its reply is lost.
//
// It imports only the standard library, so a third-party backend's tests can
// use it with the fencetest suites. The proxy knows nothing of protocols: a
// match function sees the bytes of one read from the client (on loopback, one
// read is nearly always one request), so tests pick their target by content,
// for example bytes.Contains(b, []byte("UPDATE")).
package faultnet

import (
	"bytes"
	"encoding/hex"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy forwards TCP connections from Addr to a target address, injecting the
// faults it is told to. Its methods are safe for concurrent use. The zero value
// is not usable: call Start or Listen.
type Proxy struct {
	ln     net.Listener
	target string

	mu        sync.Mutex
	cond      *sync.Cond
	held      bool // partitioned: bytes wait both ways
	refuse    bool // new connections are closed at once
	latMin    time.Duration
	latMax    time.Duration
	cutRate   float64
	cutAfter  int64         // >0: the next client bytes past this many cut the connection
	window    time.Duration // >0: a lost reply's connection is cut this long after its request
	loseReply []func([]byte) bool
	dropReq   []func([]byte) bool
	conns     map[*pair]struct{}
	closed    bool

	accepted   atomic.Int64
	cuts       atomic.Int64
	lostReplys atomic.Int64
	wg         sync.WaitGroup
}

type pair struct {
	client, server net.Conn
	once           sync.Once
	discard        atomic.Bool // everything the server sends is thrown away (ReplyWindow)
}

func (p *pair) close() {
	p.once.Do(func() {
		p.client.Close()
		p.server.Close()
	})
}

// Start starts a proxy to target on a loopback port and stops it when t ends.
func Start(t testing.TB, target string) *Proxy {
	t.Helper()
	p, err := Listen(target)
	if err != nil {
		t.Fatalf("faultnet: %v", err)
	}
	t.Cleanup(p.Close)
	return p
}

// Listen starts a proxy to target on a loopback port. Close stops it.
func Listen(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: map[*pair]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's address, host:port, for the client to dial.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Port is the port of Addr.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Close stops accepting, closes every connection and waits for the proxy's
// goroutines.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	p.held = false
	p.cond.Broadcast()
	p.mu.Unlock()
	p.ln.Close()
	p.CutAll()
	p.wg.Wait()
}

// Partition holds every byte in both directions, on every connection, old and
// new, until Heal. Nothing is lost: Heal delivers what was held, in order.
func (p *Proxy) Partition() {
	p.mu.Lock()
	p.held = true
	p.mu.Unlock()
}

// Heal ends a partition and delivers the bytes it held.
func (p *Proxy) Heal() {
	p.mu.Lock()
	p.held = false
	p.cond.Broadcast()
	p.mu.Unlock()
}

// Refuse makes the proxy close every new connection at once (on) or accept
// them again (off); connections already open are not touched.
func (p *Proxy) Refuse(on bool) {
	p.mu.Lock()
	p.refuse = on
	p.mu.Unlock()
}

// Latency delays every chunk, each direction, by a random duration in
// [min, max] (order is kept). Latency(0, 0) turns it off.
func (p *Proxy) Latency(min, max time.Duration) {
	if max < min {
		max = min
	}
	p.mu.Lock()
	p.latMin, p.latMax = min, max
	p.mu.Unlock()
}

// CutRate cuts a connection with probability rate at each chunk the client
// sends: half of the cuts drop the request unsent, half forward it and lose
// the reply (the server acts, the client sees its connection reset).
// CutRate(0) turns it off.
func (p *Proxy) CutRate(rate float64) {
	p.mu.Lock()
	p.cutRate = rate
	p.mu.Unlock()
}

// CutAll closes every open connection now.
func (p *Proxy) CutAll() {
	p.mu.Lock()
	conns := make([]*pair, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		c.close()
		p.cuts.Add(1)
	}
}

// CutAfter cuts the connection that carries the client's next n bytes, in the
// middle of the chunk that crosses n: the server receives the first n bytes
// of it only. One-shot.
func (p *Proxy) CutAfter(n int64) {
	if n < 1 {
		n = 1
	}
	p.mu.Lock()
	p.cutAfter = n
	p.mu.Unlock()
}

// LoseReply arms a one-shot fault: the next client chunk for which match
// returns true (any chunk when match is nil) is forwarded to the server, the
// server's reply is read and thrown away, and the connection is then closed.
// The server has acted; the client sees an error. Several calls queue several
// faults, each taken by the next matching chunk. Which bytes are the reply,
// and how long to wait for them, is set by ReplyWindow; nothing more from the
// client is forwarded on that connection meanwhile.
// CutRate's lost replies follow the same rules.
func (p *Proxy) LoseReply(match func(request []byte) bool) {
	if match == nil {
		match = func([]byte) bool { return true }
	}
	p.mu.Lock()
	p.loseReply = append(p.loseReply, match)
	p.mu.Unlock()
}

// DefaultReplyWait is how long, with no ReplyWindow, a lost reply's
// connection waits for the server's first bytes before it is cut anyway.
const DefaultReplyWait = 5 * time.Second

// ReplyWindow sets how a lost reply is recognised. With d = 0 (the default)
// the reply is the server's first bytes after the request: right for a
// request-reply protocol (PostgreSQL, MySQL, Redis, HTTP/1), where the
// server answers each request before anything else; the connection is cut as
// they arrive, or as soon as the client sends more (it was not waiting for a
// reply: the request gets none), or DefaultReplyWait after the request if
// neither happens. With d > 0 the connection is cut d after the request was
// forwarded, whatever the server sent meanwhile (thrown away): right for a
// multiplexed protocol (HTTP/2, gRPC: etcd), where the server's first bytes
// may be flow control or another call's reply, and a chunk may be a control
// frame that gets no reply at all. Choose d longer than the server takes to
// act on the request, and shorter than the client's own timeouts (the
// client's other calls on that connection wait for the cut).
func (p *Proxy) ReplyWindow(d time.Duration) {
	if d < 0 {
		d = 0
	}
	p.mu.Lock()
	p.window = d
	p.mu.Unlock()
}

// DropRequest arms a one-shot fault: the next client chunk for which match
// returns true is not forwarded, and the connection is closed. The server
// never saw the request.
func (p *Proxy) DropRequest(match func(request []byte) bool) {
	if match == nil {
		match = func([]byte) bool { return true }
	}
	p.mu.Lock()
	p.dropReq = append(p.dropReq, match)
	p.mu.Unlock()
}

// Pending reports how many LoseReply and DropRequest faults are still armed.
func (p *Proxy) Pending() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.loseReply) + len(p.dropReq)
}

// Stats counts what the proxy did: connections accepted, connections cut (by
// any fault), and replies lost after their request was forwarded.
type Stats struct {
	Accepted, Cuts, LostReplies int64
}

// Stats returns the counts so far.
func (p *Proxy) Stats() Stats {
	return Stats{Accepted: p.accepted.Load(), Cuts: p.cuts.Load(), LostReplies: p.lostReplys.Load()}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse, closed := p.refuse, p.closed
		p.mu.Unlock()
		if refuse || closed {
			c.Close()
			continue
		}
		s, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			c.Close()
			continue
		}
		p.accepted.Add(1)
		pr := &pair{client: c, server: s}
		p.mu.Lock()
		p.conns[pr] = struct{}{}
		p.mu.Unlock()
		lost := make(chan struct{}, 1) // set when the next reply must be thrown away
		p.wg.Add(2)
		go p.upstream(pr, lost)
		go p.downstream(pr, lost)
	}
}

// wait blocks while partitioned, then sleeps the chunk's latency. It reports
// false when the proxy closed.
func (p *Proxy) wait() bool {
	p.mu.Lock()
	for p.held && !p.closed {
		p.cond.Wait()
	}
	closed := p.closed
	min, max := p.latMin, p.latMax
	p.mu.Unlock()
	if closed {
		return false
	}
	if max > 0 {
		d := min
		if max > min {
			d += time.Duration(rand.Int64N(int64(max - min + 1)))
		}
		time.Sleep(d)
	}
	return true
}

func (p *Proxy) forget(pr *pair) {
	pr.close()
	p.mu.Lock()
	delete(p.conns, pr)
	p.mu.Unlock()
}

// take pops the first armed fault in list that matches b.
func take(list *[]func([]byte) bool, b []byte) bool {
	for i, m := range *list {
		if m(b) {
			*list = append((*list)[:i:i], (*list)[i+1:]...)
			return true
		}
	}
	return false
}

func (p *Proxy) upstream(pr *pair, lost chan struct{}) {
	defer p.wg.Done()
	keep := false
	defer func() {
		if !keep {
			p.forget(pr)
		}
	}()
	buf := make([]byte, 64<<10)
	for {
		n, err := pr.client.Read(buf)
		if n > 0 {
			b := buf[:n]
			if !p.wait() {
				return
			}
			p.mu.Lock()
			drop := take(&p.dropReq, b)
			lose := !drop && take(&p.loseReply, b)
			if !drop && !lose && p.cutRate > 0 && rand.Float64() < p.cutRate {
				if rand.IntN(2) == 0 {
					drop = true
				} else {
					lose = true
				}
			}
			window := p.window
			cut := int64(-1)
			if !drop && !lose && p.cutAfter > 0 {
				if int64(n) >= p.cutAfter {
					cut = p.cutAfter
					p.cutAfter = 0
				} else {
					p.cutAfter -= int64(n)
				}
			}
			p.mu.Unlock()
			switch {
			case drop:
				p.cuts.Add(1)
				return
			case cut >= 0:
				pr.server.Write(b[:cut])
				p.cuts.Add(1)
				return
			case lose && window > 0:
				// Throw away whatever the server sends from now on, and cut
				// once the window has passed.
				pr.discard.Store(true)
				if _, err := pr.server.Write(b); err != nil {
					return
				}
				keep = true
				time.AfterFunc(window, func() {
					p.lostReplys.Add(1)
					p.cuts.Add(1)
					p.forget(pr)
				})
				return
			case lose:
				lost <- struct{}{}
				if _, err := pr.server.Write(b); err != nil {
					return
				}
				// downstream cuts the pair once the reply arrived (or the
				// server closed); forward nothing more from the client, and
				// cut anyway if the server never answers. A client that
				// sends more meanwhile was not waiting for a reply (a
				// message that gets none, such as MySQL's COM_STMT_CLOSE):
				// cut then.
				t := time.AfterFunc(DefaultReplyWait, func() { p.forget(pr) })
				var one [1]byte
				if n, _ := pr.client.Read(one[:]); n > 0 {
					t.Stop()
					select {
					case <-lost: // downstream has not taken it: no reply came
						p.lostReplys.Add(1)
						p.cuts.Add(1)
					default:
					}
					p.forget(pr)
				}
				keep = true
				return
			}
			if _, err := pr.server.Write(b); err != nil {
				return
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				if tc, ok := pr.server.(*net.TCPConn); ok {
					tc.CloseWrite()
				}
			}
			return
		}
	}
}

func (p *Proxy) downstream(pr *pair, lost <-chan struct{}) {
	defer p.wg.Done()
	defer p.forget(pr)
	buf := make([]byte, 64<<10)
	for {
		n, err := pr.server.Read(buf)
		if n > 0 && pr.discard.Load() {
			continue // within a lost reply's window
		}
		if n > 0 {
			select {
			case <-lost:
				// The reply to a request whose reply must be lost: the server
				// has answered, so it has acted. Throw it away and cut.
				p.lostReplys.Add(1)
				p.cuts.Add(1)
				return
			default:
			}
			if !p.wait() {
				return
			}
			if _, err := pr.client.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			select {
			case <-lost:
				p.lostReplys.Add(1)
				p.cuts.Add(1)
			default:
			}
			return
		}
	}
}

// Carries reports whether request carries s: its bytes as they are, or
// written in hexadecimal (lower case), as a SQL hex literal carries a value
// (sqlfence's MySQL statements send their text arguments as X'…').
func Carries(request []byte, s string) bool {
	return bytes.Contains(request, []byte(s)) || bytes.Contains(request, []byte(hex.EncodeToString([]byte(s))))
}
