//go:build !unix

package testenv

import "os"

// lockPort opens path without a lock where flock is not available: Port then
// only checks that the port is free now.
func lockPort(path string) (*os.File, bool) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o666)
	return f, err == nil
}
