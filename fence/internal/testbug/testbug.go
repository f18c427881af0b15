// Package testbug holds switches that plant known bugs in package fence, so
// that the conformance suites' own tests can show the suites catch them.
// Only this module's tests set them; a program that imports fence cannot.
package testbug

import "sync/atomic"

// HoldRenewsAfterPanic, when set, makes Hold leave its renewals running and
// skip the release when work panics: the lease stays held for nobody.
var HoldRenewsAfterPanic atomic.Bool
