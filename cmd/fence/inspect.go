package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// parseWithName parses flags given before and after the one positional
// argument (the lock name), as "fence bump NAME -to N" and "fence bump -to N NAME"
// both read naturally.
func parseWithName(fs *flag.FlagSet, args []string) (string, error) {
	var names []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return "", err
			}
			return "", fmt.Errorf("%w: %v", errReported, err)
		}
		if fs.NArg() == 0 {
			break
		}
		names = append(names, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if len(names) != 1 {
		return "", fmt.Errorf("%w: want exactly one lock name, got %q", errUsage, names)
	}
	return names[0], nil
}

func runInspect(args []string, stdout, stderr io.Writer) error {
	fs, bc := commandFlags("inspect", "inspect [flags] NAME",
		"Shows the lock NAME on a backend: whether it is held, the holder's token, owner\n"+
			"and time left, and the token counter (every later grant is larger); with -key,\n"+
			"the token a protected key holds. Exit status 1 for an unreachable backend or an\n"+
			"unknown name, 2 for bad usage.", stderr)
	key := fs.String("key", "", "also show the token stored for this protected key (sqlite, postgres, redis, s3)")
	name, err := parseWithName(fs, args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := openBackend(ctx, *bc)
	if err != nil {
		return err
	}
	defer b.close()
	in, ok := b.acq.(fence.Inspector)
	if !ok {
		return fmt.Errorf("backend %s cannot inspect locks", bc.name)
	}
	info, err := in.Inspect(ctx, name)
	if err != nil {
		if errors.Is(err, fence.ErrNotFound) {
			return fmt.Errorf("no lock named %q on %s (never granted)", name, b.name)
		}
		return err
	}
	fmt.Fprintf(stdout, "lock %q on %s\n", name, b.name)
	if info.Held {
		fmt.Fprintf(stdout, "  held:      yes, token %d, owner %s, %v left\n", info.Token, info.Owner, info.TimeLeft.Round(time.Millisecond))
	} else {
		fmt.Fprintf(stdout, "  held:      no\n")
	}
	fmt.Fprintf(stdout, "  counter:   %d (every later grant's token is larger)\n", info.Counter)
	if *key != "" {
		v, tok, err := b.fenced.Read(ctx, *key)
		switch {
		case errors.Is(err, fence.ErrNotFound):
			fmt.Fprintf(stdout, "  key %q: no value\n", *key)
		case err != nil:
			return err
		default:
			fmt.Fprintf(stdout, "  key %q: token %d, %d bytes\n", *key, tok, len(v))
		}
	}
	return nil
}

func runBump(args []string, stdout, stderr io.Writer) error {
	fs, bc := commandFlags("bump", "bump [flags] NAME -to N",
		"Raises the token counter of lock NAME to N, so every later grant's token is\n"+
			"larger: for example after a Redis failover lost the counter. It refuses to\n"+
			"lower a counter (exit status 1). On SQL backends it refuses while the lock is\n"+
			"held. etcd tokens are revisions and cannot be bumped.", stderr)
	to := fs.String("to", "", "the value to raise the counter to (required)")
	name, err := parseWithName(fs, args)
	if err != nil {
		return err
	}
	n, err := strconv.ParseUint(*to, 10, 64)
	if err != nil || !fence.Token(n).Valid() {
		return fmt.Errorf("%w: -to wants a token in 1..%d, got %q", errUsage, uint64(fence.MaxToken), *to)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b, err := openBackend(ctx, *bc)
	if err != nil {
		return err
	}
	defer b.close()
	bu, ok := b.acq.(fence.Bumper)
	if !ok {
		return fmt.Errorf("backend %s has no counter to bump (etcd tokens are revisions)", bc.name)
	}
	if err := bu.Bump(ctx, name, fence.Token(n)); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "lock %q on %s: counter raised to %d\n", name, b.name, n)
	return nil
}
