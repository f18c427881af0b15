package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/internal/sweep"
)

// fence bench -backend redis -sweep runs the contention curve
// (internal/sweep) with fencekit's contenders; its workers run in child
// processes of this binary ("fence sweep-child", not listed in the usage).
// The peers (bsm/redislock, go-redsync) are in the bench module, which runs
// the same sweep with them: cd bench && go run ./sweep.

// sweepContenders are the fencekit configurations the CLI's sweep compares.
var sweepContenders = sweep.Contenders{
	"fencekit":         sweep.Fencekit(nil),
	"fencekit-spin1ms": sweep.Fencekit(&redislua.AcquirerOptions{HeadSpin: time.Millisecond}),
}

var sweepNames = []string{"fencekit", "fencekit-spin1ms"}

func runSweep(bc backendConfig, points string, rounds, increments int, stdout, stderr io.Writer) error {
	if bc.name != "redis" {
		return usagef("-sweep runs on -backend redis only")
	}
	pts, err := sweep.ParsePoints(points)
	if err != nil {
		return usagef("-points: %v", err)
	}
	if rounds < 1 || increments < 1 {
		return usagef("-rounds and -increments must be at least 1")
	}
	ctx := context.Background()
	c, _, err := connectRedis(ctx, bc)
	if err != nil {
		return err
	}
	defer c.Close()
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	err = sweep.Main(ctx, stdout, stderr, sweep.Config{
		Client: c, Names: sweepNames, Points: pts, Rounds: rounds, Increments: increments,
		Command: func(env string) *exec.Cmd {
			cmd := exec.CommandContext(ctx, exe, append([]string{"sweep-child"}, bc.args()...)...)
			cmd.Env = append(os.Environ(), bc.env(), env)
			return cmd
		},
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "the peers (bsm/redislock, go-redsync) alternated with fencekit in one run: cd bench && go run ./sweep -points %s -rounds %d -increments %d\n",
		strings.Join(strings.Fields(points), ""), rounds, increments)
	return nil
}

// runSweepChild is one process of a sweep run (see sweep.RunChild).
func runSweepChild(args []string, stdout, stderr io.Writer) error {
	fs, bc := commandFlags("sweep-child", "sweep-child [flags]", "One process of fence bench -sweep.", false, stdout, stderr)
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
	ctx := context.Background()
	c, _, err := connectRedis(ctx, *bc)
	if err != nil {
		return err
	}
	defer c.Close()
	return sweep.RunChild(ctx, c, sweepContenders, stdout)
}
