// Package childproc runs a benchmark's workers in child processes and starts
// them together: each child connects, prints "ready" and waits for a line on
// stdin; the parent starts the clock when all are ready.
package childproc

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"strings"
	"time"
)

// Ready is the line a child prints when it is connected and waits for the start.
const Ready = "ready"

// Run starts cmds, waits (up to readyWithin) until each has printed Ready,
// writes a line to every child's stdin at once, and waits for all to exit. It
// returns the time from that start to the last exit, and the lines each child
// printed after Ready. Children's stderr goes to the parent's. On an error the
// children still running are killed.
func Run(cmds []*exec.Cmd, readyWithin time.Duration) (time.Duration, [][]string, error) {
	return RunAtStart(cmds, readyWithin, nil)
}

// RunAtStart is Run, calling atStart (when not nil) once every child is
// ready, just before the start line; its error stops the run.
func RunAtStart(cmds []*exec.Cmd, readyWithin time.Duration, atStart func() error) (time.Duration, [][]string, error) {
	type child struct {
		cmd   *exec.Cmd
		start io.WriteCloser
		ready chan error
		lines chan []string
		err   error // reading its output, set before lines is sent
	}
	var kids []*child
	defer func() {
		for _, k := range kids {
			_ = k.cmd.Process.Kill()
			_ = k.cmd.Wait()
		}
	}()
	for _, cmd := range cmds {
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			return 0, nil, err
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			return 0, nil, err
		}
		if err := cmd.Start(); err != nil {
			return 0, nil, err
		}
		k := &child{cmd: cmd, start: in, ready: make(chan error, 1), lines: make(chan []string, 1)}
		kids = append(kids, k)
		go func() {
			sc := bufio.NewScanner(out)
			// A line may be long (the sweep prints one number per
			// increment on one line): no bound but memory.
			sc.Buffer(make([]byte, 0, 64*1024), math.MaxInt32)
			ready := false
			var lines []string
			for sc.Scan() {
				switch {
				case !ready && sc.Text() == Ready:
					ready = true
					k.ready <- nil
				case ready:
					lines = append(lines, sc.Text())
				}
			}
			if err := sc.Err(); err != nil {
				// Read on, so that the child is not blocked on its stdout,
				// and fail the run: its lines are not whole.
				_, _ = io.Copy(io.Discard, out)
				k.err = fmt.Errorf("reading a child's output: %w", err)
			}
			if !ready {
				k.ready <- errors.New("a child process ended before it was ready")
			}
			k.lines <- lines
		}()
	}
	timeout := time.After(readyWithin)
	for _, k := range kids {
		select {
		case err := <-k.ready:
			if err != nil {
				return 0, nil, err
			}
		case <-timeout:
			return 0, nil, fmt.Errorf("a child process was not ready within %v", readyWithin)
		}
	}
	if atStart != nil {
		if err := atStart(); err != nil {
			return 0, nil, err
		}
	}
	start := time.Now()
	for _, k := range kids {
		fmt.Fprintln(k.start, "go")
		k.start.Close()
	}
	out := make([][]string, len(kids))
	for i, k := range kids {
		out[i] = <-k.lines
		if err := k.cmd.Wait(); err != nil {
			return 0, nil, fmt.Errorf("child process: %w", err)
		}
		if k.err != nil {
			return 0, nil, k.err
		}
	}
	took := time.Since(start)
	kids = nil
	return took, out, nil
}

// AwaitStart is the child's side: print Ready, then wait for the start line.
func AwaitStart(stdout io.Writer) error {
	fmt.Fprintln(stdout, Ready)
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return fmt.Errorf("waiting for the start: %w", err)
	}
	return nil
}

// Sum adds up the numbers that follow prefix in the children's lines.
func Sum(out [][]string, prefix string) int64 {
	var n int64
	for _, lines := range out {
		for _, l := range lines {
			if v, ok := strings.CutPrefix(l, prefix); ok {
				var x int64
				if _, err := fmt.Sscan(v, &x); err == nil {
					n += x
				}
			}
		}
	}
	return n
}

// Share is child i's share when total workers are split between n children
// as evenly as they go (the first total%n get one more).
func Share(total, n, i int) int {
	if i < total%n {
		return total/n + 1
	}
	return total / n
}
