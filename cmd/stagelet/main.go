// Command stagelet is the whole of stagelet in one binary: the CRI daemon
// (serve), the per-pod agent (agent), and operator tools. It re-executes
// itself where a fresh process is needed (the agent, app init).
package main

import (
	"fmt"
	"os"

	"github.com/stagelet/stagelet/agent/guestinit"
	"github.com/stagelet/stagelet/agent/supervisor"
	"github.com/stagelet/stagelet/cgroups"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "0.0.0+dev"

func usage() {
	fmt.Fprintf(os.Stderr, `usage: stagelet <command> [flags]

commands:
  serve     run the CRI daemon
  agent     run a pod's agent (started by stage1 backends, not by hand)
  policy    check a policy file, or explain the stage1 a pod would get
  config    print the default node configuration, or check one
  cni       install the default pod network configuration (cni init)
  doctor    check what this node can run, and why not
  checkpoint push a checkpoint image; checkpoint or restore a pod
  gc        release what set-aside records name, or every pod (daemon stopped)
  version   print the version
`)
}

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	switch os.Args[1] {
	case "agent":
		if len(os.Args) > 2 && os.Args[2] == "guest" {
			// The init of a kvm pod's VM.
			os.Exit(guestinit.Main(os.Args[3:]))
		}
		os.Exit(supervisor.Main(os.Args[2:]))
	case "cgroup-exec":
		// Internal: places a process in its cgroup before it executes
		// its program, on kernels without CLONE_INTO_CGROUP.
		os.Exit(cgroups.RunExecHelper(os.Args[2:]))
	case "serve":
		os.Exit(serveMain(os.Args[2:]))
	case "cni":
		os.Exit(cniMain(os.Args[2:]))
	case "policy":
		os.Exit(policyMain(os.Args[2:]))
	case "config":
		os.Exit(configMain(os.Args[2:], os.Stdout, os.Stderr))
	case "gc":
		os.Exit(gcMain(os.Args[2:], os.Stdout, os.Stderr))
	case "doctor":
		os.Exit(doctorMain(os.Args[2:], os.Stdout, os.Stderr))
	case "checkpoint":
		os.Exit(checkpointMain(os.Args[2:], os.Stdout, os.Stderr))
	case "version", "--version":
		fmt.Printf("stagelet %s\n", version)
	case "help", "-h", "--help":
		usage()
	default:
		fmt.Fprintf(os.Stderr, "stagelet: unknown command %q\n", os.Args[1])
		usage()
		os.Exit(2)
	}
}
