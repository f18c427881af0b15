package azfence_test

import (
	"flag"
	"os"
	"testing"
)

// TestMain lets the acquirer suite's cases run side by side (-parallel 32
// unless given): Azure's shortest lease is 15 s, and the expiry cases wait
// for it; one at a time (go test's default, GOMAXPROCS) they take minutes.
func TestMain(m *testing.M) {
	flag.Parse()
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if !set {
		_ = flag.Set("test.parallel", "32")
	}
	os.Exit(m.Run())
}
