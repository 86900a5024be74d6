package testutil

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// CounterCmd, a shell script, counts in its rootfs (/tmp/count) and to its
// log ("count N"), five times a second: what the checkpoint tests save
// and restore.
const CounterCmd = `exec </dev/null; i=0; while :; do i=$((i+1)); echo $i > /tmp/count; echo count $i; sleep 0.2; done`

// Counting waits for CounterCmd in container id to count, and returns
// what reads its count through rt (0 when it cannot be read).
func Counting(t testing.TB, rt runtimeapi.RuntimeServiceClient, id string) func() int {
	t.Helper()
	count := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		r, err := rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: id, Cmd: []string{"cat", "/tmp/count"}, Timeout: 30})
		if err != nil || r.ExitCode != 0 {
			return 0
		}
		n, _ := strconv.Atoi(strings.TrimSpace(string(r.Stdout)))
		return n
	}
	WaitFor(t, time.Minute, "the counter counts", func() (bool, string) {
		n := count()
		return n > 2, strconv.Itoa(n)
	})
	return count
}

// CountsOn waits for the CRI log at path of CounterCmd to count on, and
// returns the first count it holds.
func CountsOn(t testing.TB, path string) int {
	t.Helper()
	var first, last int
	WaitFor(t, time.Minute, "the counter logs on in "+filepath.Base(path), func() (bool, string) {
		b, _ := os.ReadFile(path)
		first, last = 0, 0
		for _, l := range strings.Split(string(b), "\n") {
			if _, after, ok := strings.Cut(l, " count "); ok {
				n, _ := strconv.Atoi(strings.TrimSpace(after))
				if first == 0 {
					first = n
				}
				last = n
			}
		}
		return last > first+2, fmt.Sprintf("first %d last %d", first, last)
	})
	return first
}
