package readme_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// section returns the text of the README section that starts with heading,
// up to the next heading of the same level.
func section(readme, heading string) string {
	_, s, ok := strings.Cut(readme, "\n"+heading+"\n")
	if !ok {
		return ""
	}
	s, _, _ = strings.Cut(s, "\n## ")
	return s
}

// TestInstallInConsumerModule follows the README as a newcomer does, in a
// module of their own outside this repository (which a replace directive
// stands for): the Install section's go commands, then the quick start as
// main.go, then go run, which must print what the README says it prints.
func TestInstallInConsumerModule(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the go command in a module of its own; skipped with -short")
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	install := section(readme, "## Install")
	_, sh, ok := strings.Cut(install, "```sh\n")
	sh, _, _ = strings.Cut(sh, "```")
	if !ok {
		t.Fatal("README's Install section has no sh block")
	}
	quick := goBlocks(section(readme, "## Quick start"))
	if len(quick) != 1 {
		t.Fatalf("README's Quick start has %d Go blocks, want 1", len(quick))
	}
	const want = "written under the lock, fenced"
	if prose := strings.Join(strings.Fields(section(readme, "## Quick start")), " "); !strings.Contains(prose, "`go run .` prints `"+want+"`") {
		t.Fatalf("README's Quick start no longer says that go run prints %q", want)
	}

	dir := t.TempDir()
	// Offline: the module cache holds what this module's own build needed.
	env := append(os.Environ(), "GOPROXY=off", "GOSUMDB=off", "GOFLAGS=", "GOWORK=off")
	gorun := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("go", args...)
		cmd.Dir, cmd.Env = dir, env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			t.Fatalf("following the README: go %s: %v\n%s", strings.Join(args, " "), err, out.String())
		}
		return out.String()
	}
	gorun("mod", "init", "example.com/newcomer")
	gorun("mod", "edit", "-replace", "github.com/fencekit/fencekit="+root)
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(quick[0].code), 0o644); err != nil {
		t.Fatal(err)
	}
	ran := 0
	for _, line := range strings.Split(sh, "\n") {
		line, _, _ = strings.Cut(line, "#")
		f := strings.Fields(line)
		if len(f) < 2 || f[0] != "go" || (f[1] == "mod" && len(f) > 2 && f[2] == "init") {
			continue
		}
		if f[1] == "mod" && len(f) == 3 && f[2] == "tidy" {
			// Offline, tidy cannot fetch the modules that only the tests of
			// dependencies import; -e lets it skip them (the build needs none).
			f = append(f, "-e")
		}
		gorun(f[1:]...)
		ran++
	}
	if ran == 0 {
		t.Fatalf("README's Install block has no go command:\n%s", sh)
	}
	if out := gorun("run", "."); !strings.Contains(out, want) {
		t.Errorf("go run . of the quick start printed %q, the README says %q", out, want)
	}
}
