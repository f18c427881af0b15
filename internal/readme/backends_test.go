package readme_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// demoBackendList is the README's list of the demo's backends, as in
// "-backend sqlite|postgres|...".
var demoBackendList = regexp.MustCompile("`-backend ([a-z0-9]+(?:\\|[a-z0-9]+)+)`")

// cliBackends reads the fence command's sources: the names in its
// backendNames slice (which its usage text and errors print), and the
// backends its openBackend function opens (the cases of its switch).
func cliBackends(t *testing.T, dir string) (listed, opened []string) {
	t.Helper()
	fset := token.NewFileSet()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	for _, file := range files {
		if strings.HasSuffix(file, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, file, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
			switch d := decl.(type) {
			case *ast.GenDecl:
				for _, spec := range d.Specs {
					vs, ok := spec.(*ast.ValueSpec)
					if !ok {
						continue
					}
					for i, name := range vs.Names {
						if name.Name != "backendNames" || i >= len(vs.Values) {
							continue
						}
						lit, ok := vs.Values[i].(*ast.CompositeLit)
						if !ok {
							t.Fatalf("%s: backendNames is not a slice literal", file)
						}
						for _, e := range lit.Elts {
							listed = append(listed, stringLit(t, e))
						}
					}
				}
			case *ast.FuncDecl:
				if d.Name.Name != "openBackend" || d.Body == nil {
					continue
				}
				ast.Inspect(d.Body, func(n ast.Node) bool {
					if cc, ok := n.(*ast.CaseClause); ok {
						for _, e := range cc.List {
							opened = append(opened, stringLit(t, e))
						}
					}
					return true
				})
			}
		}
	}
	return listed, opened
}

func stringLit(t *testing.T, e ast.Expr) string {
	t.Helper()
	bl, ok := e.(*ast.BasicLit)
	if !ok || bl.Kind != token.STRING {
		t.Fatalf("want a string literal, got %T", e)
	}
	s, err := strconv.Unquote(bl.Value)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestReadmeDemoBackendsMatchCLI: the README's -backend list for fence demo
// names exactly the backends the command lists in its usage and opens, so
// that a backend added on either side shows on the other.
func TestReadmeDemoBackendsMatchCLI(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := demoBackendList.FindAllStringSubmatch(string(b), -1)
	if len(m) != 1 {
		t.Fatalf("README.md has %d lists of the form `-backend a|b|c`, want 1", len(m))
	}
	readme := strings.Split(m[0][1], "|")
	listed, opened := cliBackends(t, filepath.Join(root, "cmd", "fence"))
	if len(listed) == 0 || len(opened) == 0 {
		t.Fatalf("cmd/fence: found backendNames %q and openBackend cases %q; both must name the demo's backends", listed, opened)
	}
	for _, side := range []struct {
		what  string
		names []string
	}{
		{"cmd/fence's backendNames (its usage text)", listed},
		{"cmd/fence's openBackend", opened},
	} {
		for _, n := range side.names {
			if !slices.Contains(readme, n) {
				t.Errorf("%s has backend %q, which README.md's `-backend %s` lacks", side.what, n, m[0][1])
			}
		}
		for _, n := range readme {
			if !slices.Contains(side.names, n) {
				t.Errorf("README.md's -backend list has %q, which %s lacks (%q)", n, side.what, side.names)
			}
		}
	}
}
