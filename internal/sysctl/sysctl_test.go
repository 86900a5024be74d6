package sysctl

import (
	"errors"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
)

func TestNamespace(t *testing.T) {
	for name, want := range map[string]string{
		"net.ipv4.ip_forward":              Net,
		"net/ipv4/conf/eth0.100/rp_filter": Net,
		"net.core.somaxconn":               Net,
		"kernel.shmmax":                    IPC,
		"kernel.shm_rmid_forced":           IPC,
		"kernel/shm_rmid_forced":           IPC,
		"kernel.msgmax":                    IPC,
		"kernel.sem":                       IPC,
		"fs.mqueue.msg_max":                IPC,
		"kernel.semx":                      "",
		"kernel.panic":                     "",
		"vm.overcommit_memory":             "",
		"network.x":                        "",
	} {
		if got := Namespace(name); got != want {
			t.Errorf("Namespace(%q) = %q, want %q", name, got, want)
		}
	}
}

func TestPath(t *testing.T) {
	for name, want := range map[string]string{
		"net.ipv4.ip_forward":              "/proc/sys/net/ipv4/ip_forward",
		"net/ipv4/conf/eth0.100/rp_filter": "/proc/sys/net/ipv4/conf/eth0.100/rp_filter",
		"kernel.shm_rmid_forced":           "/proc/sys/kernel/shm_rmid_forced",
	} {
		if got, err := Path("/proc", name); err != nil || got != want {
			t.Errorf("Path(%q) = %q, %v", name, got, err)
		}
	}
	if got, err := Path("/tmp/proc-1", "kernel.sem"); err != nil || got != "/tmp/proc-1/sys/kernel/sem" {
		t.Errorf("Path beneath a private proc = %q, %v", got, err)
	}
	for _, bad := range []string{"net..x", "net/../../etc", "net.", "net/ipv4//x", "kernel.shm\nx", "kernel/shm\x00"} {
		if _, err := Path("/proc", bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Path(%q) = %v", bad, err)
		}
	}
}
