//go:build !unix

package testenv

// favour does nothing here (see prio_unix.go).
func favour(int) {}
