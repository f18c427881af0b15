package redislua

import "time"

// AcquirerID exposes an acquirer's id, which its line entries carry, to tests.
func AcquirerID(a *Acquirer) string { return a.id }

// SetLineLife sets how long a's lines outlive the last poll of any waiter
// (an hour by default), so a test can see a line expire.
func SetLineLife(a *Acquirer, d time.Duration) { a.lineLife = d }

// ObserveSpins calls f with a waiter's acquirer and 1 when the waiter starts
// spinning, -1 when it stops (HeadSpin), until the test ends.
func ObserveSpins(t interface{ Cleanup(func()) }, f func(a *Acquirer, delta int)) {
	spinObserver = f
	t.Cleanup(func() { spinObserver = nil })
}
