package idempotencytest_test

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/internal/testbug"
)

// The mutants: each switch gives memStore one realistic bug, and TestMutantsKilled
// shows that a named case of the suite catches it.
const (
	// Update looks at the fence only when the state differs, so an owner that
	// was taken over passes the check on the new owner's armed record.
	bugFenceOnlyOnStateChange = "fence-only-on-state-change"
	// Purge removes completed and failed records whatever their retention.
	bugPurgeWithinRetention = "purge-within-retention"
	// Purge removes claimed and armed records whose lease ran out.
	bugPurgeExpiredLeases = "purge-expired-leases"
	// Purge removes unknown records.
	bugPurgeUnknown = "purge-unknown"
	// A renewal (armed -> armed) succeeds without moving the lease.
	bugRenewKeepsLease = "renew-keeps-lease"
	// A takeover (Restart) clears the record's fingerprint.
	bugTakeoverDropsFingerprint = "takeover-drops-fingerprint"
	// Get falls back to a record whose key starts with the key asked for.
	bugGetByPrefix = "get-by-prefix"
	// Keys are compared as a case-insensitive, PAD SPACE collation does.
	bugKeyCollation = "key-collation"
	// Begin claims anew only a missing or released record: past its
	// retention, a record nobody purged is still replayed.
	bugBeginIgnoresRetention = "begin-ignores-retention"
	// Update ignores Restart: InProgressFor keeps counting from the first claim.
	bugRestartIgnored = "restart-ignored"
	// Update keeps the caller's Result slice instead of a copy.
	bugAliasStoredResult = "alias-stored-result"
	// Reads hand out the store's own Result slice instead of a copy.
	bugAliasReadResult = "alias-read-result"
)

// memRecord is one key's record as memStore holds it: times on the local
// monotonic clock, which stands in for the store's.
type memRecord struct {
	fingerprint   string
	state         idempotency.State
	fence         fence.Token
	owner         string
	leaseUntil    time.Time
	started       time.Time
	expires       time.Time // zero: no retention
	result        []byte
	resultDropped bool
}

// memStore is a correct in-memory idempotency.Store, except for the one bug
// its switch names (none when empty).
type memStore struct {
	bug string

	mu   sync.Mutex
	recs map[string]*memRecord
	high map[string]fence.Token // the largest fence each key ever had, kept across Purge
}

func newMemStore(bug string) *memStore {
	return &memStore{bug: bug, recs: map[string]*memRecord{}, high: map[string]fence.Token{}}
}

var _ idempotency.Store = (*memStore)(nil)

// id is the map key of key: key itself, or what the collation mutant makes of it.
func (s *memStore) id(key string) string {
	if s.bug == bugKeyCollation {
		return strings.ToLower(strings.TrimRight(key, " "))
	}
	return key
}

func check(op string, ctx context.Context, key string) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	return leasekit.CheckKey(op, key)
}

// read returns key's record as a caller sees it, at now.
func (s *memStore) read(key string, r *memRecord, now time.Time) idempotency.Record {
	res := bytes.Clone(r.result)
	if s.bug == bugAliasReadResult {
		res = r.result
	}
	return idempotency.Record{
		Key: key, Fingerprint: r.fingerprint, State: r.state, Fence: r.fence, Owner: r.owner,
		LeaseLeft: r.leaseUntil.Sub(now), InProgressFor: now.Sub(r.started),
		Result: res, ResultDropped: r.resultDropped,
	}
}

// pastRetention reports a completed or failed record whose retention ran out.
func pastRetention(r *memRecord, now time.Time) bool {
	return (r.state == idempotency.Completed || r.state == idempotency.Failed) && !r.expires.IsZero() && !now.Before(r.expires)
}

func (s *memStore) raise(key string, f fence.Token) {
	s.high[key] = max(s.high[key], f)
}

func (s *memStore) Begin(ctx context.Context, key, fingerprint, owner string, lease time.Duration) (idempotency.Record, bool, error) {
	if err := check("memstore begin", ctx, key); err != nil {
		return idempotency.Record{}, false, err
	}
	if lease <= 0 {
		return idempotency.Record{}, false, &fence.InvalidError{Op: "memstore begin", Arg: "lease", Reason: "not positive"}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	if r, ok := s.recs[s.id(key)]; ok && r.state != idempotency.Released && (s.bug == bugBeginIgnoresRetention || !pastRetention(r, now)) {
		resend := s.bug == bugClaimByFingerprint && r.state == idempotency.Claimed && r.fingerprint == fingerprint
		return s.read(key, r, now), resend, nil
	}
	r := &memRecord{fingerprint: fingerprint, state: idempotency.Claimed, fence: s.high[s.id(key)] + 1, owner: owner, leaseUntil: now.Add(lease), started: now}
	s.raise(s.id(key), r.fence)
	s.recs[s.id(key)] = r
	return s.read(key, r, now), true, nil
}

func (s *memStore) Update(ctx context.Context, key string, from idempotency.State, fromFence fence.Token, ch idempotency.Change) (idempotency.Record, error) {
	if err := check("memstore update", ctx, key); err != nil {
		return idempotency.Record{}, err
	}
	if ch.Lease < 0 || ch.Retention < 0 {
		return idempotency.Record{}, &fence.InvalidError{Op: "memstore update", Arg: "change", Reason: "negative lease or retention"}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	r, ok := s.recs[s.id(key)]
	if !ok {
		return idempotency.Record{}, fence.ErrNotFound
	}
	fenceChecked := s.bug != bugFenceOnlyOnStateChange || r.state != from
	if fenceChecked && r.fence != fromFence {
		return idempotency.Record{}, &fence.StaleError{Key: key, Offered: fromFence, Current: r.fence}
	}
	if r.state != from {
		return idempotency.Record{}, &idempotency.StateError{Key: key, Want: from, Got: r.state}
	}
	renewal := from == idempotency.Armed && ch.State == idempotency.Armed
	r.state, r.fence, r.owner = ch.State, ch.Fence, ch.Owner
	if !renewal || s.bug != bugRenewKeepsLease {
		r.leaseUntil = now.Add(ch.Lease)
	}
	if ch.Restart && s.bug != bugRestartIgnored {
		r.started = now
	}
	if ch.Restart && s.bug == bugTakeoverDropsFingerprint {
		r.fingerprint = ""
	}
	r.result = bytes.Clone(ch.Result)
	if s.bug == bugAliasStoredResult {
		r.result = ch.Result
	}
	r.resultDropped = ch.ResultDropped
	r.expires = time.Time{}
	if ch.Retention > 0 {
		r.expires = now.Add(ch.Retention)
	}
	s.raise(s.id(key), r.fence)
	return s.read(key, r, now), nil
}

func (s *memStore) Get(ctx context.Context, key string) (idempotency.Record, error) {
	if err := check("memstore get", ctx, key); err != nil {
		return idempotency.Record{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.recs[s.id(key)]
	if !ok && s.bug == bugGetByPrefix {
		for _, k := range slices.Sorted(maps.Keys(s.recs)) {
			if strings.HasPrefix(k, key) {
				r, ok = s.recs[k], true
				break
			}
		}
	}
	if !ok {
		return idempotency.Record{}, fence.ErrNotFound
	}
	return s.read(key, r, time.Now()), nil
}

func (s *memStore) Purge(ctx context.Context) (int, error) {
	if err := leasekit.CheckContext("memstore purge", ctx); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	n := 0
	for k, r := range s.recs {
		final := r.state == idempotency.Completed || r.state == idempotency.Failed
		live := r.state == idempotency.Claimed || r.state == idempotency.Armed
		if r.state == idempotency.Released || pastRetention(r, now) ||
			(s.bug == bugPurgeWithinRetention && final) ||
			(s.bug == bugPurgeExpiredLeases && live && !now.Before(r.leaseUntil)) ||
			(s.bug == bugPurgeUnknown && r.state == idempotency.Unknown) {
			delete(s.recs, k)
			n++
		}
	}
	return n, nil
}

// mutantEnv names the mutant a child test process runs the suite on.
const mutantEnv = "IDEMPOTENCYTEST_MUTANT"

// mutantFromEnv returns the mutant named by mutantEnv, or an error for a name
// that is not a mutant (so a typo cannot pass for a kill). For a mutant of Do
// itself (bugClaimLeftHeld) it turns on Do's test-only switch.
func mutantFromEnv() (string, error) {
	m := os.Getenv(mutantEnv)
	if m == "" {
		return "", nil
	}
	for _, k := range mutants {
		if k.bug == m {
			return m, nil
		}
	}
	for _, k := range nemesisMutants {
		if k.bug == m {
			if m == bugClaimLeftHeld {
				// A bug of Do itself, not of the store: its switch is Do's.
				testbug.ClaimLeftHeld.Store(true)
			}
			return m, nil
		}
	}
	return "", fmt.Errorf("%s=%q is not a mutant", mutantEnv, m)
}
