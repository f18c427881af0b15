// Package readme holds the tests that keep the Go code of README.md and of the
// documents in docs/ compiling: every Go block there is a complete program,
// built and vetted as a package main inside this module (and run when it needs
// no server), or an exact copy of an Example function of the module's tests.
// Nothing here is for users.
package readme
