package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"time"

	"github.com/fencekit/fencekit/internal/childproc"
	"github.com/fencekit/fencekit/internal/rediscount"
)

// Multi-process runs of the locked increments: fence bench -processes N runs
// the workers in N child processes of this binary ("fence bench-child", not
// listed in the usage), each with its own backend connection, so that lock
// handoffs cross process boundaries as they do between pods or worker
// processes.

// sharedBackends are the backends several processes can reach: a server.
var sharedBackends = []string{"postgres", "mysql", "redis"}

// childBackendEnv is the environment variable that hands a child process the
// flags that reach its backend, as a JSON list: connection strings carry
// passwords, and a command line is readable by every user of the machine (ps,
// /proc/PID/cmdline), an environment only by the process's own user.
const childBackendEnv = "FENCE_BENCH_CHILD_BACKEND"

// args returns the command-line flags of a child process: the backend's name
// only, its connection flags go in env.
func (c backendConfig) args() []string {
	return []string{"-backend", c.name}
}

// env returns the environment entry with the flags that reach the same
// backend from a child process.
func (c backendConfig) env() string {
	b, _ := json.Marshal([]string{"-postgres-url", c.postgresURL, "-mysql-dsn", c.mysqlDSN, "-redis-addr", c.redisAddr, "-redis-url", c.redisURL})
	return childBackendEnv + "=" + string(b)
}

// childBackendFlags returns the flags a parent passed in childBackendEnv.
func childBackendFlags() ([]string, error) {
	v := os.Getenv(childBackendEnv)
	if v == "" {
		return nil, nil
	}
	var flags []string
	if err := json.Unmarshal([]byte(v), &flags); err != nil {
		return nil, fmt.Errorf("%s: %w", childBackendEnv, err)
	}
	return flags, nil
}

// processIncrements runs workers x each locked increments of a fresh counter
// in procs child processes (the workers split between them), timed from the
// moment every child is connected and ready. It returns the final count, the
// time, and the commands the children sent (Redis only, else 0).
func processIncrements(ctx context.Context, b *backend, bc backendConfig, name string, procs, workers, each int) (int, time.Duration, int64, error) {
	key := fmt.Sprintf("%s-%d", name, time.Now().UnixNano())
	if err := b.plainPut(ctx, key, []byte("0")); err != nil {
		return 0, 0, 0, err
	}
	exe, err := os.Executable()
	if err != nil {
		return 0, 0, 0, err
	}
	var cmds []*exec.Cmd
	for p := 0; p < procs; p++ {
		w := childproc.Share(workers, procs, p)
		args := append([]string{"bench-child"}, bc.args()...)
		args = append(args, "-key", key, "-workers", strconv.Itoa(w), "-each", strconv.Itoa(each))
		cmd := exec.CommandContext(ctx, exe, args...)
		cmd.Env = append(os.Environ(), bc.env())
		cmds = append(cmds, cmd)
	}
	took, out, err := childproc.Run(cmds, 30*time.Second)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("bench child processes: %w", err)
	}
	v, err := b.plainGet(ctx, key)
	if err != nil {
		return 0, 0, 0, err
	}
	n, err := strconv.Atoi(string(v))
	return n, took, childproc.Sum(out, "sent "), err
}

// runBenchChild is one process of a multi-process run: it opens the backend,
// warms a connection per worker, prints "ready", waits for a line on stdin,
// runs its workers' locked increments, and prints "sent N" (Redis commands
// its client sent, on Redis).
func runBenchChild(args []string, stdout, stderr io.Writer) error {
	fs, bc := commandFlags("bench-child", "bench-child [flags]", "One process of fence bench -processes.", false, stdout, stderr)
	key := fs.String("key", "", "the counter key")
	workers := fs.Int("workers", 1, "workers in this process")
	each := fs.Int("each", 1, "locked increments per worker")
	flags, err := childBackendFlags()
	if err != nil {
		return err
	}
	if err := fs.parse(flags); err != nil {
		return err
	}
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *key == "" || *workers < 1 || *each < 1 {
		return usagef("bench-child needs -key, and -workers and -each of at least 1")
	}
	ctx := context.Background()
	b, err := openBackend(ctx, *bc)
	if err != nil {
		return err
	}
	defer b.close()
	var sent *rediscount.Count
	if b.redis != nil {
		sent = rediscount.Attach(b.redis)
	}
	if _, err := parallel(*workers, 1, func() error { _, err := b.plainGet(ctx, *key); return err }); err != nil {
		return err
	}
	sent.Reset()
	if err := childproc.AwaitStart(stdout); err != nil {
		return err
	}
	if _, err := parallel(*workers, *each, func() error { return lockedIncrement(ctx, b, *key) }); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "sent %d\n", sent.Load())
	return nil
}
