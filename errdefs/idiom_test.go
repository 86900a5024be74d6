package errdefs

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestOneIdiom reads every non-test Go file of the module and refuses a
// classed error that formats an error with %v: errdefs.New (or a
// shorthand) with %v for an error, and fmt.Errorf with %v beside an
// errdefs class. Both lose the cause to errors.Is (see the package doc).
func TestOneIdiom(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root: %v", err)
	}
	fset := token.NewFileSet()
	var bad []string
	files := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "vendor") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		files++
		ast.Inspect(f, func(n ast.Node) bool {
			if call, ok := n.(*ast.CallExpr); ok && losesCause(call) {
				bad = append(bad, fset.Position(call.Pos()).String())
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 100 {
		t.Fatalf("read %d files under %s: not the module", files, root)
	}
	for _, b := range bad {
		t.Errorf("%s: a classed error formats its cause with %%v; wrap it with %%w (errdefs doc)", b)
	}
}

// losesCause reports whether call is a classed error whose %v verb takes
// an error named err.
func losesCause(call *ast.CallExpr) bool {
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok {
		return false
	}
	pkg, ok := sel.X.(*ast.Ident)
	if !ok {
		return false
	}
	first := 0 // index of the format argument
	switch {
	case pkg.Name == "errdefs" && sel.Sel.Name == "New":
		first = 1
	case pkg.Name == "errdefs" && (sel.Sel.Name == "InvalidArgument" || sel.Sel.Name == "NotFound" ||
		sel.Sel.Name == "AlreadyExists" || sel.Sel.Name == "FailedPrecondition"):
	case pkg.Name == "fmt" && sel.Sel.Name == "Errorf" && wrapsClass(call.Args):
	default:
		return false
	}
	if len(call.Args) <= first {
		return false
	}
	lit, ok := call.Args[first].(*ast.BasicLit)
	if !ok || lit.Kind != token.STRING {
		return false
	}
	format, err := strconv.Unquote(lit.Value)
	if err != nil {
		return false
	}
	for i, verb := range verbs(format) {
		arg := first + 1 + i
		if verb != 'v' || arg >= len(call.Args) {
			continue
		}
		if id, ok := call.Args[arg].(*ast.Ident); ok && (id.Name == "err" || strings.HasSuffix(id.Name, "Err")) {
			return true
		}
	}
	return false
}

func wrapsClass(args []ast.Expr) bool {
	for _, a := range args {
		if sel, ok := a.(*ast.SelectorExpr); ok {
			if pkg, ok := sel.X.(*ast.Ident); ok && pkg.Name == "errdefs" && strings.HasPrefix(sel.Sel.Name, "Err") {
				return true
			}
		}
	}
	return false
}

// verbs lists the verbs of a format string in argument order.
func verbs(format string) []rune {
	var out []rune
	for i := 0; i < len(format); i++ {
		if format[i] != '%' {
			continue
		}
		i++
		for i < len(format) && strings.IndexByte("+-# 0123456789.*[]", format[i]) >= 0 {
			i++
		}
		if i < len(format) && format[i] != '%' {
			out = append(out, rune(format[i]))
		}
	}
	return out
}

func TestLosesCause(t *testing.T) {
	for src, want := range map[string]bool{
		`fmt.Errorf("a: %v: %w", err, errdefs.ErrUnavailable)`:     true,
		`errdefs.New(errdefs.ErrUnavailable, "a %s: %v", id, err)`: true,
		`errdefs.InvalidArgument("%v", err)`:                       true,
		`errdefs.New(errdefs.ErrUnavailable, "a %s: %w", id, err)`: false,
		`fmt.Errorf("setgroups %v: %w", groups, err)`:              false,
		`fmt.Errorf("a %v: %w", n, errdefs.ErrNotFound)`:           false,
		`errdefs.NotFound("%d%%: %v", n, err)`:                     true,
	} {
		e, err := parser.ParseExpr(src)
		if err != nil {
			t.Fatal(err)
		}
		if got := losesCause(e.(*ast.CallExpr)); got != want {
			t.Errorf("%s: losesCause %v, want %v", src, got, want)
		}
	}
}
