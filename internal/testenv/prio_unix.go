//go:build unix

package testenv

import "syscall"

// favour raises the scheduling priority of a server process the tests
// started (nice -10), as a server on a machine of its own would run: on a
// loaded 2-CPU machine a single-threaded server (Azurite, in node) starved
// by the test processes answers in seconds, and the suites then measure
// the starvation, not the backend. It needs CAP_SYS_NICE (root); without
// it the server runs at the default priority.
func favour(pid int) {
	_ = syscall.Setpriority(syscall.PRIO_PROCESS, pid, -10)
}
