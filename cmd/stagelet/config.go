package main

import (
	"fmt"
	"io"

	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/trust"
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
			if !configCheck(f, out, errOut) {
				rc = 1
			}
		}
		return rc
	default:
		fmt.Fprintf(errOut, "stagelet config: unknown command %q\n%s", args[0], configUsage)
		return 2
	}
}

// configCheck validates node configuration file f and its policy as the
// daemon loads them: the policy against the stage1s this build carries,
// their options included (a stage1 the build lacks is a warning). It
// prints "f: ok" to out, or the problems to errOut, and reports whether
// the file is fine.
func configCheck(f string, out, errOut io.Writer) bool {
	c, err := config.Load(f)
	if err != nil {
		fmt.Fprintln(errOut, err)
		return false
	}
	p, err := c.LoadPolicy()
	if err != nil {
		fmt.Fprintf(errOut, "%s: %v\n", f, err)
		return false
	}
	caps := capabilitiesOf(builtinBackends(quietLog, c, nil, true, ""))
	if n := reportProblems(errOut, p.Validate(caps)); n > 0 {
		fmt.Fprintf(errOut, "%s: the policy has %d problem(s)\n", f, n)
		return false
	}
	// The signature policy and its namespace files, with their keys, as
	// the daemon would load them.
	if _, errs := trust.CheckFiles(c.Images.SignaturePolicy, c.Images.PolicyDir()); len(errs) > 0 {
		for _, err := range errs {
			fmt.Fprintf(errOut, "%s: %v\n", f, err)
		}
		return false
	}
	fmt.Fprintf(out, "%s: ok\n", f)
	return true
}
