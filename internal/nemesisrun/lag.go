package nemesisrun

import "time"

// Lag is a moment when the test process ran late: a timer due at At-Late
// fired at At (both since the run's start).
type Lag struct{ At, Late time.Duration }

// Lags are a run's lags, for the stall checks. They are not safe for
// concurrent use: the history's lock guards them.
type Lags []Lag

// In is the largest lag recorded from from to to. A stall check reports it
// beside a stall, so that a failure on a loaded machine says how late the
// process ran. The bounds are not stretched by it: stretched by the largest
// lag around them, they hid real stalls on a loaded machine.
func (l Lags) In(from, to time.Duration) time.Duration {
	var most time.Duration
	for _, x := range l {
		if x.At >= from && x.At-x.Late <= to {
			most = max(most, x.Late)
		}
	}
	return most
}

// MeterLag starts calling record with the lateness of each 5ms timer that
// fires more than a millisecond late, until the returned stop is called;
// stop returns once the meter has stopped.
func MeterLag(record func(late time.Duration)) (stop func()) {
	const tick = 5 * time.Millisecond
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTimer(tick)
		defer t.Stop()
		for {
			due := time.Now().Add(tick)
			t.Reset(tick)
			select {
			case <-quit:
				return
			case <-t.C:
			}
			if late := time.Since(due); late > time.Millisecond {
				record(late)
			}
		}
	}()
	return func() {
		close(quit)
		<-done
	}
}
