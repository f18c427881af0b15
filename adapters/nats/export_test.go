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

// SetWatchErrHook makes each watch request of a waiting Acquire first call
// f with the lock key and fail with the error it returns (nil f, or a nil
// error: the request is made).
func SetWatchErrHook(f func(key string) error) {
	if f == nil {
		watchErrHook.Store(nil)
		return
	}
	watchErrHook.Store(&f)
}

// SetCreateHook makes f be called with the lock key just before each grant's
// create is sent (nil: no call).
func SetCreateHook(f func(key string)) {
	if f == nil {
		createHook.Store(nil)
		return
	}
	createHook.Store(&f)
}
