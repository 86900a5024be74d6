// Command stagelet-lint runs the project's own static checks (make lint):
// durable, which reports dropped errors of fsync, syncfs, rename, mount and
// unmount calls and of the functions that wrap them; and funclen, which
// reports functions over 80 lines outside tests.
package main

import (
	"golang.org/x/tools/go/analysis/multichecker"

	"github.com/stagelet/stagelet/internal/lint/durable"
	"github.com/stagelet/stagelet/internal/lint/funclen"
)

func main() { multichecker.Main(durable.Analyzer, funclen.Analyzer) }
