package natsfence

// SetWaitingHook makes f be called with the lock key each time a waiting
// Acquire's try found the name held and it begins to wait (nil: no call).
func SetWaitingHook(f func(key string)) {
	if f == nil {
		waitingHook.Store(nil)
		return
	}
	waitingHook.Store(&f)
}
