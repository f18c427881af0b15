package idempotency

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/idempotency/internal/testbug"
)

// Effect performs the side effect once. effectKey is derived from the key and
// the attempt's fence: pass it to the third party's own idempotency header, so
// that an attempt taken over after a crash cannot make a provider that
// deduplicates act twice. ctx is cancelled when Do's ctx ends (the key's lease
// is still renewed until the effect returns), and with cause fence.ErrLost when the
// key was taken over, when the in-progress ceiling passes, or when no renewal
// of the key's lease was confirmed before its local deadline (measured from
// before the request that set the lease, less a drift margin of 1% + 2ms), so
// an owner cut off from the store stops before another may take the key over.
// ctx.Err() reads the clock, so a check of it right before an irreversible
// step sees the local deadline at once; ctx.Done() and contexts derived from
// ctx learn of it from a timer, which a busy machine may run late: the drift
// margin must cover that delay.
//
// Classify the error: wrap it with NotSent when the effect provably did not
// happen (the key is released and may be claimed again), with Definitive for a
// business failure that must be replayed (the key becomes failed); any other
// error is ambiguous: the record stays armed, and a later caller reconciles it.
type Effect func(ctx context.Context, effectKey string) (result []byte, err error)

// Reconcile tells, for an armed record whose owner is gone, whether the effect
// made under effectKey happened (ask the provider). done with result completes
// the key; not done lets Do run the effect again under a new effect key; an error
// leaves the record as it is.
type Reconcile func(ctx context.Context, effectKey string) (done bool, result []byte, err error)

type classified struct {
	err        error
	notSent    bool
	definitive bool
}

func (c *classified) Error() string { return c.err.Error() }
func (c *classified) Unwrap() error { return c.err }

// NotSent marks err as an effect that provably did not happen.
func NotSent(err error) error { return &classified{err: err, notSent: true} }

// Definitive marks err as a definitive business failure, replayed to later callers.
func Definitive(err error) error { return &classified{err: err, definitive: true} }

// Options configures Do. A nil *Options means the defaults, and so does a zero
// field; a negative duration or size is refused with an error matching
// fence.ErrInvalid.
type Options struct {
	// Owner identifies this caller in the record. Default: a random id.
	Owner string
	// Lease is how long a claim lasts without renewal; while the effect runs,
	// Do renews it a third of the lease after the request that set it was sent
	// (at once when its reply came later), then at least every Lease/3.
	// At least MinLease. Default: 30s.
	Lease time.Duration
	// InProgressCeiling bounds how long one owner may keep a key in progress by
	// renewing; past it, Do stops renewing and cancels the effect's context.
	// At least Lease. Default: 10 * Lease.
	InProgressCeiling time.Duration
	// Retention keeps a completed or failed record, and so the promise that its
	// effect does not run again, this long after it completed. Past it the
	// record may be removed, and the next Do with the key is a new request: it
	// claims the key afresh and runs the effect again, under a new effect key
	// (see EffectKey). Use Forever for keys that must never run twice, with
	// DiscardResult to keep only the decision. Default: 24h.
	Retention time.Duration
	// DiscardResult completes the key without storing the effect's result:
	// the effect still runs at most once, and later calls get
	// ErrResultNotStored instead of a replay. With Retention Forever it keeps
	// the records small. Default: false.
	DiscardResult bool
	// MaxResultSize bounds a stored result. A larger one completes the key
	// without its result (replays get ErrResultNotStored). Default: 64 KiB.
	MaxResultSize int
	// Wait makes Do wait while the key is in progress elsewhere (woken by the
	// store's notifications where it has them, else polling), instead of
	// returning ErrInProgress. ctx bounds the wait.
	Wait bool
	// Reconcile is consulted for an armed record whose owner's lease expired.
	// Without it, such a record becomes unknown.
	Reconcile Reconcile
	// CompleteTimeout bounds recording the result after the effect, with a
	// context detached from the caller's; the write is retried until then.
	// At least MinCompleteTimeout. Default: 10s.
	CompleteTimeout time.Duration
}

// Forever, as Options.Retention, keeps completed and failed records without
// end: their keys never run again (Purge and the stores' expiry leave them).
const Forever time.Duration = math.MaxInt64

// MinLease is the shortest Options.Lease: the stores keep leases in
// milliseconds, and the effect's local deadline is the lease less a drift
// margin of 1% + 2ms, so a shorter lease would be over at the store, and
// taken over by the next caller, while its effect runs.
const MinLease = 10 * time.Millisecond

// defaultLease is Options.Lease's default.
const defaultLease = 30 * time.Second

// MinCompleteTimeout is the shortest Options.CompleteTimeout: a shorter one
// (10 meant as seconds is 10ns) would end before the completion's round trip
// to the store, leave every key armed after its effect ran, then unknown.
const MinCompleteTimeout = 10 * time.Millisecond

// Validate returns an error matching fence.ErrInvalid, naming the field, for a
// negative duration or size, a Lease under MinLease, an InProgressCeiling under
// the Lease, or a CompleteTimeout under MinCompleteTimeout: the options Do refuses
// (zero means the default, and a negative value is a mistake, not a wish for
// the default). Durations up to the largest time.Duration work. A nil
// *Options is valid.
func (o *Options) Validate() error {
	if o == nil {
		return nil
	}
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"Lease", o.Lease}, {"InProgressCeiling", o.InProgressCeiling}, {"Retention", o.Retention}, {"CompleteTimeout", o.CompleteTimeout}} {
		if f.d < 0 {
			return &fence.InvalidError{Op: "idempotency", Arg: f.name, Reason: fmt.Sprintf("%v is negative", f.d)}
		}
	}
	if o.Lease > 0 && o.Lease < MinLease {
		return &fence.InvalidError{Op: "idempotency", Arg: "Lease", Reason: fmt.Sprintf("%v is under %v (MinLease)", o.Lease, MinLease)}
	}
	if lease := o.Lease; o.InProgressCeiling > 0 {
		if lease == 0 {
			lease = defaultLease
		}
		if o.InProgressCeiling < lease {
			return &fence.InvalidError{Op: "idempotency", Arg: "InProgressCeiling", Reason: fmt.Sprintf("%v is under the lease (%v): the effect would be cancelled at its first renewal", o.InProgressCeiling, lease)}
		}
	}
	if o.CompleteTimeout > 0 && o.CompleteTimeout < MinCompleteTimeout {
		return &fence.InvalidError{Op: "idempotency", Arg: "CompleteTimeout", Reason: fmt.Sprintf("%v is under %v (MinCompleteTimeout)", o.CompleteTimeout, MinCompleteTimeout)}
	}
	if o.MaxResultSize < 0 {
		return &fence.InvalidError{Op: "idempotency", Arg: "MaxResultSize", Reason: fmt.Sprintf("%d is negative", o.MaxResultSize)}
	}
	return nil
}

// checkCall refuses a nil ctx, a nil store and an empty key.
func checkCall(op string, ctx context.Context, s Store, key string) error {
	if err := leasekit.CheckContext(op, ctx); err != nil {
		return err
	}
	if s == nil {
		return &fence.InvalidError{Op: op, Arg: "store", Reason: "nil"}
	}
	return leasekit.CheckKey(op, key)
}

func (o *Options) withDefaults() Options {
	var x Options
	if o != nil {
		x = *o
	}
	if x.Owner == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		x.Owner = hex.EncodeToString(b[:])
	}
	if x.Lease <= 0 {
		x.Lease = defaultLease
	}
	if x.InProgressCeiling <= 0 {
		x.InProgressCeiling = time.Duration(math.MaxInt64)
		if x.Lease <= x.InProgressCeiling/10 {
			x.InProgressCeiling = 10 * x.Lease
		}
	}
	if x.Retention <= 0 {
		x.Retention = 24 * time.Hour
	}
	if x.MaxResultSize <= 0 {
		x.MaxResultSize = 64 << 10
	}
	if x.CompleteTimeout <= 0 {
		x.CompleteTimeout = 10 * time.Second
	}
	return x
}

// Result is what Do returns.
type Result struct {
	// Value is the effect's result.
	Value []byte
	// Replayed is true when the effect ran earlier (in another call) and this
	// is its recorded result.
	Replayed bool
	// Fence is the fence of the attempt that produced it.
	Fence fence.Token
	// EffectKey is the effect key of the attempt that produced it (see
	// EffectKey), empty for a replay.
	EffectKey string
}

// EffectKey derives the effect key of the attempt that rec records: stable for
// one attempt, and different for every claim and takeover, because it covers
// the key, the fence and the owner, and Do makes the owner unique per claim
// (Options.Owner, "#", and a random nonce). Two attempts therefore never share an
// effect key, even on a store that lost a key's fence.
func EffectKey(rec Record) string {
	h := sha256.Sum256([]byte(fmt.Sprintf("%d\x00%s\x00%s", uint64(rec.Fence), rec.Owner, rec.Key)))
	return hex.EncodeToString(h[:16])
}

// claimOwner is the owner Do records for one claim: the caller's Owner and a
// nonce of this claim.
func claimOwner(o Options) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return o.Owner + "#" + hex.EncodeToString(b[:])
}

// Do runs effect at most once for key and returns its result; later calls with
// the same key and fingerprint replay the recorded result (Replayed). See the
// package documentation for the states, and Options for the choices.
//
// "At most once" lasts as long as the key's record: Options.Retention after
// the key completed or failed (24h by default). A call with the key after
// that claims it afresh and runs the effect again, under a new effect key, so
// a provider's own deduplication cannot catch it either. Keys that must
// never run twice need Retention Forever.
//
// While the effect runs, Do renews the key's lease, also after ctx ended
// (the effect's context is then cancelled, so that a cooperative effect can
// stop): renewals end only when the effect returns, the in-progress ceiling
// passes, or the lease's local deadline passes without a confirmed renewal.
// In the last two cases the effect's context is cancelled before the lease
// ends at the store; an effect that goes on regardless may then overlap with
// a takeover, which only its effect key (a new one per takeover) lets a
// provider tell apart.
// An effect that panics leaves the key armed (it may have happened) and the
// panic goes on unrecovered, with its stack; renewals stop.
//
// When ctx ends while a claim's (or takeover's) reply is outstanding, Do
// returns at once and, in the background, keeps looking for that claim until
// CompleteTimeout after it was sent, releasing it if it landed, so that the
// key does not stay claimed by nobody for a whole lease. A claim that lands
// later than that, or that the store could not be reached to release by
// then, keeps the key until its lease ends: other callers get ErrInProgress
// meanwhile.
//
// Errors: ErrFingerprintMismatch; an *InProgressError (ErrInProgress) while
// another owner holds the key; a *FailedError (ErrFailed) replaying a definitive
// failure; ErrUnknown when the effect may have happened and nothing can tell;
// the effect's own error (classified as above); ErrNotRecorded when the effect
// completed but the result could not be recorded (also matching
// fence.ErrUnknown when a completion still on its way may record it later); ErrResultNotStored replaying
// a result that was too large to keep (or discarded: DiscardResult);
// fence.ErrLost when the arm was confirmed only after the lease's local
// deadline (the effect did not start, and the key is released if still this
// caller's); an error
// matching fence.ErrInvalid, naming it, for a bad argument or option; a
// store's error (a step it could not complete, or could not tell whether it
// did, and that re-reading the record could not settle) before the effect
// started: the effect did not run.
func Do(ctx context.Context, s Store, key, fingerprint string, effect Effect, opts *Options) (Result, error) {
	if err := checkCall("idempotency", ctx, s, key); err != nil {
		return Result{}, err
	}
	if effect == nil {
		return Result{}, &fence.InvalidError{Op: "idempotency", Arg: "effect", Reason: "nil function"}
	}
	if err := opts.Validate(); err != nil {
		return Result{}, err
	}
	o := opts.withDefaults()
	var wake <-chan struct{}
	if n, ok := s.(Notifier); ok && o.Wait {
		var unsubscribe func()
		wake, unsubscribe = n.Subscribe(key)
		defer unsubscribe()
	}
	released := 0 // records found released by a Begin, counted apart from the waits
	for attempt := 0; ; attempt++ {
		rec, created, err := begin(ctx, s, key, fingerprint, o)
		if err != nil {
			return Result{}, err
		}
		if !created && rec.State == Released && released < 10 {
			// Released between the claim and the read of the record (a
			// store that answers Begin in two statements): claim it again,
			// after a pause that lets a release still being committed on
			// another connection land (a background settle's, say).
			if (fence.Backoff{Min: time.Millisecond, Max: 50 * time.Millisecond}).Sleep(ctx, released) != nil {
				return Result{}, fmt.Errorf("idempotency: key %q released while it was claimed: %w", key, context.Cause(ctx))
			}
			released++
			continue
		}
		if created {
			return run(ctx, s, rec, effect, o)
		}
		res, owned, err := decide(ctx, s, rec, fingerprint, o)
		if owned != nil {
			return run(ctx, s, *owned, effect, o)
		}
		var ip *InProgressError
		if !o.Wait || !errors.As(err, &ip) {
			return res, err
		}
		// Wait for the other owner: a notification, or its lease running out.
		delay := min(ip.LeaseLeft, fence.Backoff{Min: 5 * time.Millisecond, Max: 200 * time.Millisecond}.Delay(attempt))
		if delay <= 0 {
			delay = time.Millisecond
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return Result{}, errors.Join(err, context.Cause(ctx))
		case <-wake:
		case <-t.C:
		}
		t.Stop()
	}
}

// begin claims key. When the claim's outcome is unknown (its reply was lost,
// or the client library sent it again), it reads the record: claimed under
// this claim's owner is this claim, which landed; another record is answered
// as Begin would have; no record means it did not land, and it is sent again
// (three tries in all). When it gives up on a claim that may have landed (ctx
// ended, the last try, the read failed), the claim is settled in the
// background (see settleClaim), so that it does not hold the key for a lease.
func begin(ctx context.Context, s Store, key, fingerprint string, o Options) (Record, bool, error) {
	owner := claimOwner(o)
	for try := 1; ; try++ {
		sent := time.Now()
		rec, created, err := s.Begin(ctx, key, fingerprint, owner, o.Lease)
		if err == nil && !created && rec.Owner == owner && rec.State == Claimed {
			return rec, true, nil // the client library's resend of this claim
		}
		switch {
		case err == nil || refused(err):
			return rec, created, err
		case ctx.Err() != nil:
			go settleClaim(ctx, s, key, owner, o, sent)
			return rec, created, fmt.Errorf("%w (%w)", err, context.Cause(ctx))
		case try == 3:
			go settleClaim(ctx, s, key, owner, o, sent)
			return rec, created, fmt.Errorf("%w (the claim was sent 3 times; the record was not found after the first 2)", err)
		}
		rctx, cancel := context.WithTimeout(ctx, o.CompleteTimeout)
		got, gerr := read(rctx, s, key)
		cancel()
		switch {
		case gerr == nil:
			return got, got.Owner == owner && got.State == Claimed, nil
		case !errors.Is(gerr, fence.ErrNotFound):
			go settleClaim(ctx, s, key, owner, o, sent)
			return rec, created, fmt.Errorf("%w (reading the record to tell: %v)", err, gerr)
		}
	}
}

// settleClaim releases key if it is claimed by owner: a claim (or takeover)
// whose outcome Do gave up learning, so that it does not keep the key from
// every other caller for its whole lease. The owner is unique to the claim,
// so a record claimed under it can only be that claim, and the release is a
// compare-and-set on its fence: a takeover is never freed. It runs detached
// from ctx and looks for the claim, with a doubling pause, until
// Options.CompleteTimeout after sent (the claim's send), which also bounds
// every read and release: a store that keeps failing ends it then. A claim
// that lands later than that holds the key until its lease ends.
func settleClaim(ctx context.Context, s Store, key, owner string, o Options, sent time.Time) {
	cctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), sent.Add(o.CompleteTimeout))
	defer cancel()
	for look := 0; ; look++ {
		got, err := read(cctx, s, key)
		if err != nil && !errors.Is(err, fence.ErrNotFound) {
			return // the deadline passed, or the key is invalid
		}
		if err == nil && got.Owner == owner {
			if got.State == Claimed {
				releaseClaim(cctx, s, got)
			}
			return
		}
		// Not landed yet (or another's record, which a late claim may
		// still replace once it is released): look again.
		t := time.NewTimer(settlePause(look))
		select {
		case <-cctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// settleArm releases rec's key if it is still claimed or armed by rec's
// claim: an arm whose outcome Do gave up learning, the effect never started,
// so that the key is free for the next caller instead of staying armed until
// its lease ends and then being marked unknown. The release is a
// compare-and-set on the claim's state and fence, so a takeover (or a mark of
// unknown) by another caller is never undone. It runs detached from ctx,
// looking again after errors, until the lease plus CompleteTimeout have
// passed since the store last showed the record still this claim's (a
// release queued at the store behind a lock, with the arm ahead of it, lands
// only when the lock is let go), and at most ten times that from its start.
func settleArm(ctx context.Context, s Store, rec Record, o Options) {
	bg := context.WithoutCancel(ctx)
	span := o.Lease + o.CompleteTimeout
	start := time.Now()
	deadline := start.Add(span)
	for look := 0; time.Now().Before(deadline); look++ {
		cctx, cancel := context.WithDeadline(bg, deadline)
		got, err := s.Get(cctx, rec.Key)
		switch {
		case err == nil && got.Owner == rec.Owner && got.Fence == rec.Fence && (got.State == Claimed || got.State == Armed):
			// Still this claim's, and the store answers: the release may
			// wait behind a lock at the store (with the arm queued ahead
			// of it), so it gets a span of its own from each answer, up
			// to ten spans in all.
			if d := time.Now().Add(span); d.Before(start.Add(10 * span)) {
				deadline = d
			}
			cancel()
			cctx, cancel = context.WithDeadline(bg, deadline)
			rerr := releaseUnstarted(cctx, s, rec, got.State)
			cancel()
			if rerr == nil || refused(rerr) || errors.Is(rerr, fence.ErrStale) || errors.Is(rerr, ErrStateChanged) {
				return // released, or another's now
			}
			continue // its outcome is unknown: look again
		case err == nil || errors.Is(err, fence.ErrNotFound) || errors.Is(err, fence.ErrInvalid):
			cancel()
			return // released, or another's
		}
		cancel()
		t := time.NewTimer(min(settlePause(look), max(o.Lease/4, time.Millisecond)))
		<-t.C
	}
}

// settlePause is the pause after settleClaim's look number look (0-based):
// 5ms, doubling up to a second.
func settlePause(look int) time.Duration {
	const first, most = 5 * time.Millisecond, time.Second
	if look >= 8 {
		return most
	}
	return min(first<<look, most)
}

// releaseClaim moves rec, claimed and never armed, to released, retrying
// errors that are not an answer until ctx ends.
func releaseClaim(ctx context.Context, s Store, rec Record) {
	_ = release(ctx, s, rec, Claimed)
}

// release moves rec, in state from (claimed, or armed with an effect that
// never started), to released, retrying errors that are not an answer until
// ctx ends. A refusal is checked against the record: this caller's own
// release, landed by a try whose reply was lost, is success.
func release(ctx context.Context, s Store, rec Record, from State) error {
	ch := Change{State: Released, Fence: rec.Fence, Owner: rec.Owner}
	for attempt := 0; ; attempt++ {
		_, err := s.Update(ctx, rec.Key, from, rec.Fence, ch)
		if err == nil {
			return nil
		}
		if refused(err) || errors.Is(err, fence.ErrStale) || errors.Is(err, ErrStateChanged) {
			if applied(ctx, s, rec, ch, err) {
				return nil
			}
			return err
		}
		if (fence.Backoff{Min: 5 * time.Millisecond, Max: 200 * time.Millisecond}).Sleep(ctx, attempt) != nil {
			return err
		}
	}
}

// releaseUnstarted releases rec's key, claimed or armed by rec's claim for
// an effect that never started, from the state from. When the store refuses
// because the state moved on (an arm of this claim, queued at the store
// behind a lock when the record was read, landed first), it reads the record
// again and releases it from the state it has now, as long as it is still
// this claim's: a claim moves to armed once and never back, so it tries
// twice at most.
func releaseUnstarted(ctx context.Context, s Store, rec Record, from State) error {
	for {
		err := release(ctx, s, rec, from)
		if !errors.Is(err, ErrStateChanged) {
			return err
		}
		got, gerr := s.Get(ctx, rec.Key)
		if gerr != nil || got.Owner != rec.Owner || got.Fence != rec.Fence || got.State == from ||
			(got.State != Claimed && got.State != Armed) {
			return err
		}
		from = got.State
	}
}

// decide handles a key that already has a record: replay it, report it, or take
// it over (owned is then the record this caller now owns).
func decide(ctx context.Context, s Store, rec Record, fingerprint string, o Options) (Result, *Record, error) {
	if rec.Fingerprint != fingerprint {
		return Result{}, nil, fmt.Errorf("%w: key %q", ErrFingerprintMismatch, rec.Key)
	}
	switch rec.State {
	case Completed:
		if rec.ResultDropped {
			return Result{Replayed: true, Fence: rec.Fence}, nil, fmt.Errorf("%w: key %q", ErrResultNotStored, rec.Key)
		}
		return Result{Value: rec.Result, Replayed: true, Fence: rec.Fence}, nil, nil
	case Failed:
		return Result{Replayed: true, Fence: rec.Fence}, nil, &FailedError{Key: rec.Key, Message: string(rec.Result)}
	case Unknown:
		return Result{}, nil, fmt.Errorf("%w: key %q (fence %d): resolve it with Resolve", ErrUnknown, rec.Key, rec.Fence)
	case Claimed, Armed:
		if rec.LeaseLeft > 0 {
			return Result{}, nil, &InProgressError{Key: rec.Key, Owner: rec.Owner, LeaseLeft: rec.LeaseLeft}
		}
	default:
		return Result{}, nil, fmt.Errorf("idempotency: key %q in unexpected state %q", rec.Key, rec.State)
	}
	// The owner's lease expired.
	takeover := Change{State: Claimed, Fence: rec.Fence + 1, Owner: claimOwner(o), Lease: o.Lease, Restart: true}
	if rec.State == Claimed {
		// It crashed before arming: the effect never started. Take over.
		return takeOver(ctx, s, rec, takeover, o)
	}
	// Armed: the effect may have happened.
	if o.Reconcile == nil {
		ch := Change{State: Unknown, Fence: rec.Fence, Owner: rec.Owner}
		if _, err := s.Update(ctx, rec.Key, Armed, rec.Fence, ch); err != nil && !applied(ctx, s, rec, ch, err) {
			return Result{}, nil, raced(err, rec)
		}
		return Result{}, nil, fmt.Errorf("%w: key %q: its owner %s stopped after arming (fence %d) and no Reconcile hook can tell",
			ErrUnknown, rec.Key, rec.Owner, rec.Fence)
	}
	done, result, err := o.Reconcile(ctx, EffectKey(rec))
	if err != nil {
		return Result{}, nil, fmt.Errorf("idempotency: reconcile key %q: %w", rec.Key, err)
	}
	if done {
		ch := Change{State: Completed, Fence: rec.Fence, Owner: rec.Owner, Result: result, Retention: o.keep()}
		if len(result) > o.MaxResultSize || o.DiscardResult {
			ch.Result, ch.ResultDropped = nil, true
		}
		if _, err := s.Update(ctx, rec.Key, Armed, rec.Fence, ch); err != nil && !applied(ctx, s, rec, ch, err) {
			return Result{}, nil, raced(err, rec)
		}
		return Result{Value: result, Replayed: true, Fence: rec.Fence}, nil, nil
	}
	return takeOver(ctx, s, rec, takeover, o)
}

// takeOver moves rec, whose owner's lease expired, to this caller's claim.
// When the takeover's reply was lost, or the client library's resend of it
// was refused, the record tells: claimed under the takeover's fence and owner
// is this caller's own claim.
func takeOver(ctx context.Context, s Store, rec Record, takeover Change, o Options) (Result, *Record, error) {
	sent := time.Now()
	owned, err := s.Update(ctx, rec.Key, rec.State, rec.Fence, takeover)
	if err != nil && !refused(err) {
		// Detached: a takeover that landed as ctx ended is recognised, and
		// the arm step then releases it.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), o.CompleteTimeout)
		got, gerr := read(rctx, s, rec.Key)
		cancel()
		if gerr == nil && got.State == Claimed && got.Fence == takeover.Fence && got.Owner == takeover.Owner {
			return Result{}, &got, nil
		}
		if gerr != nil || !(errors.Is(err, fence.ErrStale) || errors.Is(err, ErrStateChanged)) {
			// Not an answer, and not found yet: it may still land.
			go settleClaim(ctx, s, rec.Key, takeover.Owner, o, sent)
		}
	}
	if err != nil {
		return Result{}, nil, raced(err, rec)
	}
	return Result{}, &owned, nil
}

// raced turns a lost compare-and-set into "in progress elsewhere": another
// caller changed the record first.
func raced(err error, rec Record) error {
	if errors.Is(err, fence.ErrStale) || errors.Is(err, ErrStateChanged) {
		return &InProgressError{Key: rec.Key, Owner: "another caller", LeaseLeft: 0}
	}
	return err
}

// run is the owner's path: arm, run the effect under a renewed lease, record.
func run(ctx context.Context, s Store, rec Record, effect Effect, o Options) (Result, error) {
	armed, sent, err := arm(ctx, s, rec, o)
	if err != nil {
		return Result{}, err
	}
	ek := EffectKey(armed)
	ectx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop, expired := renew(s, armed, o, sent, cancel)
	if expired(); errors.Is(context.Cause(ectx), fence.ErrLost) {
		// The arm's reply came after the lease's local deadline: another
		// caller may have taken the key over, and even completed it, in
		// the meantime. The effect never starts; the key is released if
		// it is still this caller's (a compare-and-set on its fence).
		stop()
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), o.CompleteTimeout)
		_ = release(cctx, s, armed, Armed)
		ccancel()
		return Result{}, fmt.Errorf("idempotency: key %q: not started, the arm's reply came after its lease's local deadline: %w", rec.Key, context.Cause(ectx))
	}
	returned := false
	defer func() {
		if !returned {
			// The effect panicked: it may have happened, so the record
			// stays armed. The panic goes on with its own stack.
			stop()
		}
	}()
	value, effErr := effect(effectContext{ectx, expired}, ek)
	returned = true
	stop()

	res := Result{Fence: rec.Fence, EffectKey: ek}
	var c *classified
	switch {
	case effErr == nil:
		ch := Change{State: Completed, Fence: rec.Fence, Owner: rec.Owner, Result: value, Retention: o.keep()}
		if len(value) > o.MaxResultSize || o.DiscardResult {
			ch.Result, ch.ResultDropped = nil, true
		}
		res.Value = value
		if err := record(ctx, s, rec, ch, o); err != nil {
			return res, err
		}
		return res, nil
	case errors.As(effErr, &c) && c.notSent:
		err := record(ctx, s, rec, Change{State: Released, Fence: rec.Fence, Owner: rec.Owner}, o)
		return res, errors.Join(c.err, err)
	case errors.As(effErr, &c) && c.definitive:
		err := record(ctx, s, rec, Change{State: Failed, Fence: rec.Fence, Owner: rec.Owner, Result: []byte(c.err.Error()), Retention: o.keep()}, o)
		return res, errors.Join(&FailedError{Key: rec.Key, Message: c.err.Error()}, c.err, err)
	default:
		// Ambiguous: the record stays armed; once its lease runs out, the next
		// caller reconciles it or marks it unknown. Never deleted.
		return res, fmt.Errorf("idempotency: key %q: the effect may have happened: %w", rec.Key, effErr)
	}
}

// record writes the owner's final change with a detached, bounded context,
// retrying transient failures. If it cannot, the record stays armed.
func record(ctx context.Context, s Store, rec Record, ch Change, o Options) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), o.CompleteTimeout)
	defer cancel()
	var err error
	for attempt := 0; ; attempt++ {
		_, err = s.Update(cctx, rec.Key, Armed, rec.Fence, ch)
		if err == nil || errors.Is(err, fence.ErrStale) || errors.Is(err, ErrStateChanged) || errors.Is(err, fence.ErrNotFound) {
			break
		}
		if (fence.Backoff{Min: 10 * time.Millisecond, Max: time.Second}).Sleep(cctx, attempt) != nil {
			// A try whose reply never came may still be on its way (held
			// in the network past CompleteTimeout) and land later: the
			// record stays armed, or becomes completed by this change.
			return fmt.Errorf("%w: key %q: %v (the record stays armed, unless a try still on its way records it): %w", ErrNotRecorded, rec.Key, err, fence.ErrUnknown)
		}
	}
	if err != nil {
		ok, rerr := settled(cctx, s, rec, ch, err)
		switch {
		case ok:
			return nil
		case rerr != nil && !errors.Is(rerr, fence.ErrNotFound):
			// The refusal may answer a resend of a try that landed
			// (its reply lost), and the record could not be read to
			// tell: it may hold this change.
			return fmt.Errorf("%w: key %q: %v, then reading it back: %v (a try whose reply was lost may have recorded it): %w", ErrNotRecorded, rec.Key, err, rerr, fence.ErrUnknown)
		}
		return fmt.Errorf("%w: key %q: %w", ErrNotRecorded, rec.Key, err)
	}
	return nil
}

// applied reports whether a change that failed (err: a lost reply, or a
// refusal as stale, another state, no record) is in fact this caller's own
// change, applied by a try whose reply was lost, or by the client library's
// own resend: the record holds the change's fence, owner, state and result. A released
// record that is gone was removed after the release (an armed one is never
// removed).
func applied(ctx context.Context, s Store, rec Record, ch Change, err error) bool {
	ok, _ := settled(ctx, s, rec, ch, err)
	return ok
}

// settled is applied, also returning the error of the read when the record
// could not be read (fence.ErrNotFound for no record): then whether the
// change landed is not known.
func settled(ctx context.Context, s Store, rec Record, ch Change, err error) (bool, error) {
	got, gerr := read(ctx, s, rec.Key)
	if ch.State == Released && errors.Is(gerr, fence.ErrNotFound) && errors.Is(err, fence.ErrNotFound) {
		return true, nil
	}
	return gerr == nil && got.Fence == ch.Fence && got.Owner == ch.Owner && got.State == ch.State &&
		(ch.State == Released || (bytes.Equal(got.Result, ch.Result) && got.ResultDropped == ch.ResultDropped)), gerr
}

// keep is the retention a completed or failed record gets at the store:
// zero, no end, for Forever.
func (o Options) keep() time.Duration {
	if o.Retention == Forever {
		return 0
	}
	return o.Retention
}

// read gets key's record, trying again after errors that are not an answer
// (a lost reply, a cut connection) until ctx ends.
func read(ctx context.Context, s Store, key string) (Record, error) {
	for attempt := 0; ; attempt++ {
		got, err := s.Get(ctx, key)
		if err == nil || errors.Is(err, fence.ErrNotFound) || errors.Is(err, fence.ErrInvalid) {
			return got, err
		}
		if (fence.Backoff{Min: 5 * time.Millisecond, Max: 200 * time.Millisecond}).Sleep(ctx, attempt) != nil {
			return got, err
		}
	}
}

// refused reports an answer after which a step certainly did not happen and
// cannot be this caller's own: bad input, or no record at all.
func refused(err error) bool {
	return errors.Is(err, fence.ErrInvalid) || errors.Is(err, fence.ErrNotFound)
}

// arm moves the claimed record to armed and returns it with the time the
// request that set its lease was sent. When the arm's outcome is unknown (its
// reply was lost), or it was refused as stale or in another state (which the
// client library's own resend of an applied arm also gets), it re-reads the
// record: armed under this claim's fence and owner means the arm landed, and
// a renewal confirms the lease; still claimed means it did not, and it is
// sent again. If ctx has ended by then, the key is released instead: the
// effect never ran. Anything else is another owner's.
func arm(ctx context.Context, s Store, rec Record, o Options) (Record, time.Time, error) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), o.CompleteTimeout)
	defer cancel()
	if ctx.Err() != nil {
		// The caller left while the claim was answered: never arm, and free
		// the key, whether or not the store would still take the arm.
		if !testbug.ClaimLeftHeld.Load() {
			_ = releaseUnstarted(cctx, s, rec, Claimed)
		}
		return Record{}, time.Time{}, fmt.Errorf("idempotency: key %q: not started: %w", rec.Key, context.Cause(ctx))
	}
	sent := time.Now() // the arm's lease starts no earlier than this
	ch := Change{State: Armed, Fence: rec.Fence, Owner: rec.Owner, Lease: o.Lease}
	armed, err := s.Update(ctx, rec.Key, Claimed, rec.Fence, ch)
	if err == nil || refused(err) {
		return armed, sent, err
	}
	first, firstSent := err, sent
	for attempt := 0; ; attempt++ {
		got, gerr := read(cctx, s, rec.Key)
		if gerr != nil {
			go settleArm(ctx, s, rec, o)
			return Record{}, sent, fmt.Errorf("idempotency: key %q: arming: %w, then reading it: %w (the effect did not run; the key is released in the background once the store answers)", rec.Key, first, gerr)
		}
		if got.Fence != rec.Fence || got.Owner != rec.Owner || (got.State != Claimed && got.State != Armed) {
			return Record{}, sent, raced(ErrStateChanged, rec)
		}
		if got.State == Armed && ctx.Err() == nil {
			// An arm whose reply was lost landed. Its lease counts from
			// the earliest send that may have set it, and may have run
			// out at the store already: another caller may then have
			// found the key abandoned and be taking it over, and an arm
			// sent again now would not stop that (a takeover expects
			// the same state and fence). The caller's check of the
			// local deadline decides whether the effect starts.
			return got, firstSent, nil
		}
		if ctx.Err() != nil {
			// The caller is gone: do not start the effect; free the key.
			var rerr error
			if got.State != Claimed || !testbug.ClaimLeftHeld.Load() {
				rerr = releaseUnstarted(cctx, s, rec, got.State)
			}
			return Record{}, sent, errors.Join(fmt.Errorf("idempotency: key %q: not started: %w", rec.Key, context.Cause(ctx)), rerr)
		}
		sent = time.Now()
		armed, err = s.Update(ctx, rec.Key, got.State, rec.Fence, ch)
		if err == nil || refused(err) {
			return armed, sent, err
		}
		if (fence.Backoff{Min: 5 * time.Millisecond, Max: 200 * time.Millisecond}).Sleep(cctx, attempt) != nil {
			go settleArm(ctx, s, rec, o)
			return Record{}, sent, fmt.Errorf("idempotency: key %q: arming: %w (the effect did not run; the key is released in the background once the store answers)", rec.Key, err)
		}
	}
}

// renew keeps the armed record's lease: the first renewal is due a third of
// the lease after sent (at once when the arm's reply came later than that),
// each next one within a third of the time left before the local deadline,
// never less than Lease/12 apart, and one that failed for a transient reason
// is retried sooner, until stopped. The effect's
// context is cancelled with fence.ErrLost when the record was taken over, when
// the in-progress ceiling passes, or when the local deadline passes without a
// confirmed renewal. The local deadline is measured from before the request that
// set the lease (sent, then each renewal's), less a drift margin, so the effect
// is cancelled before the store could let another owner take the key over.
//
// The caller's context does not stop renewals: the effect may still run after
// it ended (it is cancelled, but need not stop), and letting the lease lapse
// then would let another owner run the effect at the same time.
//
// expired cancels the effect at once when the local deadline has passed,
// reading the clock itself: the timer that otherwise does it may run late on
// a busy machine, after the store could have let another owner in.
func renew(s Store, rec Record, o Options, sent time.Time, cancel context.CancelCauseFunc) (stop, expired func()) {
	local := leasekit.New(rec.Key, rec.Fence, o.Lease, 0, sent)
	lost := func() {
		if errors.Is(context.Cause(local.Context()), fence.ErrLost) {
			cancel(fmt.Errorf("idempotency: key %q: lease not renewed before its local deadline: %w", rec.Key, fence.ErrLost))
		}
	}
	unwatch := context.AfterFunc(local.Context(), lost)
	expired = func() {
		// The lease's context reads the clock in Err.
		if local.Context().Err() != nil {
			lost()
		}
	}
	// Renewals are bounded by the local deadline (one that cannot finish
	// before it is useless) and stop.
	rctx, rcancel := context.WithCancel(local.Context())
	done := make(chan struct{})
	finished := make(chan struct{})
	interval := max(o.Lease/3, time.Millisecond)
	spacing := max(o.Lease/12, time.Millisecond)
	start := sent
	go func() {
		defer close(finished)
		// The first renewal is due a third of the lease after the arm was
		// sent, not after its reply: a late reply has used part of the lease.
		wait := min(interval, max(0, time.Until(local.LocalDeadline())-2*interval))
		for {
			t := time.NewTimer(wait)
			select {
			case <-done:
				t.Stop()
				return
			case <-local.Context().Done():
				t.Stop()
				return
			case <-t.C:
			}
			// A lease that ended as the timer fired is not renewed.
			if local.Context().Err() != nil {
				return
			}
			if time.Since(start) > o.InProgressCeiling {
				cancel(fmt.Errorf("idempotency: key %q in progress longer than %v: %w", rec.Key, o.InProgressCeiling, fence.ErrLost))
				return
			}
			sent := time.Now()
			_, err := s.Update(rctx, rec.Key, Armed, rec.Fence, Change{State: Armed, Fence: rec.Fence, Owner: rec.Owner, Lease: o.Lease})
			switch {
			case err == nil:
				local.Extend(sent)
				// Within a third of the time left: a drift margin or a slow
				// confirmation leaves less than two intervals after it.
				wait = min(interval, max(spacing, time.Until(local.LocalDeadline())/3))
			case errors.Is(err, fence.ErrStale) || errors.Is(err, ErrStateChanged) || errors.Is(err, fence.ErrNotFound):
				cancel(fmt.Errorf("idempotency: key %q taken over: %w", rec.Key, fence.ErrLost))
				return
			default:
				// Transient: try again soon; the local deadline cancels the
				// effect if no renewal gets through in time.
				wait = max(o.Lease/20, time.Millisecond)
			}
		}
	}()
	return func() {
		close(done)
		rcancel()
		<-finished
		unwatch()
		local.End(context.Canceled)
	}, expired
}

// effectContext is the effect's context: its Err reads the clock, so an
// effect that checks ctx.Err() learns that the lease's local deadline passed
// even before the timer behind Done has run. Done, and contexts derived from
// this one, wait for that timer.
type effectContext struct {
	context.Context
	expired func()
}

// Err returns the context's error, cancelling it first when the lease's local
// deadline has passed without a confirmed renewal.
func (c effectContext) Err() error {
	if err := c.Context.Err(); err != nil {
		return err
	}
	c.expired()
	return c.Context.Err()
}

// Resolve is the operator's way out of unknown: it sets key, in state unknown
// with fence f, to completed (with result), failed (with a message in result) or
// released (the effect did not happen; the key may be claimed again).
// retention is kept as Options.Retention is: zero means 24h, and Forever keeps
// the record without end.
func Resolve(ctx context.Context, s Store, key string, f fence.Token, to State, result []byte, retention time.Duration) error {
	if err := checkCall("resolve", ctx, s, key); err != nil {
		return err
	}
	if retention < 0 {
		return &fence.InvalidError{Op: "resolve", Arg: "retention", Reason: fmt.Sprintf("%v is negative", retention)}
	}
	switch to {
	case Completed, Failed, Released:
	default:
		return &fence.InvalidError{Op: "resolve", Arg: "state", Reason: fmt.Sprintf("%q is not completed, failed or released", to)}
	}
	if retention == 0 {
		retention = 24 * time.Hour
	}
	_, err := s.Update(ctx, key, Unknown, f, Change{State: to, Fence: f, Result: result, Retention: Options{Retention: retention}.keep()})
	return err
}
