// Command fence replays the lesson behind fencekit and measures it.
//
//	fence demo   replay the classic lock failures and their fixes (SQLite, no server)
//	fence bench  measure fenced writes and locked increments
//	fence inspect NAME, fence bump NAME -to N  look at and repair a lock's counter
//
// Run "fence <command> -h" for a command's flags.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
)

const usage = `fence replays why a lease lock alone is not enough, and measures the fix.

Usage:
  fence demo  [flags]   replay the lesson's scenarios and check every outcome
  fence bench [flags]   measure fenced writes and locked increments
  fence inspect [flags] NAME        show a lock's holder, time left and counter
  fence bump [flags] NAME -to N     raise a lock's token counter (never lowers it)
  fence help            print this help

Run "fence <command> -h" for a command's flags.
Exit status: 0 on success (for demo: every outcome as expected), 1 when an
outcome is not the expected one or the backend fails or refuses, 2 for bad usage.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

var (
	// errUsage marks a command-line mistake (exit status 2).
	errUsage = errors.New("usage")
	// errReported marks a command-line mistake the flag package already printed.
	errReported = errors.New("usage error reported")
)

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	var err error
	switch args[0] {
	case "demo":
		err = runDemo(args[1:], stdout, stderr)
	case "bench":
		err = runBench(args[1:], stdout, stderr)
	case "bench-child": // one process of fence bench -processes
		err = runBenchChild(args[1:], stdout, stderr)
	case "inspect":
		err = runInspect(args[1:], stdout, stderr)
	case "bump":
		err = runBump(args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "fence: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errReported):
		return 2
	case errors.Is(err, errUsage):
		fmt.Fprintf(stderr, "fence %s: %v\nRun \"fence %s -h\" for usage.\n", args[0], err, args[0])
		return 2
	default:
		fmt.Fprintf(stderr, "fence %s: %v\n", args[0], err)
		return 1
	}
}

// commandFlags returns a subcommand's flag set, with the backend flags
// registered and a usage text of synopsis and about.
func commandFlags(name, synopsis, about string, stderr io.Writer) (*flag.FlagSet, *backendConfig) {
	fs := flag.NewFlagSet("fence "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	bc := &backendConfig{}
	bc.register(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: fence %s\n\n%s\n\nFlags:\n", synopsis, about)
		fs.PrintDefaults()
	}
	return fs, bc
}

// parseFlags parses a subcommand's flags; a bad flag is a usage error.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errReported, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected arguments %q", errUsage, fs.Args())
	}
	return nil
}
