package network

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// InterfaceStats are one network interface's counters since it was made.
type InterfaceStats struct {
	Name      string
	RxBytes   uint64
	RxPackets uint64
	RxErrors  uint64
	RxDropped uint64
	TxBytes   uint64
	TxPackets uint64
	TxErrors  uint64
	TxDropped uint64
}

// InterfaceCounters reads the counters of every interface but the loopback
// in the network namespace at path (a pod's), in the kernel's order.
// ErrNotFound when path is not a network namespace.
func InterfaceCounters(path string) ([]InterfaceStats, error) {
	var out []InterfaceStats
	err := inNetNS(path, func() error {
		// /proc/thread-self/net is the calling thread's namespace; the
		// process-wide /proc/net would be the main thread's.
		f, err := os.Open("/proc/thread-self/net/dev")
		if err != nil {
			return err
		}
		defer f.Close()
		out, err = parseNetDev(f)
		return err
	})
	return out, err
}

// parseNetDev parses /proc/net/dev: two header lines, then
// "name: rx bytes packets errs drop fifo frame compressed multicast
// tx bytes packets errs drop fifo colls carrier compressed".
func parseNetDev(r io.Reader) ([]InterfaceStats, error) {
	var out []InterfaceStats
	sc := bufio.NewScanner(r)
	for line := 0; sc.Scan(); line++ {
		if line < 2 {
			continue
		}
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			return nil, fmt.Errorf("net/dev: line %d: no interface name", line+1)
		}
		name = strings.TrimSpace(name)
		f := strings.Fields(rest)
		if len(f) < 16 {
			return nil, fmt.Errorf("net/dev: %s: %d fields, want 16", name, len(f))
		}
		var v [16]uint64
		for i := range v {
			n, err := strconv.ParseUint(f[i], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("net/dev: %s: %w", name, err)
			}
			v[i] = n
		}
		if name == "lo" {
			continue
		}
		out = append(out, InterfaceStats{
			Name:    name,
			RxBytes: v[0], RxPackets: v[1], RxErrors: v[2], RxDropped: v[3],
			TxBytes: v[8], TxPackets: v[9], TxErrors: v[10], TxDropped: v[11],
		})
	}
	return out, sc.Err()
}
