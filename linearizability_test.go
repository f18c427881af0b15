package fencekit_test

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

var seeds = flag.Int("seeds", 3, "random schedules per writer in TestLinearizable (more for a longer run)")

type regInput struct {
	write bool
	token fence.Token
	value string
}

type regOutput struct {
	accepted bool   // write
	value    string // read
	token    fence.Token
}

type regState struct {
	value string
	token fence.Token
}

// fencedRegister is the model a fenced writer must implement, as a register: a
// write with a token not below the stored one is accepted and stored; a lower
// one is rejected and changes nothing; a read returns the stored value and token.
var fencedRegister = porcupine.Model{
	Init: func() interface{} { return regState{} },
	Step: func(state, input, output interface{}) (bool, interface{}) {
		st, in, out := state.(regState), input.(regInput), output.(regOutput)
		if !in.write {
			return out.value == st.value && out.token == st.token, st
		}
		if in.token >= st.token {
			return out.accepted, regState{value: in.value, token: in.token}
		}
		return !out.accepted, st
	},
	Equal: func(a, b interface{}) bool { return a.(regState) == b.(regState) },
	DescribeOperation: func(input, output interface{}) string {
		in, out := input.(regInput), output.(regOutput)
		if in.write {
			return fmt.Sprintf("write(%d, %q) -> accepted %v", in.token, in.value, out.accepted)
		}
		return fmt.Sprintf("read() -> %q token %d", out.value, out.token)
	},
}

// history runs clients that write random tokens and read back, with random
// pauses, against one key of w, and records every operation.
func history(t *testing.T, w store, seed uint64) []porcupine.Operation {
	const clients, opsEach = 6, 25
	key := fencetest.Name("lin")
	start := time.Now()
	var (
		mu  sync.Mutex
		ops []porcupine.Operation
		wg  sync.WaitGroup
	)
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(c)))
			for i := 0; i < opsEach; i++ {
				time.Sleep(time.Duration(rng.IntN(2000)) * time.Microsecond)
				op := porcupine.Operation{ClientId: c}
				in := regInput{write: rng.IntN(3) > 0, token: fence.Token(1 + rng.IntN(40))}
				in.value = fmt.Sprintf("c%d-%d", c, i)
				op.Call = time.Since(start).Nanoseconds()
				var out regOutput
				if in.write {
					err := w.Write(context.Background(), key, []byte(in.value), in.token)
					switch {
					case err == nil:
						out.accepted = true
					case errors.Is(err, fence.ErrStale):
					default:
						t.Errorf("write: %v", err)
						return
					}
				} else {
					v, tok, err := w.Read(context.Background(), key)
					if err != nil && !errors.Is(err, fence.ErrNotFound) {
						t.Errorf("read: %v", err)
						return
					}
					out.value, out.token = string(v), tok
				}
				op.Return = time.Since(start).Nanoseconds()
				op.Input, op.Output = in, out
				mu.Lock()
				ops = append(ops, op)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return ops
}

// TestLinearizable records histories of every fenced writer under random
// schedules and checks them against the fenced-register model with porcupine.
func TestLinearizable(t *testing.T) {
	for _, wc := range writers() {
		if wc.name == "postgres-guard" {
			continue // it stores a user's row; its fence is checked by TestPausedHolder and TestGuardConcurrent
		}
		t.Run(wc.name, func(t *testing.T) {
			w := wc.new(t)
			for seed := 1; seed <= *seeds; seed++ {
				ops := history(t, w, uint64(seed))
				if t.Failed() {
					return
				}
				if !porcupine.CheckOperations(fencedRegister, ops) {
					t.Fatalf("seed %d: the history of %d operations is not linearizable as a fenced register", seed, len(ops))
				}
			}
		})
	}
}

// brokenWriter is the mistake the architecture forbids: read the stored token,
// compare in Go, then write unconditionally.
type brokenWriter struct{ db *sql.DB }

func (b brokenWriter) Write(ctx context.Context, key string, value []byte, token fence.Token) error {
	_, cur, err := b.Read(ctx, key)
	if err != nil && !errors.Is(err, fence.ErrNotFound) {
		return err
	}
	if token < cur {
		return &fence.StaleError{Key: key, Offered: token, Current: cur}
	}
	time.Sleep(time.Millisecond) // the window between the check and the write
	_, err = b.db.ExecContext(ctx, `INSERT INTO broken (k, v, t) VALUES ($1, $2, $3) ON CONFLICT (k) DO UPDATE SET v = excluded.v, t = excluded.t`, key, value, int64(token))
	return err
}

func (b brokenWriter) Read(ctx context.Context, key string) ([]byte, fence.Token, error) {
	var (
		v []byte
		t int64
	)
	err := b.db.QueryRowContext(ctx, `SELECT v, t FROM broken WHERE k = $1`, key).Scan(&v, &t)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, 0, fence.ErrNotFound
	}
	return v, fence.Token(t), err
}

// TestCheckerCatchesBrokenWriter shows the check is not vacuous: the same
// histories from a read-compare-write writer are found not linearizable.
func TestCheckerCatchesBrokenWriter(t *testing.T) {
	db, err := sqlfence.OpenSQLite(t.TempDir() + "/broken.db")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TABLE broken (k TEXT PRIMARY KEY, v BLOB, t INTEGER)`); err != nil {
		t.Fatal(err)
	}
	for seed := 1; seed <= 20; seed++ {
		if !porcupine.CheckOperations(fencedRegister, history(t, brokenWriter{db}, uint64(seed))) {
			t.Logf("seed %d: violation found", seed)
			return
		}
	}
	t.Fatal("20 schedules of a read-compare-write writer passed the check: the checker would not catch a broken writer")
}
