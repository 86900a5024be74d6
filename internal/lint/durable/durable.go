// Package durable is a static check: the error of a call that makes state
// durable or makes or releases a mount (fsync, syncfs, rename, mount,
// unmount) is never dropped. Dropping it is how a record believed written
// is lost at a power cut, or a directory still holding a mount is later
// removed through it.
//
// A call is reported when its error result is discarded: the call is a
// statement of its own (deferred or not, or started with go), or the error
// is assigned to the blank identifier.
//
// Wrappers are watched too: a function that returns the error of a
// watched call as its own (`return unix.Fsync(fd)`), directly or through
// another wrapper, in its package or an imported one (an object fact).
package durable

import (
	"go/ast"
	"go/types"

	"golang.org/x/tools/go/analysis"
	"golang.org/x/tools/go/analysis/passes/inspect"
	"golang.org/x/tools/go/ast/inspector"
)

var Analyzer = &analysis.Analyzer{
	Name:      "durable",
	Doc:       "report dropped errors of fsync, syncfs, rename, mount and unmount calls and of their wrappers",
	Requires:  []*analysis.Analyzer{inspect.Analyzer},
	Run:       run,
	FactTypes: []analysis.Fact{new(wraps)},
}

// wraps marks a function that returns a watched call's error as its own;
// Name is that call's, for the report.
type wraps struct{ Name string }

func (*wraps) AFact() {}

func (w *wraps) String() string { return "wraps " + w.Name }

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

// calleeFunc is the function call calls by name, or nil.
func calleeFunc(pass *analysis.Pass, call *ast.CallExpr) *types.Func {
	var id *ast.Ident
	switch f := ast.Unparen(call.Fun).(type) {
	case *ast.Ident:
		id = f
	case *ast.SelectorExpr:
		id = f.Sel
	default:
		return nil
	}
	fn, _ := pass.TypesInfo.Uses[id].(*types.Func)
	return fn
}

// callee is the name to report a call by: the watched function's, or
// for a wrapper "wrapper (a wrapper of watched)"; "" when neither.
func callee(pass *analysis.Pass, call *ast.CallExpr) string {
	fn := calleeFunc(pass, call)
	if name := watchedFunc(fn); name != "" {
		return name
	}
	var w wraps
	if fn != nil && pass.ImportObjectFact(fn, &w) {
		return fn.Pkg().Name() + "." + fn.Name() + " (a wrapper of " + w.Name + ")"
	}
	return ""
}

// findWrappers exports a wraps fact for each function of the package that
// returns the error of a watched call or of a wrapper, until no more are
// found (a wrapper may wrap another declared after it).
func findWrappers(pass *analysis.Pass) {
	for changed := true; changed; {
		changed = false
		for _, f := range pass.Files {
			for _, d := range f.Decls {
				fd, ok := d.(*ast.FuncDecl)
				if !ok || fd.Body == nil {
					continue
				}
				fn, _ := pass.TypesInfo.Defs[fd.Name].(*types.Func)
				if fn == nil || pass.ImportObjectFact(fn, new(wraps)) {
					continue
				}
				if name := wrapped(pass, fn, fd.Body); name != "" {
					pass.ExportObjectFact(fn, &wraps{Name: name})
					changed = true
				}
			}
		}
	}
}

// wrapped is the watched call whose error a return statement of body
// (not of a function literal in it) gives as fn's error result, or "".
func wrapped(pass *analysis.Pass, fn *types.Func, body *ast.BlockStmt) string {
	res := fn.Type().(*types.Signature).Results()
	ei := -1
	for i := res.Len() - 1; i >= 0; i-- {
		if types.Identical(res.At(i).Type(), types.Universe.Lookup("error").Type()) {
			ei = i
			break
		}
	}
	if ei < 0 {
		return ""
	}
	found := ""
	ast.Inspect(body, func(n ast.Node) bool {
		if found != "" {
			return false
		}
		switch r := n.(type) {
		case *ast.FuncLit:
			return false
		case *ast.ReturnStmt:
			if len(r.Results) != res.Len() {
				return true
			}
			call, ok := ast.Unparen(r.Results[ei]).(*ast.CallExpr)
			if !ok {
				return true
			}
			if name := watchedFunc(calleeFunc(pass, call)); name != "" {
				found = name
			} else if g := calleeFunc(pass, call); g != nil {
				var w wraps
				if pass.ImportObjectFact(g, &w) {
					found = w.Name
				}
			}
		}
		return true
	})
	return found
}

func run(pass *analysis.Pass) (any, error) {
	ins := pass.ResultOf[inspect.Analyzer].(*inspector.Inspector)
	findWrappers(pass)
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
