package redislua_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// nodeLock returns the value of name's lock key on c ("" when none).
func nodeLock(ctx context.Context, t *testing.T, c *redis.Client, name string) string {
	t.Helper()
	v, err := c.Get(ctx, "fence:{"+name+"}:lock").Result()
	if errors.Is(err, redis.Nil) {
		return ""
	}
	if err != nil {
		t.Fatalf("reading the lock: %v", err)
	}
	return v
}

// waitLockedEverywhere waits until name is locked on every node by one grant
// (a grant returns once a majority took it; the other lock calls are still
// on their way), and returns that grant's nonce.
func waitLockedEverywhere(ctx context.Context, t *testing.T, servers []*testenv.RedisServer, name string) string {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		nonces := map[string]bool{}
		all := true
		for _, s := range servers {
			c := s.Client(t)
			v := nodeLock(ctx, t, c, name)
			c.Close()
			if v == "" {
				all = false
				break
			}
			nonce, _, _ := strings.Cut(v, ".")
			nonces[nonce] = true
		}
		if all && len(nonces) == 1 {
			for n := range nonces {
				return n
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the grant did not lock every node:%s", redlockLocks(ctx, t, servers, name))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRedlockReleaseDuringLoadingLeavesLock (the README's "no
// node stays locked by a released grant"): the Redlock documentation asks
// for nodes that keep their data across a restart. Such a node answers
// every command with -LOADING while it reads its data back (here: DEBUG
// RELOAD, which saves and loads the dataset as a restart would, made slow by
// key-load-delay). A Release that reaches 3 of 5 nodes while they load gets
// -LOADING from them: the release did not run there, and the nodes come back
// holding the released grant's lock. releaseOn counts any Redis reply as an
// answer and never sends that release again, so the lock stays for the
// ttl: a new Acquire is refused long after every node is up.
func TestRedlockReleaseDuringLoadingLeavesLock(t *testing.T) {
	t.Parallel()
	servers := make([]*testenv.RedisServer, 5)
	clients := make([]redislua.Client, 5)
	for i := range servers {
		servers[i] = testenv.StartRedis(t, "--enable-debug-command", "yes", "--loading-process-events-interval-bytes", "1024")
		clients[i] = servers[i].Client(t)
	}
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("bgreleaseloading")
	const ttl = time.Minute
	l := mustTryAcquire(ctx, t, r, name, ttl)
	waitLockedEverywhere(ctx, t, servers, name)
	loading := []int{0, 1, 2}
	var wg sync.WaitGroup
	reloadErrs := make([]error, len(servers))
	for _, i := range loading {
		admin := servers[i].Client(t)
		// 4000 filler keys read back at 2ms each: about 8s of loading.
		if err := admin.Do(ctx, "DEBUG", "POPULATE", 4000, "loadfiller", 10).Err(); err != nil {
			t.Fatal(err)
		}
		if err := admin.ConfigSet(ctx, "key-load-delay", "2000").Err(); err != nil {
			t.Fatal(err)
		}
		reloader := redis.NewClient(&redis.Options{Addr: servers[i].Addr, MaxRetries: -1, ReadTimeout: -1})
		t.Cleanup(func() { reloader.Close() })
		wg.Add(1)
		go func() {
			defer wg.Done()
			reloadErrs[i] = reloader.Do(ctx, "DEBUG", "RELOAD").Err()
		}()
		// Wait until the node is loading (INFO is answered while loading).
		waitUntil(t, 20*time.Second, 5*time.Millisecond, func() (bool, string) {
			info, err := admin.Info(ctx, "persistence").Result()
			return err == nil && strings.Contains(info, "loading:1"), fmt.Sprintf("node %d never started loading: %v %q", i, err, info)
		})
	}
	err := l.Release(ctx)
	t.Logf("Release while nodes 0-2 load: %v", err)
	wg.Wait()
	for _, i := range loading {
		if reloadErrs[i] != nil {
			t.Fatalf("node %d: DEBUG RELOAD: %v", i, reloadErrs[i])
		}
		admin := servers[i].Client(t)
		if err := admin.ConfigSet(ctx, "key-load-delay", "0").Err(); err != nil {
			t.Fatal(err)
		}
	}
	// Every node is up and answering; the lease was released. A new holder
	// must not wait for the 60s ttl.
	l2, err := acquireAfresh(ctx, t, nodeClients(t, servers), name, ttl)
	if err != nil {
		t.Fatalf("Acquire 20s after a Release (%v) that met 3 loading nodes, all nodes up since: %v\nkeys on the nodes:%s", l.Context().Err(), err, redlockLocks(ctx, t, servers, name))
	}
	_ = l2.Release(ctx)
}

// persistentRedis is a redis-server that keeps its directory across a restart
// (testenv's Restart starts empty and waits for PING, which a loading node
// refuses).
type persistentRedis struct {
	addr string
	args []string
	cmd  *exec.Cmd
}

func startPersistentRedis(t *testing.T, extra ...string) *persistentRedis {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		testenv.Missing(t, "redis-server", err)
	}
	dir := t.TempDir()
	port := testenv.Port(t)
	p := &persistentRedis{addr: "127.0.0.1:" + strconv.Itoa(port)}
	p.args = append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", filepath.Join(dir, "redis.log")}, extra...)
	p.run(t, bin, p.args)
	t.Cleanup(p.kill)
	return p
}

// run starts the process and waits until it accepts connections.
func (p *persistentRedis) run(t *testing.T, bin string, args []string) {
	t.Helper()
	p.cmd = exec.Command(bin, args...)
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", p.addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("redis-server on %s did not start: %v", p.addr, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (p *persistentRedis) kill() {
	if p.cmd != nil && p.cmd.Process != nil {
		_ = p.cmd.Process.Kill()
		_, _ = p.cmd.Process.Wait()
		p.cmd = nil
	}
}

func (p *persistentRedis) client(t *testing.T) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: p.addr, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
	t.Cleanup(func() { c.Close() })
	return c
}

// TestRedlockReleaseLaterStopsAtLoading: as above, through
// releaseLater. 3 of 5 nodes crash (SIGKILL) after saving their data, which
// holds the grant's lock; the lease is released while they are down (no
// answer: the release is sent again in the background). They restart from
// their data: the first answer the background release gets is -LOADING,
// which ends it, although it did not run. Once loaded, the 3 nodes hold the
// released grant's lock for the ttl.
func TestRedlockReleaseLaterStopsAtLoading(t *testing.T) {
	t.Parallel()
	procs := make([]*persistentRedis, 5)
	clients := make([]redislua.Client, 5)
	for i := range procs {
		procs[i] = startPersistentRedis(t, "--enable-debug-command", "yes", "--loading-process-events-interval-bytes", "1024")
		clients[i] = procs[i].client(t)
	}
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("bgreleaserestart")
	const ttl = time.Minute
	l := mustTryAcquire(ctx, t, r, name, ttl)
	lockKey := "fence:{" + name + "}:lock"
	// Every node has the lock (the grant returned at a majority).
	deadline := time.Now().Add(15 * time.Second)
	for i, p := range procs {
		waitUntil(t, time.Until(deadline), 10*time.Millisecond, func() (bool, string) {
			n, err := p.client(t).Exists(ctx, lockKey).Result()
			return err == nil && n == 1, fmt.Sprintf("node %d never got the lock: %v", i, err)
		})
	}
	down := []int{0, 1, 2}
	for _, i := range down {
		admin := procs[i].client(t)
		if err := admin.Do(ctx, "DEBUG", "POPULATE", 4000, "loadfiller", 10).Err(); err != nil {
			t.Fatal(err)
		}
		if err := admin.Save(ctx).Err(); err != nil { // what AOF with fsync keeps
			t.Fatal(err)
		}
		procs[i].kill()
	}
	err := l.Release(ctx)
	t.Logf("Release with nodes 0-2 down: %v", err)
	bin, _ := exec.LookPath("redis-server")
	for _, i := range down {
		procs[i].run(t, bin, append(procs[i].args, "--key-load-delay", "2000")) // about 8s of loading
	}
	for _, i := range down {
		admin := procs[i].client(t)
		waitUntil(t, 60*time.Second, 20*time.Millisecond, func() (bool, string) {
			info, err := admin.Info(ctx, "persistence").Result()
			return err == nil && strings.Contains(info, "loading:0"), fmt.Sprintf("node %d still loading: %v", i, err)
		})
	}
	other := make([]redislua.Client, len(procs))
	for i, p := range procs {
		other[i] = p.client(t)
	}
	l2, err := acquireAfresh(ctx, t, other, name, ttl)
	if err != nil {
		var locked []string
		for i, p := range procs {
			v, _ := p.client(t).Get(ctx, lockKey).Result()
			pttl, _ := p.client(t).PTTL(ctx, lockKey).Result()
			locked = append(locked, "node "+strconv.Itoa(i)+": "+v+" for "+pttl.String())
		}
		t.Fatalf("Acquire 20s after the released grant's nodes came back: %v\n  %s", err, strings.Join(locked, "\n  "))
	}
	_ = l2.Release(ctx)
}

// TestRedlockReleaseDuringBusyScriptLeavesLock: a node running a
// long script (another application's, or a slow one) answers -BUSY to every
// other command once busy-reply-threshold has passed. A Release that meets
// 3 of 5 busy nodes did not run there, and is not sent again: when the
// script ends, those nodes hold the released grant's lock for the ttl.
func TestRedlockReleaseDuringBusyScriptLeavesLock(t *testing.T) {
	t.Parallel()
	servers, clients := fiveNodes(t)
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("bgreleasebusy")
	const ttl = time.Minute
	l := mustTryAcquire(ctx, t, r, name, ttl)
	waitLockedEverywhere(ctx, t, servers, name)
	busy := []int{0, 1, 2}
	var wg sync.WaitGroup
	for _, i := range busy {
		admin := servers[i].Client(t)
		if err := admin.ConfigSet(ctx, "busy-reply-threshold", "100").Err(); err != nil {
			t.Fatal(err)
		}
		spinner := redis.NewClient(&redis.Options{Addr: servers[i].Addr, MaxRetries: -1, ReadTimeout: -1})
		t.Cleanup(func() { spinner.Close() })
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = spinner.Eval(ctx, "while true do end", nil).Err() // ends with SCRIPT KILL
		}()
		waitUntil(t, 20*time.Second, 5*time.Millisecond, func() (bool, string) {
			err := admin.Ping(ctx).Err()
			return err != nil && strings.HasPrefix(err.Error(), "BUSY"), fmt.Sprintf("node %d never busy: %v", i, err)
		})
	}
	err := l.Release(ctx)
	t.Logf("Release while nodes 0-2 run a script: %v", err)
	for _, i := range busy {
		if err := servers[i].Client(t).ScriptKill(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	l2, err := acquireAfresh(ctx, t, nodeClients(t, servers), name, ttl)
	if err != nil {
		t.Fatalf("Acquire 20s after a released grant's busy nodes finished their script: %v\nkeys on the nodes:%s", err, redlockLocks(ctx, t, servers, name))
	}
	_ = l2.Release(ctx)
}

// TestRedlockBackgroundReleaseSparesLaterGrant: a lease renewed and released
// while 2 of 5 nodes are paused leaves its renewal and its release (sent
// again in the background) waiting in those nodes' sockets; the same Redlock
// then grants the name again on the 3 others, and renews it. When the two
// resume and every background call has ended, no node holds the old grant,
// the new one still holds its majority (Renew nil), and once it is released
// the name is free at once.
func TestRedlockBackgroundReleaseSparesLaterGrant(t *testing.T) {
	servers, clients := fiveNodes(t)
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 500 * time.Millisecond})
	ctx := context.Background()
	name := fencetest.Name("bgreleaselater")
	const ttl = 10 * time.Second
	warmUp(ctx, t, r, name, ttl, false)
	base := runtime.NumGoroutine()
	a := mustTryAcquire(ctx, t, r, name, ttl)
	nonceA := waitLockedEverywhere(ctx, t, servers, name)
	pauseNodes(t, servers, 3, 4)
	if err := a.Renew(ctx); err != nil {
		t.Fatalf("renew with 2 of 5 paused: %v", err)
	}
	if err := a.Release(ctx); err != nil {
		t.Fatalf("release with 2 of 5 paused: %v", err)
	}
	b, err := r.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("grant again with 2 of 5 paused: %v", err)
	}
	if b.Token() <= a.Token() {
		t.Errorf("token %d not above %d", b.Token(), a.Token())
	}
	if err := b.Renew(ctx); err != nil {
		t.Fatalf("renew of the new grant: %v", err)
	}
	resumeNodes(t, servers, 3, 4)
	settleGoroutines(t, base, ttl+30*time.Second, "after the nodes resumed")
	held := 0
	for i, s := range servers {
		v := nodeLock(ctx, t, s.Client(t), name)
		nonce, _, _ := strings.Cut(v, ".")
		switch {
		case nonce == nonceA:
			t.Errorf("node %d still locked by the released grant", i)
		case v != "":
			held++
		}
	}
	if held < 3 {
		t.Errorf("the new grant holds %d nodes after the old one's background release:%s", held, redlockLocks(ctx, t, servers, name))
	}
	if err := b.Renew(ctx); err != nil {
		t.Errorf("renew of the new grant after the old one's background release: %v", err)
	}
	if err := b.Release(ctx); err != nil {
		t.Errorf("release of the new grant: %v", err)
	}
	c, err := r.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after both grants were released, all nodes up: %v%s", err, redlockLocks(ctx, t, servers, name))
	}
	_ = c.Release(ctx)
}

// TestRedlockReleaseWithEndedContext: Release with a context that has
// already ended, and one that ends while 3 of 5 nodes are paused, returns at
// once with an error matching fence.ErrUnknown (never ErrLost: the lease was
// held), the release still reaches every node, and a later Renew is ErrLost.
func TestRedlockReleaseWithEndedContext(t *testing.T) {
	t.Parallel()
	servers, clients := fiveNodes(t)
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second})
	ctx := context.Background()
	const ttl = time.Minute
	free := func(name string) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for i := 0; i < len(servers); {
			if nodeLock(ctx, t, servers[i].Client(t), name) == "" {
				i++
				continue
			}
			if time.Now().After(deadline) {
				t.Fatalf("a released lease still locks a node 20s later:%s", redlockLocks(ctx, t, servers, name))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	name := fencetest.Name("bgreleasedone")
	l := mustTryAcquire(ctx, t, r, name, ttl)
	waitLockedEverywhere(ctx, t, servers, name)
	done, cancel := context.WithCancel(ctx)
	cancel()
	err := l.Release(done)
	if !errors.Is(err, fence.ErrUnknown) && err != nil {
		t.Errorf("Release with an ended context: %v, want nil or ErrUnknown", err)
	}
	free(name)
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew after Release: %v, want ErrLost", err)
	}

	name = fencetest.Name("bgreleasemid")
	l = mustTryAcquire(ctx, t, r, name, ttl)
	waitLockedEverywhere(ctx, t, servers, name)
	pauseNodes(t, servers, 2, 3, 4)
	mid, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	start := time.Now()
	err = l.Release(mid)
	took := time.Since(start)
	cancel()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("Release ending with its context, 3 of 5 paused: %v, want ErrUnknown", err)
	}
	if took > 1500*time.Millisecond {
		t.Errorf("Release with a 300ms context returned after %v", took)
	}
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew after Release: %v, want ErrLost", err)
	}
	resumeNodes(t, servers, 2, 3, 4)
	free(name)
}
