// Package durable is a static check: the error of a call that makes state
// durable or makes or releases a mount (fsync, syncfs, rename, mount,
// unmount) is never dropped. Dropping it is how a record believed written
// is lost at a power cut, or a directory still holding a mount is later
// removed through it.
//
// A call is reported when its error result is discarded: the call is a
// statement of its own (deferred or not, or started with go), or the error
// is assigned to the blank identifier.
package durable

import (
	"go/ast"
	"go/types"

	"golang.org/x/tools/go/analysis"
	"golang.org/x/tools/go/analysis/passes/inspect"
	"golang.org/x/tools/go/ast/inspector"
)

var Analyzer = &analysis.Analyzer{
	Name:     "durable",
	Doc:      "report dropped errors of fsync, syncfs, rename, mount and unmount calls",
	Requires: []*analysis.Analyzer{inspect.Analyzer},
	Run:      run,
}

// watched are the functions and methods checked, by package path and name
// ("Type.Method" for a method).
var watched = map[string]map[string]bool{
	"os": {"Rename": true, "File.Sync": true},
	"golang.org/x/sys/unix": {
		"Fsync": true, "Fdatasync": true, "Syncfs": true,
		"Rename": true, "Renameat": true, "Renameat2": true,
		"Unmount": true, "Mount": true,
	},
	"syscall": {"Fsync": true, "Fdatasync": true, "Rename": true, "Renameat": true, "Unmount": true, "Mount": true},
}

// watchedFunc is the name of the checked function fn stands for, or "".
func watchedFunc(fn *types.Func) string {
	if fn == nil || fn.Pkg() == nil {
		return ""
	}
	names := watched[fn.Pkg().Path()]
	if names == nil {
		return ""
	}
	name := fn.Name()
	if sig, ok := fn.Type().(*types.Signature); ok && sig.Recv() != nil {
		t := sig.Recv().Type()
		if p, ok := t.(*types.Pointer); ok {
			t = p.Elem()
		}
		n, ok := t.(*types.Named)
		if !ok {
			return ""
		}
		name = n.Obj().Name() + "." + name
	}
	if !names[name] {
		return ""
	}
	return fn.Pkg().Name() + "." + name
}

// errorResult is the index of call's error result, or -1.
func errorResult(pass *analysis.Pass, call *ast.CallExpr) int {
	sig, ok := pass.TypesInfo.TypeOf(call.Fun).(*types.Signature)
	if !ok {
		return -1
	}
	res := sig.Results()
	for i := res.Len() - 1; i >= 0; i-- {
		if types.Identical(res.At(i).Type(), types.Universe.Lookup("error").Type()) {
			return i
		}
	}
	return -1
}

func callee(pass *analysis.Pass, call *ast.CallExpr) string {
	var id *ast.Ident
	switch f := ast.Unparen(call.Fun).(type) {
	case *ast.Ident:
		id = f
	case *ast.SelectorExpr:
		id = f.Sel
	default:
		return ""
	}
	fn, _ := pass.TypesInfo.Uses[id].(*types.Func)
	return watchedFunc(fn)
}

func run(pass *analysis.Pass) (any, error) {
	ins := pass.ResultOf[inspect.Analyzer].(*inspector.Inspector)
	report := func(call *ast.CallExpr, how string) {
		name := callee(pass, call)
		if name == "" || errorResult(pass, call) < 0 {
			return
		}
		pass.Reportf(call.Pos(), "the error of %s is %s: handle it (durability or a mount depends on it)", name, how)
	}
	ins.Preorder([]ast.Node{(*ast.ExprStmt)(nil), (*ast.DeferStmt)(nil), (*ast.GoStmt)(nil), (*ast.AssignStmt)(nil)}, func(n ast.Node) {
		switch s := n.(type) {
		case *ast.ExprStmt:
			if call, ok := ast.Unparen(s.X).(*ast.CallExpr); ok {
				report(call, "dropped")
			}
		case *ast.DeferStmt:
			report(s.Call, "dropped by defer")
		case *ast.GoStmt:
			report(s.Call, "dropped by go")
		case *ast.AssignStmt:
			if len(s.Rhs) != 1 {
				return
			}
			call, ok := ast.Unparen(s.Rhs[0]).(*ast.CallExpr)
			if !ok {
				return
			}
			i := errorResult(pass, call)
			if i < 0 || i >= len(s.Lhs) {
				return
			}
			if id, ok := s.Lhs[i].(*ast.Ident); ok && id.Name == "_" {
				report(call, "assigned to _")
			}
		}
	})
	return nil, nil
}
