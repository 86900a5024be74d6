// Package funclen is a static check: no function or method outside tests
// is longer than MaxLines lines, from its func keyword to its closing
// brace. A longer one is split along the steps its comments name, so that
// each can be read, and tested, on its own.
package funclen

import (
	"go/ast"
	"strings"

	"golang.org/x/tools/go/analysis"
)

// MaxLines is the longest a function may be.
const MaxLines = 80

var Analyzer = &analysis.Analyzer{
	Name: "funclen",
	Doc:  "report functions longer than 80 lines outside tests",
	Run:  run,
}

func run(pass *analysis.Pass) (any, error) {
	for _, f := range pass.Files {
		name := pass.Fset.Position(f.Pos()).Filename
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			n := pass.Fset.Position(fd.End()).Line - pass.Fset.Position(fd.Pos()).Line + 1
			if n > MaxLines {
				pass.Reportf(fd.Pos(), "%s is %d lines long (at most %d): split it along its steps", fd.Name.Name, n, MaxLines)
			}
		}
	}
	return nil, nil
}
