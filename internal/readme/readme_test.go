package readme_test

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// block is one fenced Go block of the README, with the line it starts on.
type block struct {
	line int
	code string
}

// goBlocks returns the README's ```go blocks.
func goBlocks(readme string) []block {
	var (
		out  []block
		cur  *block
		body strings.Builder
	)
	for i, l := range strings.Split(readme, "\n") {
		switch {
		case cur == nil && strings.TrimSpace(l) == "```go":
			cur = &block{line: i + 1}
			body.Reset()
		case cur != nil && strings.TrimSpace(l) == "```":
			cur.code = body.String()
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			body.WriteString(l + "\n")
		}
	}
	return out
}

// testSources returns the text of every _test.go file of the module.
func testSources(t *testing.T, root string) string {
	var all strings.Builder
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root && (strings.HasPrefix(d.Name(), ".") || strings.HasPrefix(d.Name(), "_") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if strings.HasSuffix(path, "_test.go") {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			all.Write(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return all.String()
}

// needsServer tells a program that reaches a server (it is built, not run).
var needsServer = regexp.MustCompile(`postgres://|redis\.NewClient|127\.0\.0\.1|localhost|clientv3\.New|s3\.New`)

// TestGoBlocks builds and vets every Go block of README.md and of the
// documents in docs/ that is a program, as its own package main in a directory
// inside this module (so it resolves the module's packages and dependencies as
// a user's code would), runs those that need no server, and checks that every
// other block is an exact copy of an Example function.
func TestGoBlocks(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files := append([]string{filepath.Join(root, "README.md")}, docs...)
	// Inside the module (so the module's go.mod resolves the imports); the
	// leading _ keeps ./... patterns out of it.
	tmp, err := os.MkdirTemp(".", "_build-")
	if err != nil {
		t.Fatal(err)
	}
	if tmp, err = filepath.Abs(tmp); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	var examples string
	for _, file := range files {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		name, err := filepath.Rel(root, file)
		if err != nil {
			t.Fatal(err)
		}
		blocks := goBlocks(string(text))
		if name == "README.md" && len(blocks) == 0 {
			t.Fatal("README.md has no Go blocks")
		}
		programs := 0
		for _, b := range blocks {
			switch {
			case strings.HasPrefix(b.code, "package main\n"):
				programs++
				t.Run(fmt.Sprintf("%s/line%d", strings.TrimSuffix(filepath.Base(name), ".md"), b.line), func(t *testing.T) {
					dir := filepath.Join(tmp, strings.TrimSuffix(filepath.Base(name), ".md"), fmt.Sprintf("line%d", b.line))
					if err := os.MkdirAll(dir, 0o755); err != nil {
						t.Fatal(err)
					}
					if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(b.code), 0o644); err != nil {
						t.Fatal(err)
					}
					bin := filepath.Join(dir, "prog")
					goCmd(t, "vet", dir)
					goCmd(t, "build", "-o", bin, dir)
					if needsServer.MatchString(b.code) {
						return
					}
					// Run it where it can make its files, as a reader would.
					cmd := exec.Command(bin)
					cmd.Dir = t.TempDir()
					if out, err := cmd.CombinedOutput(); err != nil {
						t.Errorf("%s line %d: the program failed: %v\n%s", name, b.line, err, out)
					}
				})
			case strings.HasPrefix(b.code, "func Example"):
				if examples == "" {
					examples = testSources(t, root)
				}
				if !strings.Contains(examples, b.code) {
					t.Errorf("%s line %d: this block is not an exact copy of an Example function in the module's tests:\n%s", name, b.line, b.code)
				}
			default:
				t.Errorf("%s line %d: a Go block must be a complete program (package main, with its imports) or an exact copy of an Example function:\n%s", name, b.line, b.code)
			}
		}
		if name == "README.md" && programs == 0 {
			t.Error("README.md has no complete program")
		}
	}
}

// goCmd runs the go command in the current directory and fails t with its
// output when it fails.
func goCmd(t *testing.T, args ...string) {
	t.Helper()
	cmd := exec.Command("go", args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out.String())
	}
}
