package childproc_test

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/internal/childproc"
)

const childEnv = "CHILDPROC_TEST_LINE"

func TestMain(m *testing.M) {
	if n := os.Getenv(childEnv); n != "" {
		if err := childproc.AwaitStart(os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		var size int
		fmt.Sscan(n, &size)
		fmt.Printf("sent 7\nwaits%s\n", strings.Repeat(" 1234", size))
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestLongLine: a child's line of any length comes back whole (the sweep's
// "waits" line has one number per increment: 16000 increments in one
// process made it longer than 64KB and the sweep failed with "children
// reported 0 waits"; past 128KB the child blocked on its stdout and the run
// never ended).
func TestLongLine(t *testing.T) {
	for _, n := range []int{10, 20_000, 100_000} {
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", childEnv, n))
		type result struct {
			out [][]string
			err error
		}
		done := make(chan result, 1)
		go func() {
			_, out, err := childproc.Run([]*exec.Cmd{cmd}, 30*time.Second)
			done <- result{out, err}
		}()
		var r result
		select {
		case r = <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			t.Fatalf("a line of %d numbers: the run did not end", n)
		}
		if r.err != nil {
			t.Fatalf("a line of %d numbers: %v", n, r.err)
		}
		if len(r.out) != 1 || len(r.out[0]) != 2 || r.out[0][0] != "sent 7" {
			t.Fatalf("a line of %d numbers: got %d children's lines, want the two lines", n, len(r.out))
		}
		if got := len(strings.Fields(r.out[0][1])) - 1; got != n {
			t.Errorf("a line of %d numbers came back with %d", n, got)
		}
	}
}
