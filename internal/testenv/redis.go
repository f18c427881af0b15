package testenv

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisClient returns a client of the test Redis server, closed at the end of
// the test; a missing server skips the test (fails it under CI).
func RedisClient(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: RedisAddr()})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		c.Close()
		Missing(t, "Redis at "+RedisAddr(), err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// RedisServer is an extra redis-server process started by a test.
type RedisServer struct {
	Addr string
	Port int
	cmd  *exec.Cmd
	dir  string
	args []string
}

// StartRedis starts a redis-server on a free loopback port with no persistence,
// plus extra arguments (such as "--replicaof", "127.0.0.1", "6380"). It is
// stopped at the end of the test. Without a redis-server binary the test skips
// (fails under CI).
func StartRedis(t testing.TB, extra ...string) *RedisServer {
	t.Helper()
	return startRedisIn(t, t.TempDir(), extra...)
}

// startRedisIn starts redis-server with its log in dir. Arguments that do not
// start with "--" go first (a config file), the others after the defaults.
func startRedisIn(t testing.TB, dir string, extra ...string) *RedisServer {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		Missing(t, "redis-server (for extra Redis instances)", err)
	}
	port := Port(t)
	s := &RedisServer{Addr: "127.0.0.1:" + strconv.Itoa(port), Port: port, dir: dir}
	var first []string
	for len(extra) > 0 && !strings.HasPrefix(extra[0], "--") {
		first, extra = append(first, extra[0]), extra[1:]
	}
	s.args = append(first, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", s.dir, "--logfile", filepath.Join(s.dir, "redis.log"))
	s.args = append(s.args, extra...)
	s.start(t, bin)
	t.Cleanup(s.Kill)
	return s
}

func (s *RedisServer) start(t testing.TB, bin string) {
	t.Helper()
	if err := s.run(bin); err != nil {
		t.Fatal(err)
	}
}

// run starts the server and waits until it answers.
func (s *RedisServer) run(bin string) error {
	s.cmd = exec.Command(bin, s.args...)
	if err := s.cmd.Start(); err != nil {
		return fmt.Errorf("starting redis-server: %v", err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			s.Kill()
			return fmt.Errorf("redis-server on %s did not start: %v\n%s", s.Addr, err, s.Log())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Client returns a new client of this server, closed at the end of the test.
func (s *RedisServer) Client(t testing.TB) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
	t.Cleanup(func() { c.Close() })
	return c
}

// Kill stops the server at once (SIGKILL), as a crash would.
func (s *RedisServer) Kill() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Kill()
		_, _ = s.cmd.Process.Wait()
		s.cmd = nil
	}
}

// Stop pauses the server process (SIGSTOP); Continue resumes it.
func (s *RedisServer) Stop() error { return s.signal("STOP") }

// Continue resumes a stopped server (SIGCONT).
func (s *RedisServer) Continue() error { return s.signal("CONT") }

func (s *RedisServer) signal(sig string) error {
	if s.cmd == nil {
		return fmt.Errorf("redis-server on %s is not running", s.Addr)
	}
	return exec.Command("kill", "-"+sig, strconv.Itoa(s.cmd.Process.Pid)).Run()
}

// Restart starts the server again on the same port, empty (no persistence).
func (s *RedisServer) Restart(t testing.TB) {
	t.Helper()
	s.Kill()
	bin, _ := exec.LookPath("redis-server")
	s.start(t, bin)
}

// Relaunch is Restart for a goroutine other than the test's: it returns
// an error instead of failing the test.
func (s *RedisServer) Relaunch() error {
	s.Kill()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return err
	}
	return s.run(bin)
}

// Log returns the server's log file.
func (s *RedisServer) Log() string {
	f, err := os.Open(filepath.Join(s.dir, "redis.log"))
	if err != nil {
		return ""
	}
	defer f.Close()
	var out string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		out += sc.Text() + "\n"
	}
	return out
}
