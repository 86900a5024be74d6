package main

import (
	"fmt"
	"io"

	"github.com/stagelet/stagelet/config"
)

const configUsage = `usage:
  stagelet config default          print the embedded default node configuration
                                   (a starting point for /etc/stagelet/config.yaml)
  stagelet config check FILE...    validate node configuration files; exit 1 on problems
`

func configMain(args []string, out, errOut io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(errOut, configUsage)
		return 2
	}
	switch args[0] {
	case "default":
		out.Write(config.DefaultYAML())
		return 0
	case "check":
		if len(args) == 1 {
			fmt.Fprint(errOut, configUsage)
			return 2
		}
		rc := 0
		for _, f := range args[1:] {
			c, err := config.Load(f)
			if err != nil {
				fmt.Fprintln(errOut, err)
				rc = 1
				continue
			}
			if _, err := c.LoadPolicy(); err != nil {
				fmt.Fprintf(errOut, "%s: %v\n", f, err)
				rc = 1
				continue
			}
			fmt.Fprintf(out, "%s: ok\n", f)
		}
		return rc
	default:
		fmt.Fprintf(errOut, "stagelet config: unknown command %q\n%s", args[0], configUsage)
		return 2
	}
}
