package nemesisrun

import (
	"bufio"
	"net"
	"sync"
	"testing"
)

// ServeLines serves a line protocol on a loopback port until t ends and
// returns its address: each request line (up to 1 MiB, without its line
// end) is answered with answer's reply and a line end, in order, on its
// connection. The test backends behind the nemesis's fault proxies use it:
// a proxy can lose, hold or delay each reply.
func ServeLines(t *testing.T, answer func(req []byte) []byte) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				sc := bufio.NewScanner(c)
				sc.Buffer(make([]byte, 64<<10), 1<<20)
				for sc.Scan() {
					if _, err := c.Write(append(answer(sc.Bytes()), '\n')); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}
