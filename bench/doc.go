// Package bench measures fencekit against peer libraries on the same Redis
// server in the same run. It is a separate module so that the peers stay out of
// fencekit's own go.mod. Run it with scripts/bench-peers.sh, or:
//
//	cd bench && go test -run XXX -bench Peers -benchtime 1x
//
// The contention curve (processes x workers from 1x20 to 16x8,
// the libraries alternated, one table) is go run ./sweep, or
// go test -run XXX -bench Sweep -benchtime 1x (see internal/sweep).
//
// It only measures; nothing here is asserted about speed.
package bench
