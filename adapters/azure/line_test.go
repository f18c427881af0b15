package azfence_test

// The in-process waiter line of the Azure acquirer (its waiters queue on a
// wakeup.Line and the head tries first when a release pokes it): the cases
// the object-store adapters share (internal/linetest), against Azurite.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/linetest"
)

// lineLen is azfence.LineLen for the shared cases.
func lineLen(a fence.Acquirer, name string) int { return azfence.LineLen(a.(*azfence.Acquirer), name) }

// acquirerOf returns the factory of acquirers on c (the zero options:
// newAcquirer's).
func acquirerOf(c *container.Client) linetest.NewAcquirer {
	return linetest.Factory(func(t *testing.T) *azfence.Acquirer { return newAcquirer(t, c) },
		func(o linetest.Options) (*azfence.Acquirer, error) {
			return azfence.NewAcquirer(c, &azfence.AcquirerOptions{MaxAttempts: o.MaxAttempts, Backoff: o.Backoff})
		})
}

// releases is a transport that acts on the lease releases of one blob:
// while armed, the first fail of them get no answer (not sent: an error
// from the transport), and the next is held until a value arrives on
// release; its status then goes to landed.
type releases struct {
	next    http.RoundTripper
	mu      sync.Mutex
	blob    string
	fail    int
	hold    bool
	held    chan struct{}
	release chan struct{}
	landed  chan int
}

func (h *releases) arm(blob string, fail int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.blob, h.fail, h.hold = blob, fail, true
	h.held, h.release, h.landed = make(chan struct{}, 1), make(chan struct{}), make(chan int, 1)
}

func (h *releases) RoundTrip(r *http.Request) (*http.Response, error) {
	h.mu.Lock()
	mine := h.blob != "" && strings.HasSuffix(r.URL.Path, "/"+h.blob) && strings.EqualFold(leaseAction(r), "release")
	var fail, hold bool
	if mine && h.fail > 0 {
		h.fail--
		fail = true
	} else if mine && h.hold {
		h.hold = false
		hold = true
	}
	held, release, landed := h.held, h.release, h.landed
	h.mu.Unlock()
	switch {
	case fail:
		return nil, errors.New("injected: no answer")
	case hold:
		held <- struct{}{}
		<-release
		resp, err := h.next.RoundTrip(r)
		code := 0
		if resp != nil {
			code = resp.StatusCode
		}
		landed <- code
		return resp, err
	}
	return h.next.RoundTrip(r)
}

// stalledAcquire is a transport that holds the next lease acquire of one
// blob, unsent, until its request's context ends (then it fails with the
// context's error, as a transport does).
type stalledAcquire struct {
	next http.RoundTripper
	mu   sync.Mutex
	blob string
	held chan struct{}
}

func (s *stalledAcquire) RoundTrip(r *http.Request) (*http.Response, error) {
	s.mu.Lock()
	hold := s.blob != "" && strings.HasSuffix(r.URL.Path, "/"+s.blob) && strings.EqualFold(leaseAction(r), "acquire")
	if hold {
		s.blob = ""
	}
	held := s.held
	s.mu.Unlock()
	if hold {
		held <- struct{}{}
		<-r.Context().Done()
		return nil, r.Context().Err()
	}
	return s.next.RoundTrip(r)
}

// TestWaitingLineReleaseLaterPokesHead: the two releases get no answer
// (an error from the transport); the head must be granted at once once the
// background release lands, not after its backoff nor the lease's 15s.
func TestWaitingLineReleaseLaterPokesHead(t *testing.T) {
	e := newEnv(t)
	h := &releases{next: &http.Transport{}}
	c := newClientVia(t, e.srv, e.srv.ServiceURL, e.container, h)
	arm := func(name string) (<-chan struct{}, func() int) {
		h.arm(name, 2)
		return h.held, func() int { h.release <- struct{}{}; return <-h.landed }
	}
	state := func(ctx context.Context, name string) string {
		props, err := e.c.NewBlobClient("fencekit-locks/"+name).GetProperties(ctx, nil)
		state := "?"
		if err == nil && props.LeaseState != nil {
			state = string(*props.LeaseState)
		}
		return fmt.Sprintf("blob lease state now %q, %v", state, err)
	}
	linetest.ReleaseLaterPokesHead(t, acquirerOf(c), lineLen, time.Minute, arm, "lost releases", state)
}

// TestWaitingLineStuckHead: the head's lease acquire is held unsent until
// its context ends; the head gives up at its deadline with ErrHeld and
// DeadlineExceeded.
func TestWaitingLineStuckHead(t *testing.T) {
	e := newEnv(t)
	s := &stalledAcquire{next: &http.Transport{}, held: make(chan struct{}, 1)}
	c := newClientVia(t, e.srv, e.srv.ServiceURL, e.container, s)
	arm := func(name string) (<-chan struct{}, func() int) {
		s.mu.Lock()
		s.blob = name
		s.mu.Unlock()
		return s.held, nil
	}
	linetest.StuckHead(t, acquirerOf(c), lineLen, 20*time.Second, arm, "acquire", 8*time.Second, false)
}

// TestWaitingLineNoLeaks: the holder takes the longest lease, since the
// waits and the goroutine count may take 30s on a loaded machine (a 20s
// lease was lost before its Release in a full run with -p 24); the
// background releases of the given-up waits (abandon) and the HTTP
// client's idle connections end on their own within 30s on a loaded
// machine (5s was not enough in a loaded full run: 16 against 4).
func TestWaitingLineNoLeaks(t *testing.T) {
	e := newEnv(t)
	linetest.NoLeaks(t, acquirerOf(e.c), lineLen, azfence.MaxAcquirerTTL, 20*time.Second, 30*time.Second)
}

// TestWaitingLineTwoAcquirers: MaxAttempts 1.
func TestWaitingLineTwoAcquirers(t *testing.T) {
	e := newEnv(t)
	own := func(t *testing.T, o linetest.Options) fence.Acquirer { return acquirerOf(e.other(t))(t, o) }
	linetest.TwoAcquirers(t, own, lineLen, 20*time.Second, 1)
}

func TestWaitingLineCauseStillMatches(t *testing.T) {
	e := newEnv(t)
	linetest.CauseStillMatches(t, acquirerOf(e.c), 20*time.Second)
}
