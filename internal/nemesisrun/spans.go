package nemesisrun

import "time"

// Span is a stretch of a run during which requests were held back: a
// client's partition (held on the way, delivered on heal), or, for client
// -1, the backend's window of replies that say a step did not run.
type Span struct {
	Client   int
	From, To time.Duration // since the run's start; To is -1 while it lasts
}

// Forever is the bound that a span still open leaves: none.
const Forever = time.Duration(1<<62 - 1)

// Spans are a run's spans, for the stall checks. They are not safe for
// concurrent use: the history's lock guards them.
type Spans []*Span

// Start records a span of client starting at now.
func (s *Spans) Start(client int, now time.Duration) *Span {
	sp := &Span{Client: client, From: now, To: -1}
	*s = append(*s, sp)
	return sp
}

// End records that sp ended at now, if it has not ended.
func (sp *Span) End(now time.Duration) {
	if sp.To < 0 {
		sp.To = now
	}
}

// EndClients ends, at now, every client's span still open (a run's faults
// heal at its end); the backend's windows end on their own.
func (s Spans) EndClients(now time.Duration) {
	for _, sp := range s {
		if sp.Client >= 0 {
			sp.End(now)
		}
	}
}

// HeldUntil is when a request that client sent before t may land at the
// latest: t, or the end of a span of client that t falls in; then latency.
func (s Spans) HeldUntil(client int, t, latency time.Duration) time.Duration {
	end := t
	for _, sp := range s {
		if sp.Client == client && sp.From <= t && (sp.To < 0 || sp.To >= t) {
			if sp.To < 0 {
				return Forever
			}
			end = max(end, sp.To)
		}
	}
	return end + latency
}

// SettledBy is when a step that client starts at t to give something back
// (and sends again until the backend runs it) has landed at the latest:
// after every span of client, and every window of the backend's, that
// begins before it could land (within settle of the last), then latency and
// settle.
func (s Spans) SettledBy(client int, t, latency, settle time.Duration) time.Duration {
	x := t
	for changed := true; changed; {
		changed = false
		for _, sp := range s {
			if sp.Client != client && sp.Client != -1 || sp.From > x+settle || sp.To >= 0 && sp.To < t {
				continue
			}
			if sp.To < 0 {
				return Forever
			}
			if sp.To > x {
				x, changed = sp.To, true
			}
		}
	}
	return x + latency + settle
}
