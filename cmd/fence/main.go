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
	"log"
	"os"
	"strings"
	"sync"

	"github.com/go-sql-driver/mysql"
)

const usage = `fence replays why a lease lock alone is not enough, and measures the fix.

Usage:
  fence demo  [flags]   replay the lesson's scenarios and check every outcome
  fence bench [flags]   measure fenced writes and locked increments
  fence inspect [flags] NAME        show a lock's holder, time left and counter
  fence bump [flags] NAME -to N     raise a lock's token counter (never lowers it)
  fence help [command]  print this help, or a command's

Run "fence <command> -h" for a command's flags. inspect and bump act only on
the backend their flags name (a database file, URL, endpoint or bucket) and
refuse to run without one. Passwords in connection strings and credential
variables are shown as xxxxx in every message.
Exit status: 0 on success (for demo: every outcome as expected), 1 when an
outcome is not the expected one or the backend fails or refuses, 2 for bad usage.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

var (
	// errUsage marks a command-line mistake (exit status 2): errors.Is
	// matches every error usagef returns.
	errUsage = errors.New("usage")
	// errReported marks a command-line mistake the flag package already printed.
	errReported = errors.New("usage error reported")
)

// usageError is a command-line mistake: its message is printed after the
// command's prefix, and the exit status is 2.
type usageError struct{ msg string }

func (e *usageError) Error() string        { return e.msg }
func (e *usageError) Is(target error) bool { return target == errUsage }

// usagef returns a usageError with a message formatted as by fmt.Sprintf.
func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// message is err's text for the command's "fence CMD: " prefix: without the
// fence package's own "fence: " (its errors say "fence: lease held by another
// holder"), which would repeat it.
func message(err error) string {
	return strings.TrimPrefix(err.Error(), "fence: ")
}

// run runs the command line args, writing through a redactor that blanks the
// passwords args and the credential variables carry, and returns the exit
// status.
func run(args []string, stdout, stderr io.Writer) int {
	red := newRedactor(args)
	stdout, stderr = red.writer(stdout), red.writer(stderr)
	// go-sql-driver/mysql logs to the standard logger's stderr on its own:
	// its lines go to this run's stderr instead, through the redactor.
	mysqlLog.Lock()
	mysqlLog.w = stderr
	mysqlLog.Unlock()
	setMySQLLogger.Do(func() { mysql.SetLogger(log.New(mysqlLogWriter{}, "[mysql] ", log.LstdFlags)) })
	return runCommand(args, stdout, stderr)
}

// mysqlLog is the stderr of the latest run, where go-sql-driver/mysql's log
// lines go. The driver's logger is one per process, set once, so runs at the
// same time (the tests') do not race on it.
var (
	mysqlLog struct {
		sync.Mutex
		w io.Writer
	}
	setMySQLLogger sync.Once
)

type mysqlLogWriter struct{}

func (mysqlLogWriter) Write(p []byte) (int, error) {
	mysqlLog.Lock()
	w := mysqlLog.w
	mysqlLog.Unlock()
	return w.Write(p)
}

func runCommand(args []string, stdout, stderr io.Writer) int {
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
	case "sweep-child": // one process of fence bench -sweep
		err = runSweepChild(args[1:], stdout, stderr)
	case "inspect":
		err = runInspect(args[1:], stdout, stderr)
	case "bump":
		err = runBump(args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		if len(args) > 2 && args[0] == "help" {
			fmt.Fprintf(stderr, "fence help: unexpected arguments %q\n\n%s", args[2:], usage)
			return 2
		}
		if len(args) > 1 && args[0] == "help" {
			return runCommand([]string{args[1], "-h"}, stdout, stderr)
		}
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
		fmt.Fprintf(stderr, "fence %s: %s\nRun \"fence %s -h\" for usage.\n", args[0], message(err), args[0])
		return 2
	default:
		fmt.Fprintf(stderr, "fence %s: %s\n", args[0], message(err))
		return 1
	}
}

// flagSet is a subcommand's flags: its help (-h) goes to stdout, a mistake
// and the usage after it to stderr.
type flagSet struct {
	*flag.FlagSet
	synopsis, about string
	stdout, stderr  io.Writer
}

// commandFlags returns a subcommand's flag set, with the backend flags
// registered (for an operator's command, with no defaults) and a usage text
// of synopsis and about.
func commandFlags(name, synopsis, about string, operator bool, stdout, stderr io.Writer) (*flagSet, *backendConfig) {
	fs := &flagSet{FlagSet: flag.NewFlagSet("fence "+name, flag.ContinueOnError), synopsis: synopsis, about: about, stdout: stdout, stderr: stderr}
	fs.SetOutput(io.Discard) // parse prints the error and the usage itself
	fs.Usage = func() {}
	bc := &backendConfig{}
	bc.register(fs.FlagSet, operator)
	return fs, bc
}

func (fs *flagSet) printUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage: fence %s\n\n%s\n\nFlags:\n", fs.synopsis, fs.about)
	fs.SetOutput(w)
	fs.PrintDefaults()
	fs.SetOutput(io.Discard)
}

// parse parses args once: -h prints the usage to stdout and returns
// flag.ErrHelp; a bad flag prints the mistake and the usage to stderr and
// returns errReported.
func (fs *flagSet) parse(args []string) error {
	err := fs.Parse(args)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, flag.ErrHelp):
		fs.printUsage(fs.stdout)
		return err
	default:
		fmt.Fprintf(fs.stderr, "%s: %v\n", fs.Name(), err)
		fs.printUsage(fs.stderr)
		return fmt.Errorf("%w: %v", errReported, err)
	}
}

// parseFlags parses a subcommand's flags; a bad flag is a usage error.
func parseFlags(fs *flagSet, args []string) error {
	if err := fs.parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("unexpected arguments %q", fs.Args())
	}
	return nil
}
