// Package testbug holds bug switches that idempotency's own tests turn on to
// show that their checks catch the bug. They are off unless a test of this
// module sets them, and no user can reach them: the package is internal.
package testbug

import "sync/atomic"

// ClaimLeftHeld, when true, makes Do leave a claim whose effect never started
// held, instead of giving it back, when the caller's context ends before the
// arm: the key then stays in progress for nobody until the claim's lease
// ends. Set only by idempotencytest's mutant runs (IDEMPOTENCYTEST_MUTANT).
var ClaimLeftHeld atomic.Bool
