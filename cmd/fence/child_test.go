package main

import (
	"os"
	"testing"

	"github.com/fencekit/fencekit/internal/sweep"
)

// TestMain runs this test binary as the fence command when fence bench
// -sweep starts it as one of its child processes (os.Executable is the test
// binary under go test), and as the test binary otherwise.
func TestMain(m *testing.M) {
	if sweep.IsChild() {
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}
