package harness

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// releaseNetwork reports and releases what the daemon's pods left of its
// network: ports still on its bridge, host-local allocations, iptables
// rules naming its pods. It then deletes the bridge, which the CNI bridge
// plugin creates and never removes. Only this daemon's own bridge and
// IPAM directory are touched.
func (d *Daemon) releaseNetwork(ctx context.Context) []string {
	var left []string
	if out, err := exec.CommandContext(ctx, "ip", "-o", "link", "show", "master", d.Bridge).Output(); err == nil {
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			if f := strings.Fields(line); len(f) > 1 {
				name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
				left = append(left, "veth "+name+" on "+d.Bridge)
				exec.CommandContext(ctx, "ip", "link", "del", name).Run()
			}
		}
	}
	ipam := filepath.Join(d.Root, "ipam")
	filepath.Walk(ipam, func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return nil
		}
		if n := info.Name(); n != "lock" && !strings.HasPrefix(n, "last_reserved_ip") {
			left = append(left, "IPAM allocation "+n)
		}
		return nil
	})
	// Rules the portmap plugin leaves name the pod's address, which lies in
	// this daemon's own subnet.
	prefix := strings.TrimSuffix(d.Subnet, "0/24")
	if out, err := exec.CommandContext(ctx, "iptables-save").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			if strings.Contains(line, prefix) {
				left = append(left, "iptables: "+line)
			}
		}
	}
	exec.CommandContext(ctx, "ip", "link", "del", d.Bridge).Run()
	return left
}
