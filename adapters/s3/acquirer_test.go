package s3fence_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/linetest"
)

func newAcquirer(t testing.TB, e *s3env) *s3fence.Acquirer {
	a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{Backoff: fence.Backoff{Min: 5 * time.Millisecond, Max: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// TestAcquirerConformance runs the acquirer suite on gofakes3 and on the real
// S3 server. S3 tells time in whole seconds, and a Date may be up to DateLag
// (2s by default) older still, so an expired lease is granted again up to 2s
// + 2 x DateLag = 6s after its ttl (counted from the grant's answer; a name's
// first grant also waits about 1s + DateLag for S3's clock before it
// answers), which the suite's StaleRenewKeepsNewHolder waits ShortTTL/2 for:
// the short ttl is 12s.
func TestAcquirerConformance(t *testing.T) {
	t.Parallel() // a server or bucket of its own
	servers(t, func(t *testing.T, e *s3env) {
		a := newAcquirer(t, e)
		fencetest.AcquirerSuite{Parallel: true,
			New: func(*testing.T) fence.Acquirer { return a },
			// Another process: an acquirer on a client (and connections) of its own.
			NewOther: func(t *testing.T) fence.Acquirer {
				c := s3.New(e.c.Options(), func(o *s3.Options) {
					o.HTTPClient = &http.Client{Transport: &http.Transport{}}
				})
				return newAcquirer(t, &s3env{c: c, bucket: e.bucket})
			},
			Faulty:   faultyAcquirer(e),
			ShortTTL: 2 * (2*time.Second + 2*s3fence.DefaultDateLag),
			// Renewals are conditional PUTs to a server process that
			// shares the two CPUs: on versitygw under load a Hold
			// lost its 5s lease, no renewal confirmed within two thirds
			// of it. The renewing cases run on 10s leases.
			RenewTTL: 10 * time.Second,
			MaxTTL:   s3fence.MaxAcquirerTTL,
			BadNames: []string{"nul\x00", "bad \xff", "a//b", "a/./b", "x/../b", "a/b/", "./a", "/a", ".."},
			// Waiters poll: keep the contention test small.
			Workers: 4, Increments: 5,
			// The name's lock object deleted, as a lifecycle rule or an
			// operator would: it holds the holder, the expiry and the counter.
			DeleteState: func(t *testing.T, name string) {
				if _, err := e.c.DeleteObject(context.Background(), &s3.DeleteObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("fencekit-locks/" + name)}); err != nil {
					t.Fatalf("deleting the lock object of %q: %v", name, err)
				}
			},
		}.Run(t)
	})
}

// TestAcquirerFaults: a grant whose answer was lost is recognised as ours by
// its nonce; 409, 412 and 500 on the grant's PUT make it read and try again;
// a renewal and a release whose answers were lost are recognised too.
func TestAcquirerFaults(t *testing.T) {
	t.Parallel() // a server or bucket of its own
	faultServers(t, testAcquirerFaults)
}

func testAcquirerFaults(t *testing.T, e *s3env, f *faults) {
	a := newAcquirer(t, e)
	ctx := context.Background()
	for _, kind := range []string{"drop-response", "409", "412", "500"} {
		// The fault on the PUT that creates the new lock object (free):
		// the grant still follows.
		f.inject(kind)
		if l, err := a.TryAcquire(ctx, fencetest.Name("fault"), 10*time.Second); err != nil {
			t.Fatalf("grant after an injected %s on the creating PUT: %v", kind, err)
		} else {
			_ = l.Release(ctx)
		}
		// The fault on the grant's PUT, after the one that creates the object.
		name := fencetest.Name("fault")
		f.inject("", kind)
		before := f.puts.Load()
		l, err := a.TryAcquire(ctx, name, 10*time.Second)
		if err != nil {
			t.Fatalf("grant after an injected %s: %v", kind, err)
		}
		if n := f.puts.Load() - before - 1; (kind == "drop-response" && n != 1) || (kind != "drop-response" && n != 2) {
			t.Errorf("%s: %d grant PUTs (want 1 for a landed grant recognised by its nonce, 2 otherwise)", kind, n)
		}
		if _, err := a.TryAcquire(ctx, name, 10*time.Second); !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("after the %s grant: %v, want ErrHeld", kind, err)
		}
		if l.Token() < 1e15 || l.Token()%1e6 != 0 {
			t.Errorf("%s: token %d for a new name, want S3's clock in whole seconds, in microseconds", kind, l.Token())
		}
		f.inject("drop-response")
		if err := l.Renew(ctx); err != nil {
			t.Fatalf("renew whose answer was lost (%s case): %v", kind, err)
		}
		f.inject("drop-response")
		if err := l.Release(ctx); err != nil {
			t.Fatalf("release whose answer was lost (%s case): %v", kind, err)
		}
		if info, err := a.Inspect(ctx, name); err != nil || info.Held || info.Counter != l.Token() {
			t.Errorf("%s: after the release: %+v, %v; want free with counter %d: the release kept the counter", kind, info, err, l.Token())
		}
		l2, err := a.TryAcquire(ctx, name, 10*time.Second)
		if err != nil || l2.Token() <= l.Token() {
			t.Fatalf("after the release: %v, token %v", err, l2)
		}
		// The counter plus one, or the grant's Date (whole seconds, in
		// microseconds) when that is above it.
		if l2.Token() != l.Token()+1 && (l2.Token() < l.Token()+1 || l2.Token()%1e6 != 0) {
			t.Errorf("%s: the token after one grant and a release is %d, want %d or a later Date in microseconds: the release kept the counter", kind, l2.Token(), l.Token()+1)
		}
		_ = l2.Release(ctx)
	}
}

// TestLockObjectABA: every write of the lock object has a new ETag (the body
// holds a random nonce), so a PUT conditional on an ETag read before a
// release and a new grant fails, even though the name is free again.
func TestLockObjectABA(t *testing.T) { servers(t, testLockObjectABA) }

func testLockObjectABA(t *testing.T, e *s3env) {
	a := newAcquirer(t, e)
	ctx := context.Background()
	name := fencetest.Name("aba")
	key := "fencekit-locks/" + name
	l1, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = l1.Release(ctx)
	head, err := e.c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key)})
	if err != nil {
		t.Fatal(err)
	}
	l2, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_ = l2.Release(ctx)
	head2, _ := e.c.HeadObject(ctx, &s3.HeadObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key)})
	if aws.ToString(head.ETag) == aws.ToString(head2.ETag) {
		t.Fatalf("two released states of the lock share the ETag %s", aws.ToString(head.ETag))
	}
	_, err = e.c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String(e.bucket), Key: aws.String(key),
		Body: bytes.NewReader([]byte(`{"fencekit":"lock-v1","token":1,"holder":"stale"}`)), IfMatch: head.ETag})
	if err == nil {
		t.Fatal("a PUT conditional on the lock's ETag from before a newer grant was accepted")
	}
	info, err := a.Inspect(ctx, name)
	if err != nil || info.Held || info.Counter != l2.Token() {
		t.Errorf("Inspect after the stale PUT: %+v, %v", info, err)
	}
}

// TestAcquirerClockSkew: the server's clock, as its Date header tells it, is
// minutes off from the client's. Expiry is decided on the server's clock and
// the time since its answers, never on the client's wall clock: a lease is
// neither taken over early nor held for minutes.
func TestAcquirerClockSkew(t *testing.T) {
	t.Parallel() // a server or bucket of its own
	faultServers(t, testClockSkew)
}

func testClockSkew(t *testing.T, e *s3env, f *faults) {
	a := newAcquirer(t, e)
	ctx := context.Background()
	for _, off := range []time.Duration{10 * time.Minute, -10 * time.Minute} {
		f.clockOffset.Store(int64(off))
		name := fencetest.Name("skew")
		l1, err := a.TryAcquire(ctx, name, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.TryAcquire(ctx, name, 2*time.Second); !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("server clock %v off: a second grant at once: %v, want ErrHeld", off, err)
		}
		renewSent := time.Now()
		if err := l1.Renew(ctx); err != nil {
			t.Fatalf("server clock %v off: renew: %v", off, err)
		}
		renewed := time.Now()
		time.Sleep(time.Second) // a time within the renewed lease, not a synchronisation
		if _, err := a.TryAcquire(ctx, name, 2*time.Second); !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("server clock %v off: a grant within the renewed lease: %v, want ErrHeld", off, err)
		}
		l2, err := a.Acquire(ctx, name, 2*time.Second)
		if err != nil {
			t.Fatalf("server clock %v off: waiting for the expiry: %v", off, err)
		}
		granted := time.Now()
		// The renewal holds the lock for its ttl from when S3 received it
		// (after renewSent), and S3's Date (whole seconds, up to DateLag
		// older still) frees it at most 2s + 2 x DateLag after its expiry;
		// allow 1s more for the polls of a loaded machine.
		if early := renewSent.Add(2 * time.Second); granted.Before(early) {
			t.Errorf("server clock %v off: granted %v after the renewal was sent, within its 2s ttl", off, granted.Sub(renewSent))
		}
		if late := renewed.Add(2*time.Second + 2*time.Second + 2*s3fence.DefaultDateLag + time.Second); granted.After(late) {
			t.Errorf("server clock %v off: granted %v after the renewal's answer, over its 2s ttl plus S3's 2s + 2 x DateLag plus 1s", off, granted.Sub(renewed))
		}
		if l2.Token() <= l1.Token() || l1.Context().Err() == nil {
			t.Errorf("server clock %v off: token %d (first %d); the first lease's context done: %v",
				off, l2.Token(), l1.Token(), l1.Context().Err() != nil)
		}
		_ = l2.Release(ctx)
	}
	f.clockOffset.Store(0)
}

// TestAcquirerPutWithoutDate: a server (or a proxy) whose answers to PUTs
// carry no Date header leaves the acquirer with S3's time from its last read.
// A renewal then still records an expiry past the holder's local deadline, so
// a second grant waits for it.
func TestAcquirerPutWithoutDate(t *testing.T) { faultServers(t, testPutWithoutDate) }

func testPutWithoutDate(t *testing.T, e *s3env, f *faults) {
	a := newAcquirer(t, e)
	ctx := context.Background()
	f.noDate.Store(true)
	defer f.noDate.Store(false)
	name := fencetest.Name("nodate")
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if err := l.Renew(ctx); err != nil {
			t.Fatalf("renew %d: %v", i, err)
		}
		if l2, err := a.TryAcquire(ctx, name, 10*time.Second); !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("after renewal %d with no Date on the PUT's answer, a second grant: %v (token %v), want ErrHeld", i, err, l2)
		}
	}
	if l.Context().Err() != nil {
		t.Errorf("the lease ended: %v", context.Cause(l.Context()))
	}
	if err := l.Release(ctx); err != nil {
		t.Errorf("release: %v", err)
	}
}

func TestAcquirerBadOptions(t *testing.T) {
	e := fakeS3(t)
	for _, o := range []*s3fence.AcquirerOptions{{Drift: -1}, {MaxAttempts: -1}, {Backoff: fence.Backoff{Min: -1}}, {Prefix: "bad\x00"}} {
		if _, err := s3fence.NewAcquirer(e.c, e.bucket, o); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("options %+v: %v", o, err)
		}
	}
	if _, err := s3fence.NewAcquirer(nil, "b", nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("nil api: %v", err)
	}
	a := newAcquirer(t, e)
	if _, err := a.TryAcquire(context.Background(), "n", 500*time.Millisecond); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("ttl below a second: %v", err)
	}
}

// TestLockObjectDeleted: holder A has token 2 and stalls; its lock
// object is deleted (a lifecycle rule, an operator); B is granted the name and
// writes a fresh key through the fenced writer. B's token must be above A's, so
// A's late write is refused as stale instead of overwriting B's.
func TestLockObjectDeleted(t *testing.T) { servers(t, testLockObjectDeleted) }

func testLockObjectDeleted(t *testing.T, e *s3env) {
	a := newAcquirer(t, e)
	w := newWriter(t, e, nil)
	ctx := context.Background()
	name := fencetest.Name("deleted")
	first, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	holderA, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	// A stalls; the lock object is deleted behind its back.
	if _, err := e.c.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("fencekit-locks/" + name)}); err != nil {
		t.Fatal(err)
	}
	holderB, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatalf("grant after the lock object was deleted: %v", err)
	}
	defer holderB.Release(ctx)
	if holderB.Token() <= holderA.Token() {
		t.Errorf("after the lock object was deleted the new grant has token %d, not above the stalled holder's %d", holderB.Token(), holderA.Token())
	}
	key := fencetest.Name("fresh")
	if err := w.Write(ctx, key, []byte("B"), holderB.Token()); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("A, late"), holderA.Token()); !errors.Is(err, fence.ErrStale) {
		t.Errorf("the stalled holder's write over the new holder's: %v, want ErrStale", err)
	}
	if v, tok, err := w.Read(ctx, key); err != nil || string(v) != "B" || tok != holderB.Token() {
		t.Errorf("stored %q token %d (%v); want B's write, token %d", v, tok, err, holderB.Token())
	}
}

// TestLateRenewFreedWithinClockSlack: what the suite's LateRenewHoldsNothing
// does not bound. After a Renew sent once the lease's context has ended
// (ErrLost), the name is granted by the time the original lease runs out on
// S3's clock (up to 2s + 2 x DateLag late, S3's Date having whole seconds
// and being up to DateLag older still), counted from the grant (the suite
// counts half its 24s ttl from the Renew), on a name whose lock object
// exists (the suite's first grant of a fresh name also waits for S3's
// clock), and the next token is above the renewed lease's.
func TestLateRenewFreedWithinClockSlack(t *testing.T) {
	t.Parallel() // a server or bucket of its own
	servers(t, testLateRenewFreedWithinClockSlack)
}

func testLateRenewFreedWithinClockSlack(t *testing.T, e *s3env) {
	a := newAcquirer(t, e)
	ctx := context.Background()
	name := fencetest.Name("late-renew")
	// Longer than 2s + 2 x DateLag and the 1.5s allowed for a loaded
	// machine, so that a renewal that landed (holding the lock until about
	// start+2*ttl) would be told from the original lease's expiry.
	const ttl = 10 * time.Second
	// The name's lock object exists before the timed grant.
	l0, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	_ = l0.Release(ctx)
	start := time.Now()
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	<-l.Context().Done()
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("renew after the local deadline: %v, want ErrLost", err)
	}
	// The original lease ends on S3's clock by start+ttl; S3's Date grants it
	// up to 2s + 2 x DateLag later (allow 1.5s more for a loaded machine). A
	// renewal that landed would hold it until about start+2*ttl.
	wctx, cancel := context.WithDeadline(ctx, start.Add(ttl+2*time.Second+2*s3fence.DefaultDateLag+1500*time.Millisecond))
	defer cancel()
	l2, err := a.Acquire(wctx, name, ttl)
	if err != nil {
		t.Fatalf("another acquirer, within the original lease's ttl (and S3's 2s + 2 x DateLag): %v", err)
	}
	if l2.Token() <= l.Token() {
		t.Errorf("token %d not above %d", l2.Token(), l.Token())
	}
	_ = l2.Release(ctx)
}

// TestAbandonedGrant: a TryAcquire that gives up after a
// grant's PUT whose answer was lost leaves no lock behind for its ttl: when
// the PUT landed (its answer lost, then the caller's context ended), the
// grant is released in the background; when the PUT is still on its way and
// lands only after the caller gave up, it is refused, since the cleanup wrote
// over the ETag (here: the absence) it was conditional on.
func TestAbandonedGrant(t *testing.T) {
	t.Parallel() // a server or bucket of its own
	faultServers(t, testAbandonedGrant)
}

func testAbandonedGrant(t *testing.T, e *s3env, f *faults) {
	a, b := newAcquirer(t, e), newAcquirer(t, e)
	ctx := context.Background()
	const ttl = 60 * time.Second

	t.Run("landed", func(t *testing.T) {
		name := fencetest.Name("abandoned")
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		f.mu.Lock()
		f.afterDrop = cancel // the PUT landed, its answer is lost, the caller gives up
		f.mu.Unlock()
		defer func() { f.mu.Lock(); f.afterDrop = nil; f.mu.Unlock() }()
		f.inject("drop-response")
		if l, err := a.TryAcquire(cctx, name, ttl); err == nil {
			t.Fatalf("granted %d with its context cancelled", l.Token())
		}
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		defer wcancel()
		l, err := b.Acquire(wctx, name, ttl)
		if err != nil {
			t.Fatalf("after an abandoned grant whose PUT landed: %v (the ttl is %v)", err, ttl)
		}
		_ = l.Release(ctx)
	})

	t.Run("lands-late", func(t *testing.T) {
		name := fencetest.Name("late")
		f.release, f.landed, f.held = make(chan int), make(chan int, 1), make(chan struct{}, 1)
		defer func() { f.held = nil }()
		f.inject("", "hold") // the grant's PUT, after the one creating the object
		// Long enough for the creation's wait for S3's clock (1s + DateLag)
		// before the grant's PUT, with 4s to spare for a loaded machine (CI
		// run d5 hung here on versitygw: the context ended before the grant's
		// PUT was sent, and nothing was ever held).
		cctx, cancel := context.WithTimeout(ctx, 6*time.Second+s3fence.DefaultDateLag)
		defer cancel()
		granted := make(chan fence.Lease, 1)
		go func() {
			l, _ := a.TryAcquire(cctx, name, ttl)
			granted <- l
		}()
		select {
		case <-f.held:
		case l := <-granted:
			t.Fatalf("TryAcquire returned (lease %v) before its grant's PUT was sent: the test did not test it", l)
		}
		// The new lock object, free, as the held grant's PUT found it.
		created, err := b.Inspect(ctx, name)
		if err != nil || created.Held {
			t.Fatalf("the created lock object: %+v, %v", created, err)
		}
		if l := <-granted; l != nil {
			t.Fatalf("granted %d while its PUT was held", l.Token())
		}
		// The cleanup runs in the background: wait until it has written the
		// lock object (free, with the abandoned grant's counter), then let the
		// held PUT land.
		deadline := time.Now().Add(15 * time.Second)
		for {
			info, err := b.Inspect(ctx, name)
			if err == nil && !info.Held && info.Counter > created.Counter {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("no cleanup of the abandoned grant within 15s: %+v, %v", info, err)
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		f.release <- 1
		if code := <-f.landed; code != http.StatusPreconditionFailed {
			t.Errorf("the abandoned grant's late PUT was answered %d, want 412", code)
		}
		l, err := b.TryAcquire(ctx, name, ttl)
		if err != nil {
			t.Fatalf("after the abandoned grant's PUT landed late: %v (the ttl is %v)", err, ttl)
		}
		_ = l.Release(ctx)
	})
}

// TestNamesByteForByte: lock names that differ only in a trailing
// space, case, a 4-byte character or the last byte of the longest key are
// separate lock objects, each exclusive with itself.
func TestNamesByteForByte(t *testing.T) {
	t.Parallel() // a server or bucket of its own
	servers(t, testNamesByteForByte)
}

func testNamesByteForByte(t *testing.T, e *s3env) {
	a := newAcquirer(t, e)
	ctx := context.Background()
	run := fencetest.Name("names") + "-"
	// The longest key, in segments of 200 bytes: versitygw's posix backend
	// refuses a segment over 255 bytes (KeyTooLongError).
	long := strings.Repeat(strings.Repeat("n", 199)+"/", 4)
	long += strings.Repeat("n", s3fence.MaxKeyBytes-len("fencekit-locks/")-len(run)-len(long)-1)
	groups := [][]string{
		{"job", "job ", "job\t"},
		{"X\U0001F600", "X????", "X\uFFFD"},
		{long + "a", long + "b"},
		{"Case", "case", "ß", "ss"},
	}
	// The leases outlive a group's grants on a loaded machine: each first
	// grant of a name waits for S3's clock, and a group of four can take over
	// 10s, so with a shorter ttl its first leases were lost before the release.
	const ttl = time.Minute
	for _, names := range groups {
		var held []fence.Lease
		for _, n := range names {
			l, err := a.TryAcquire(ctx, run+n, ttl)
			if err != nil {
				t.Fatalf("%q while %d others of %q are held: %v, want a grant (a separate lock)", n, len(held), names, err)
			}
			held = append(held, l)
			if _, err := a.TryAcquire(ctx, run+n, ttl); !errors.Is(err, fence.ErrHeld) {
				t.Fatalf("%q a second time: %v, want ErrHeld", n, err)
			}
		}
		for _, l := range held {
			if err := l.Release(ctx); err != nil {
				t.Errorf("release %q: %v", l.Name(), err)
			}
		}
	}
}

// TestCreationRace: a grant that found no lock object writes a
// new one with If-None-Match: *, its token taken from the Date of that read.
// When its PUT is slow on the way (or the creation waits its second) while
// another acquirer creates the object, grants from it twice and the object is
// then deleted, the slow PUT lands on the absent object. Its token must still
// be above every token the deleted object handed out: here the second grant
// (paused) would otherwise win over the new holder's writes.
func TestCreationRace(t *testing.T) { faultServers(t, testCreationRace) }

func testCreationRace(t *testing.T, e *s3env, f *faults) {
	slow, other := newAcquirer(t, e), newAcquirer(t, e)
	w := newWriter(t, e, nil)
	ctx := context.Background()
	name := fencetest.Name("creation")
	const ttl = 30 * time.Second

	f.release, f.landed, f.held = make(chan int), make(chan int, 1), make(chan struct{}, 1)
	defer func() { f.held = nil }()
	f.inject("hold")
	type result struct {
		l   fence.Lease
		err error
	}
	res := make(chan result, 1)
	go func() {
		l, err := slow.TryAcquire(ctx, name, ttl)
		res <- result{l, err}
	}()
	<-f.held // the slow grant's creating PUT is on its way

	first, err := other.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	paused, err := other.TryAcquire(ctx, name, ttl) // stalls from here on
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("fencekit-locks/" + name)}); err != nil {
		t.Fatal(err)
	}
	f.release <- 1
	<-f.landed
	r := <-res
	if r.err != nil {
		// Refusing the late creation is safe; a new grant must then be
		// above the paused holder's token.
		l, err := slow.TryAcquire(ctx, name, ttl)
		if err != nil {
			t.Fatalf("after the slow creation (%v): %v", r.err, err)
		}
		r.l = l
	}
	defer r.l.Release(ctx)
	if r.l.Token() <= paused.Token() {
		t.Errorf("the grant after the lock object was deleted has token %d, not above the paused holder's %d (and the first grant's %d)", r.l.Token(), paused.Token(), first.Token())
	}
	key := fencetest.Name("fresh")
	if err := w.Write(ctx, key, []byte("new"), r.l.Token()); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("paused, late"), paused.Token()); !errors.Is(err, fence.ErrStale) {
		t.Errorf("the paused holder's write over the new holder's: %v, want ErrStale", err)
	}
}

// TestTTLNotAboveDrift: a ttl that the acquirer's Drift uses up
// entirely is refused with ErrInvalid naming the ttl, instead of a lease whose
// context is already done returned with a nil error while the lock object
// stays held for nobody.
func TestTTLNotAboveDrift(t *testing.T) {
	e := fakeS3(t)
	a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{Drift: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	fencetest.DriftRefusesShortTTL(t, a, 5*time.Second, "ttl")
}

// TestReleaseUnconfirmed: a Release whose PUT got a 500 (it
// may or may not have landed; here it did not) and whose read to find out
// fails too cannot know whether the lock is free. It must say so
// (ErrUnknown), and the lock must not stay held by nobody for its ttl: another
// acquirer is granted well before it.
func TestReleaseUnconfirmed(t *testing.T) { faultServers(t, testReleaseUnconfirmed) }

func testReleaseUnconfirmed(t *testing.T, e *s3env, f *faults) {
	a, b := newAcquirer(t, e), newAcquirer(t, e)
	ctx := context.Background()
	const ttl = 60 * time.Second
	name := fencetest.Name("unconfirmed")
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	f.inject("500")
	f.failGets.Store(true)
	err = l.Release(ctx)
	f.failGets.Store(false)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("release after a 500 and a failed read: %v, want ErrUnknown", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	l2, err := b.Acquire(wctx, name, ttl)
	if err != nil {
		t.Fatalf("after a release that could not be confirmed: %v (the ttl is %v)", err, ttl)
	}
	_ = l2.Release(ctx)
}

// TestRenewUnconfirmed: a Renew whose PUT got a 500 (it may have
// landed) and whose read to find out fails returns ErrUnknown, not a bare
// transport error; the lease still ends at its local deadline.
func TestRenewUnconfirmed(t *testing.T) { faultServers(t, testRenewUnconfirmed) }

func testRenewUnconfirmed(t *testing.T, e *s3env, f *faults) {
	a := newAcquirer(t, e)
	ctx := context.Background()
	l, err := a.TryAcquire(ctx, fencetest.Name("renew-unconfirmed"), 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	f.inject("500")
	f.failGets.Store(true)
	err = l.Renew(ctx)
	f.failGets.Store(false)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("renew after a 500 and a failed read: %v, want ErrUnknown", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Errorf("release: %v", err)
	}
}

// TestLateRenewalReleaseFails: a renewal that S3 confirms only
// after the lease's local deadline passed is undone with a release; when that
// release's PUT fails (a 500 that did not land), the lock must still not stay
// held by nobody for the renewal's ttl.
func TestLateRenewalReleaseFails(t *testing.T) { faultServers(t, testLateRenewalReleaseFails) }

func testLateRenewalReleaseFails(t *testing.T, e *s3env, f *faults) {
	b := newAcquirer(t, e)
	ctx := context.Background()
	const ttl = 60 * time.Second
	// A 60s lease whose local deadline is 2s away (Drift 58s): it passes
	// while the renewal is held.
	a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{Drift: ttl - 2*time.Second})
	if err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("late-renewal")
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	f.release, f.landed, f.held = make(chan int), make(chan int, 1), make(chan struct{}, 1)
	defer func() { f.held = nil }()
	f.inject("hold", "500")
	renewed := make(chan error, 1)
	go func() { renewed <- l.Renew(ctx) }()
	<-f.held
	<-l.Context().Done() // the local deadline passes with the renewal on its way
	f.release <- 1
	<-f.landed
	if err := <-renewed; !errors.Is(err, fence.ErrLost) {
		t.Errorf("renewal confirmed after the local deadline: %v, want ErrLost", err)
	}
	// The renewal holds the lock for a ttl on S3; its undoing failed once.
	// The name must be free long before that ttl passes.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	l2, err := b.Acquire(wctx, name, ttl)
	if err != nil {
		t.Fatalf("after a late renewal whose release failed once: %v", err)
	}
	_ = l2.Release(ctx)
}

// TestMaxAttemptsOneNewName: with MaxAttempts 1 (no retries), a new name is
// granted by one TryAcquire: creating its lock object is no retry.
func TestMaxAttemptsOneNewName(t *testing.T) {
	e := fakeS3(t)
	a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	l, err := a.TryAcquire(context.Background(), fencetest.Name("once"), 5*time.Second)
	if err != nil {
		t.Fatalf("MaxAttempts 1, a new name: %v", err)
	}
	_ = l.Release(context.Background())
}

// TestAcquireLineOrder: the waiting Acquire calls of one acquirer are granted
// in the order they began, and a holder that releases and asks again joins at
// the back (linetest.Order).
func TestAcquireLineOrder(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		a := newAcquirer(t, e)
		// A grant statement slower than wakeup.Stall on a loaded machine lets
		// the waiters behind the head try out of turn, by design (the same check
		// once saw [0 4 1 2 3 -1] on PostgreSQL); the order itself is what is
		// checked here.
		s3fence.SetLineStall(a, time.Minute)
		linetest.Order(t, a, func(name string) int { return s3fence.LineLen(a, name) }, time.Minute)
	})
}

// staleLag is how much older than the server's clock the Date headers of the
// stale tests are: within the default DateLag (2s), and more than the
// whole second that a Date's truncation alone accounts for.
const staleLag = 1900 * time.Millisecond

// otherAcquirer is an acquirer on a client (and connections) of its own, as in
// another process, through the same server (and fault proxy) as e.
func otherAcquirer(t testing.TB, e *s3env) *s3fence.Acquirer {
	c := s3.New(e.c.Options(), func(o *s3.Options) {
		o.HTTPClient = &http.Client{Transport: &http.Transport{}}
	})
	return newAcquirer(t, &s3env{c: c, bucket: e.bucket})
}

// atFraction waits until the local clock's fraction of a second is frac, so
// that a Date staleLag old, truncated, is as far behind as it can be.
func atFraction(frac time.Duration) {
	now := time.Now()
	wait := frac - now.Sub(now.Truncate(time.Second))
	if wait < 0 {
		wait += time.Second
	}
	time.Sleep(wait)
}

// TestAcquirerStaleDate: the server caches its Date header, so a Date can be
// older than its truncation to whole seconds (staleLag, 1.9s, within the
// default DateLag). A takes the lock on a read whose Date is that stale; then
// the Dates are fresh, and B waits for the lock. A's expiry must not be early
// by the Date's age: when B's Acquire returns, A's lease context is already
// done. (With only a second for the truncation, A's expiry was up to 1.9s
// early, and B was granted while A's context was live.)
func TestAcquirerStaleDate(t *testing.T) { faultServers(t, testStaleDate) }

func testStaleDate(t *testing.T, e *s3env, f *faults) {
	a, b := newAcquirer(t, e), otherAcquirer(t, e)
	ctx := context.Background()
	name := fencetest.Name("stale-date")
	const ttl = 2 * time.Second
	f.ownDate.Store(true)
	defer f.ownDate.Store(false)
	defer f.dateLag.Store(0)
	// The lock object exists (and is free) before the timed grant.
	l0, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := l0.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// A's read sees a Date 1.9s old, taken just before a whole second: the
	// Date is then nearly 2.9s behind the server's clock.
	f.dateLag.Store(int64(staleLag))
	atFraction(850 * time.Millisecond)
	la, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	answered := time.Now()
	defer la.Release(ctx)
	f.dateLag.Store(0)

	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	lb, err := b.Acquire(wctx, name, 10*time.Second)
	granted := time.Now()
	if err != nil {
		t.Fatalf("B waiting for A's expired lease: %v", err)
	}
	aDone := la.Context().Err() != nil
	defer lb.Release(ctx)
	if !aDone {
		t.Errorf("B was granted %v after A's grant was answered, while A's %v lease context was still live: A's expiry, computed from a Date %v old, was early",
			granted.Sub(answered).Round(time.Millisecond), ttl, staleLag)
	}
	if lb.Token() <= la.Token() {
		t.Errorf("B's token %d not above A's %d", lb.Token(), la.Token())
	}
	// The promise's other side: an expired lock is granted again at most 2s
	// + 2 x DateLag after its ttl; allow 1s more for the polls of a loaded
	// machine.
	if late := answered.Add(ttl + 2*time.Second + 2*s3fence.DefaultDateLag + time.Second); granted.After(late) {
		t.Errorf("B was granted %v after A's grant was answered: over the %v ttl plus 2s + 2 x DateLag plus 1s", granted.Sub(answered).Round(time.Millisecond), ttl)
	}
}

// TestLockObjectDeletedStaleDate: a lock object is created, granted
// and deleted within a second or two; the next grant creates a new object and
// reads it with a Date staleLag old (within the default DateLag). Its first
// token must still be above the deleted object's: a token from the second
// after that Date alone (no DateLag) is below it, and the deleted object's
// stalled holder would win over the new holder's writes.
func TestLockObjectDeletedStaleDate(t *testing.T) { faultServers(t, testLockObjectDeletedStaleDate) }

func testLockObjectDeletedStaleDate(t *testing.T, e *s3env, f *faults) {
	a := newAcquirer(t, e)
	w := newWriter(t, e, nil)
	ctx := context.Background()
	name := fencetest.Name("deleted-stale")
	f.ownDate.Store(true)
	defer f.ownDate.Store(false)
	defer f.dateLag.Store(0)
	holderA, err := a.TryAcquire(ctx, name, 30*time.Second) // a new object: its token is from S3's clock
	if err != nil {
		t.Fatal(err)
	}
	defer holderA.Release(ctx)
	if _, err := e.c.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("fencekit-locks/" + name)}); err != nil {
		t.Fatal(err)
	}
	f.dateLag.Store(int64(staleLag))
	holderB, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatalf("grant after the lock object was deleted: %v", err)
	}
	defer holderB.Release(ctx)
	f.dateLag.Store(0)
	if holderB.Token() <= holderA.Token() {
		t.Errorf("the new object's first grant, read with a Date %v old, has token %d, not above the deleted object's %d", staleLag, holderB.Token(), holderA.Token())
	}
	key := fencetest.Name("fresh")
	if err := w.Write(ctx, key, []byte("B"), holderB.Token()); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("A, late"), holderA.Token()); !errors.Is(err, fence.ErrStale) && holderB.Token() > holderA.Token() {
		t.Errorf("the stalled holder's write over the new holder's: %v, want ErrStale", err)
	}
}

// TestAcquirerDateLagOptions: a negative DateLag, or one above
// MaxDateLag, is refused with ErrInvalid naming DateLag; zero (the default),
// a nanosecond (no lag beyond whole seconds) and MaxDateLag are taken.
func TestAcquirerDateLagOptions(t *testing.T) {
	e := fakeS3(t)
	for _, lag := range []time.Duration{-1, -time.Second, s3fence.MaxDateLag + 1, 1<<63 - 1} {
		_, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{DateLag: lag})
		var ie *fence.InvalidError
		if !errors.Is(err, fence.ErrInvalid) || !errors.As(err, &ie) || ie.Arg != "DateLag" {
			t.Errorf("DateLag %v: %v, want ErrInvalid naming DateLag", lag, err)
		}
	}
	for _, lag := range []time.Duration{0, time.Nanosecond, s3fence.MaxDateLag} {
		if _, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{DateLag: lag}); err != nil {
			t.Errorf("DateLag %v: %v", lag, err)
		}
	}
}
