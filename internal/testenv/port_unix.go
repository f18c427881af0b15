//go:build unix

package testenv

import (
	"os"
	"syscall"
)

// lockPort takes an exclusive, non-blocking flock on path; the kernel drops it
// when the process exits, so a crashed test leaves no stale reservation.
func lockPort(path string) (*os.File, bool) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		return nil, false
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, false
	}
	return f, true
}
