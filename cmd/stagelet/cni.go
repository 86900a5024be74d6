package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/stagelet/stagelet/network"
)

// cniMain runs `stagelet cni init`: it installs stagelet's default pod
// network (bridge, host-local, portmap) when the node has no CNI
// configuration, and leaves an existing one alone.
func cniMain(args []string) int {
	if len(args) == 0 || args[0] != "init" {
		fmt.Fprintln(os.Stderr, "usage: stagelet cni init [--conf-dir DIR] [--subnet CIDR]")
		return 2
	}
	fs := flag.NewFlagSet("stagelet cni init", flag.ContinueOnError)
	dir := fs.String("conf-dir", network.DefaultConfDir, "CNI configuration directory")
	subnet := fs.String("subnet", network.DefaultSubnet, "pod subnet of the default network")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	written, err := network.InstallDefaultConflist(*dir, *subnet)
	if err != nil {
		fmt.Fprintf(os.Stderr, "stagelet cni init: %v\n", err)
		return 1
	}
	if written {
		fmt.Printf("installed the default pod network (%s) in %s\n", *subnet, *dir)
	} else {
		fmt.Printf("%s already has a CNI configuration; left as is\n", *dir)
	}
	return 0
}
