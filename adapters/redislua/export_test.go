package redislua

// AcquirerID exposes an acquirer's id, which its line entries carry, to tests.
func AcquirerID(a *Acquirer) string { return a.id }
