package fencetest

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// EntryPoints drives an adapter's public entry points with arbitrary input, as
// the body of a fuzz target: every call must either succeed with the
// documented outcome or fail with a documented error (ErrInvalid before any
// request, and only for input the backend refuses by Refuses, MinTTL and
// MaxTTL; ErrStale; ErrHeld), never panic, never return a raw backend error
// for input that should have been refused, never grant a lease that does not
// exclude. It keeps a model of the largest token each key accepted, so the
// Writer must be used only through it. Make one per fuzz target (one per
// fuzzing process); it is not safe for concurrent use.
type EntryPoints struct {
	// Writer is the adapter's fenced writer under test (required); Check
	// reads each accepted write back through it.
	Writer interface {
		fence.FencedWriter
		fence.Reader
	}
	// Acquirer is the adapter's acquirer under test (required).
	Acquirer fence.Acquirer

	// Refuses reports whether the backend refuses s as a key or a lock name,
	// beside the empty string, which every backend refuses. ErrInvalid for a
	// key (or name) it does not refuse, with a valid token (or a ttl within
	// MinTTL..MaxTTL), fails the check: valid input must be served.
	// Default: nil, which refuses only the empty string.
	Refuses func(s string) bool

	// MinTTL and MaxTTL are the acquirer's documented ttl range; 0 means no
	// limit of its own (every ttl > 0 is valid).
	MinTTL, MaxTTL time.Duration

	model map[string]fence.Token
}

// refused reports whether s is a key or name the backend may refuse.
func (e *EntryPoints) refused(s string) bool {
	return s == "" || (e.Refuses != nil && e.Refuses(s))
}

// ttlValid reports whether ttl is within the acquirer's documented range.
func (e *EntryPoints) ttlValid(ttl time.Duration) bool {
	return ttl > 0 && ttl >= e.MinTTL && (e.MaxTTL <= 0 || ttl <= e.MaxTTL)
}

// Check writes value under key with token, reads it back, then takes and
// releases a lease on name for ttlNs.
func (e *EntryPoints) Check(t *testing.T, key, name string, ttlNs int64, token uint64, value []byte) {
	t.Helper()
	if e.model == nil {
		e.model = map[string]fence.Token{}
	}
	ctx := context.Background()
	tok := fence.Token(token)
	err := e.Writer.Write(ctx, key, value, tok)
	switch {
	case err == nil:
		if tok < e.model[key] {
			t.Fatalf("Write(%q, token %d) accepted below the key's %d", key, tok, e.model[key])
		}
		e.model[key] = tok
		got, gotTok, err := e.Writer.Read(ctx, key)
		if err != nil || !bytes.Equal(got, value) || gotTok != tok {
			t.Fatalf("Read(%q) after a write = %q, %d, %v; want %q, %d", key, got, gotTok, err, value, tok)
		}
	case errors.Is(err, fence.ErrStale):
		if tok >= e.model[key] {
			t.Fatalf("Write(%q, token %d) stale although the key holds %d: %v", key, tok, e.model[key], err)
		}
	case errors.Is(err, fence.ErrInvalid):
		if !e.refused(key) && tok.Valid() {
			t.Fatalf("Write(%q, token %d) refused valid input: %v", key, tok, err)
		}
		if _, written := e.model[key]; !written {
			if _, _, err := e.Writer.Read(ctx, key); !errors.Is(err, fence.ErrNotFound) && !errors.Is(err, fence.ErrInvalid) {
				t.Fatalf("Read(%q) after a refused write: %v", key, err)
			}
		}
	default:
		t.Fatalf("Write(%q, %d): undocumented error %v", key, tok, err)
	}

	ttl := time.Duration(ttlNs)
	l, err := e.Acquirer.TryAcquire(ctx, name, ttl)
	switch {
	case err == nil:
		if !l.Token().Valid() {
			t.Fatalf("granted invalid token %d", l.Token())
		}
		if ttl >= time.Second {
			if _, err := e.Acquirer.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrHeld) {
				t.Fatalf("TryAcquire(%q) while a %v lease is held: %v", name, ttl, err)
			}
		}
		if err := l.Release(ctx); err != nil && !(ttl < time.Second && errors.Is(err, fence.ErrLost)) {
			t.Fatalf("Release: %v", err)
		}
	case errors.Is(err, fence.ErrInvalid):
		if !e.refused(name) && e.ttlValid(ttl) {
			t.Fatalf("TryAcquire(%q, %d) refused valid input: %v", name, ttlNs, err)
		}
	case errors.Is(err, fence.ErrHeld):
	case errors.Is(err, fence.ErrLost) && ttl < time.Second:
		// A grant that came back past a short lease's local deadline and
		// was given back, as fence.Acquirer allows.
	default:
		t.Fatalf("TryAcquire(%q, %d): undocumented error %v", name, ttlNs, err)
	}
}
