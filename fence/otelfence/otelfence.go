// Package otelfence is a fence.Observer on OpenTelemetry: metrics for lease
// waits, grants, lost leases, renewal failures and stale writes, labelled by
// backend and lock name, and spans around acquires and fenced writes.
package otelfence

import (
	"context"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Options configures an Observer. A nil *Options means the defaults.
type Options struct {
	// MeterProvider makes the instruments. Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// TracerProvider makes the spans fence.acquire and fence.write. Default:
	// otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// MaxNames bounds the label cardinality: the first MaxNames lock names
	// (and keys) seen are labelled as they are, later ones as "other".
	// Default: 100. A negative value labels every name "other".
	MaxNames int
}

// Observer records fence events as OpenTelemetry metrics and spans. It is safe
// for concurrent use.
type Observer struct {
	tracer   trace.Tracer
	wait     metric.Float64Histogram
	grants   metric.Int64Counter
	gaveUp   metric.Int64Counter
	lost     metric.Int64Counter
	renewErr metric.Int64Counter
	stale    metric.Int64Counter
	writes   metric.Int64Counter

	maxNames int
	mu       sync.Mutex
	names    map[string]bool
}

var _ fence.Observer = (*Observer)(nil)

// New returns an Observer. The instruments are:
//
//	fence.acquire.wait      histogram, seconds, per Acquire/TryAcquire
//	fence.grants            counter of leases granted
//	fence.acquire.gave_up   counter of acquires that ended without a lease
//	fence.leases.lost       counter of leases found lost (renewal or release)
//	fence.renew.failures    counter of renewals that failed transiently
//	fence.writes            counter of fenced writes accepted
//	fence.writes.stale      counter of stale writes refused
//
// each with the attributes fence.backend and fence.name (or fence.key).
func New(opts *Options) (*Observer, error) {
	var o Options
	if opts != nil {
		o = *opts
	}
	if o.MeterProvider == nil {
		o.MeterProvider = otel.GetMeterProvider()
	}
	if o.TracerProvider == nil {
		o.TracerProvider = otel.GetTracerProvider()
	}
	if o.MaxNames == 0 {
		o.MaxNames = 100
	}
	m := o.MeterProvider.Meter("github.com/fencekit/fencekit/fence")
	x := &Observer{tracer: o.TracerProvider.Tracer("github.com/fencekit/fencekit/fence"), maxNames: o.MaxNames, names: map[string]bool{}}
	var err error
	if x.wait, err = m.Float64Histogram("fence.acquire.wait", metric.WithUnit("s"), metric.WithDescription("Time from an acquire call to its end")); err != nil {
		return nil, err
	}
	counters := []struct {
		c    *metric.Int64Counter
		name string
		desc string
	}{
		{&x.grants, "fence.grants", "Leases granted"},
		{&x.gaveUp, "fence.acquire.gave_up", "Acquires that ended without a lease"},
		{&x.lost, "fence.leases.lost", "Leases found lost at renewal or release"},
		{&x.renewErr, "fence.renew.failures", "Renewals that failed with a transient error"},
		{&x.writes, "fence.writes", "Fenced writes accepted"},
		{&x.stale, "fence.writes.stale", "Stale writes refused"},
	}
	for _, c := range counters {
		if *c.c, err = m.Int64Counter(c.name, metric.WithDescription(c.desc)); err != nil {
			return nil, err
		}
	}
	return x, nil
}

// label bounds the cardinality of lock names and keys.
func (x *Observer) label(name string) string {
	if x.maxNames < 0 {
		return "other"
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.names[name] {
		return name
	}
	if len(x.names) < x.maxNames {
		x.names[name] = true
		return name
	}
	return "other"
}

func (x *Observer) attrs(backend, kind, name string) metric.MeasurementOption {
	return metric.WithAttributes(attribute.String("fence.backend", backend), attribute.String(kind, x.label(name)))
}

// Acquire records the wait, the grant or the giving up, and a span covering the call.
func (x *Observer) Acquire(ctx context.Context, e fence.AcquireEvent) {
	a := x.attrs(e.Backend, "fence.name", e.Name)
	x.wait.Record(ctx, e.Waited.Seconds(), a)
	if e.Err == nil {
		x.grants.Add(ctx, 1, a)
	} else {
		x.gaveUp.Add(ctx, 1, a)
	}
	end := time.Now()
	_, span := x.tracer.Start(ctx, "fence.acquire", trace.WithTimestamp(end.Add(-e.Waited)),
		trace.WithAttributes(attribute.String("fence.backend", e.Backend), attribute.String("fence.name", e.Name),
			attribute.Bool("fence.try", e.Try), attribute.Int64("fence.token", int64(e.Token))))
	if e.Err != nil {
		span.SetStatus(codes.Error, e.Err.Error())
	}
	span.End(trace.WithTimestamp(end))
}

// Renew counts lost leases and transient renewal failures.
func (x *Observer) Renew(ctx context.Context, e fence.LeaseEvent) {
	switch {
	case e.Lost:
		x.lost.Add(ctx, 1, x.attrs(e.Backend, "fence.name", e.Name))
	case e.Err != nil:
		x.renewErr.Add(ctx, 1, x.attrs(e.Backend, "fence.name", e.Name))
	}
}

// Release counts leases found already lost.
func (x *Observer) Release(ctx context.Context, e fence.LeaseEvent) {
	if e.Lost {
		x.lost.Add(ctx, 1, x.attrs(e.Backend, "fence.name", e.Name))
	}
}

// Write counts accepted and stale writes, and records a span for the write.
func (x *Observer) Write(ctx context.Context, e fence.WriteEvent) {
	a := x.attrs(e.Backend, "fence.key", e.Key)
	switch {
	case e.Stale:
		x.stale.Add(ctx, 1, a)
	case e.Err == nil:
		x.writes.Add(ctx, 1, a)
	}
	end := time.Now()
	_, span := x.tracer.Start(ctx, "fence.write", trace.WithTimestamp(end.Add(-e.Took)),
		trace.WithAttributes(attribute.String("fence.backend", e.Backend), attribute.String("fence.key", e.Key),
			attribute.Int64("fence.offered", int64(e.Offered)), attribute.Int64("fence.current", int64(e.Current)),
			attribute.Bool("fence.stale", e.Stale)))
	if e.Err != nil {
		span.SetStatus(codes.Error, e.Err.Error())
	}
	span.End(trace.WithTimestamp(end))
}
