package fence

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// Observer receives what happens to leases and fenced writes, for metrics,
// traces and logs. Its methods are called synchronously and must be quick and
// safe for concurrent use. Wrap an acquirer with Observe and a writer with
// ObserveWriter; nothing is observed (and nothing is paid) otherwise.
type Observer interface {
	// Acquire reports the end of an Acquire or TryAcquire: granted with the
	// token, or not (err: ErrHeld, a context error, a backend error), after
	// waiting waited.
	Acquire(ctx context.Context, e AcquireEvent)
	// Renew reports a renewal: ok, a transient error, or the lease lost.
	Renew(ctx context.Context, e LeaseEvent)
	// Release reports a release: ok, or the lease already lost.
	Release(ctx context.Context, e LeaseEvent)
	// Write reports a fenced write: accepted, or stale (with the token the key
	// holds), or failed.
	Write(ctx context.Context, e WriteEvent)
}

// AcquireEvent describes one Acquire or TryAcquire.
type AcquireEvent struct {
	Backend string        // the label given to Observe
	Name    string        // the lock name
	Try     bool          // TryAcquire
	Token   Token         // the grant's token; 0 when not granted
	Waited  time.Duration // from the call to its end
	Err     error         // the call's error; nil when granted
}

// LeaseEvent describes one Renew or Release.
type LeaseEvent struct {
	Backend string // the label given to Observe
	Name    string // the lock name
	Token   Token  // the lease's token
	Lost    bool   // the lease was no longer held (ErrLost)
	Err     error  // the call's error; nil when renewed or released
}

// WriteEvent describes one fenced write.
type WriteEvent struct {
	Backend string        // the label given to ObserveWriter
	Key     string        // the key written
	Offered Token         // the token the write carried
	Current Token         // for a stale write: the token the key holds
	Stale   bool          // the write was refused as stale (ErrStale)
	Took    time.Duration // from the call to its end
	Err     error         // the write's error; nil when accepted
}

// Observe wraps a so that every grant, renewal and release is
// reported to o, labelled with backend. Leases keep their behaviour.
func Observe(a Acquirer, backend string, o Observer) Acquirer {
	return &observedAcquirer{a: a, backend: backend, o: o}
}

type observedAcquirer struct {
	a       Acquirer
	backend string
	o       Observer
}

func (x *observedAcquirer) Acquire(ctx context.Context, name string, ttl time.Duration) (Lease, error) {
	return x.acquire(ctx, name, ttl, false)
}

func (x *observedAcquirer) TryAcquire(ctx context.Context, name string, ttl time.Duration) (Lease, error) {
	return x.acquire(ctx, name, ttl, true)
}

func (x *observedAcquirer) acquire(ctx context.Context, name string, ttl time.Duration, try bool) (Lease, error) {
	if err := checkContext("acquire", ctx); err != nil {
		return nil, err // observers are not called with a nil context
	}
	start := time.Now()
	var (
		l   Lease
		err error
	)
	if try {
		l, err = x.a.TryAcquire(ctx, name, ttl)
	} else {
		l, err = x.a.Acquire(ctx, name, ttl)
	}
	e := AcquireEvent{Backend: x.backend, Name: name, Try: try, Waited: time.Since(start), Err: err}
	if err == nil {
		e.Token = l.Token()
		l = &observedLease{Lease: l, x: x}
	}
	x.o.Acquire(ctx, e)
	return l, err
}

type observedLease struct {
	Lease
	x *observedAcquirer
}

// LocalDeadline is the wrapped lease's, when it tells it (for Hold's first
// renewal); the zero time otherwise.
func (l *observedLease) LocalDeadline() time.Time {
	if d, ok := l.Lease.(localDeadliner); ok {
		return d.LocalDeadline()
	}
	return time.Time{}
}

func (l *observedLease) Renew(ctx context.Context) error {
	if err := checkContext("renew", ctx); err != nil {
		return err
	}
	err := l.Lease.Renew(ctx)
	l.x.o.Renew(ctx, LeaseEvent{Backend: l.x.backend, Name: l.Name(), Token: l.Token(), Lost: errors.Is(err, ErrLost), Err: err})
	return err
}

func (l *observedLease) Release(ctx context.Context) error {
	if err := checkContext("release", ctx); err != nil {
		return err
	}
	err := l.Lease.Release(ctx)
	l.x.o.Release(ctx, LeaseEvent{Backend: l.x.backend, Name: l.Name(), Token: l.Token(), Lost: errors.Is(err, ErrLost), Err: err})
	return err
}

// ObserveWriter wraps w so that every write is reported to o, labelled with
// backend. The wrapper keeps w's Read and Delete when w has them.
func ObserveWriter(w FencedWriter, backend string, o Observer) FencedWriter {
	base := &observedWriter{w: w, backend: backend, o: o}
	r, isReader := w.(Reader)
	d, isDeleter := w.(Deleter)
	switch {
	case isReader && isDeleter:
		return struct {
			*observedWriter
			Reader
			Deleter
		}{base, r, observedDeleter{base, d}}
	case isReader:
		return struct {
			*observedWriter
			Reader
		}{base, r}
	case isDeleter:
		return struct {
			*observedWriter
			Deleter
		}{base, observedDeleter{base, d}}
	}
	return base
}

type observedWriter struct {
	w       FencedWriter
	backend string
	o       Observer
}

func (x *observedWriter) Write(ctx context.Context, key string, value []byte, token Token) error {
	if err := checkContext("write", ctx); err != nil {
		return err
	}
	start := time.Now()
	err := x.w.Write(ctx, key, value, token)
	x.report(ctx, key, token, start, err)
	return err
}

func (x *observedWriter) report(ctx context.Context, key string, token Token, start time.Time, err error) {
	e := WriteEvent{Backend: x.backend, Key: key, Offered: token, Took: time.Since(start), Err: err}
	var se *StaleError
	if errors.As(err, &se) {
		e.Stale, e.Current = true, se.Current
	}
	x.o.Write(ctx, e)
}

type observedDeleter struct {
	x *observedWriter
	d Deleter
}

func (od observedDeleter) Delete(ctx context.Context, key string, token Token) error {
	if err := checkContext("delete", ctx); err != nil {
		return err
	}
	start := time.Now()
	err := od.d.Delete(ctx, key, token)
	od.x.report(ctx, key, token, start, err)
	return err
}

// SlogObserver logs, at Warn, what the people on call need to see: leases lost
// (at renewal or release) and stale writes refused, with the lock name or key,
// the tokens and the backend. Nothing else is logged.
func SlogObserver(l *slog.Logger) Observer { return slogObserver{l} }

type slogObserver struct{ l *slog.Logger }

func (slogObserver) Acquire(context.Context, AcquireEvent) {}

func (s slogObserver) Renew(ctx context.Context, e LeaseEvent) {
	if e.Lost {
		s.l.WarnContext(ctx, "fence: lease lost at renewal", "backend", e.Backend, "name", e.Name, "token", uint64(e.Token))
	}
}

func (s slogObserver) Release(ctx context.Context, e LeaseEvent) {
	if e.Lost {
		s.l.WarnContext(ctx, "fence: lease already lost at release", "backend", e.Backend, "name", e.Name, "token", uint64(e.Token))
	}
}

func (s slogObserver) Write(ctx context.Context, e WriteEvent) {
	if e.Stale {
		s.l.WarnContext(ctx, "fence: stale write refused", "backend", e.Backend, "key", e.Key,
			"offered", uint64(e.Offered), "current", uint64(e.Current))
	}
}
