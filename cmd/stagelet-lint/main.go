// Command stagelet-lint runs the project's own static checks (make lint):
// durable, which reports dropped errors of fsync, syncfs, rename, mount and
// unmount calls and of the functions that wrap them.
package main

import (
	"golang.org/x/tools/go/analysis/singlechecker"

	"github.com/stagelet/stagelet/internal/lint/durable"
)

func main() { singlechecker.Main(durable.Analyzer) }
