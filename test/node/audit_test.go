package node

import (
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/internal/testutil"
)

// What marks a kernel audit line as a denial of each module.
const (
	appArmorDenied = `apparmor="DENIED"`
	avcDenied      = "avc:  denied"
)

// auditID is the stamp of a kernel audit line: audit(SECONDS.MS:SERIAL).
var auditID = regexp.MustCompile(`audit\((\d+)\.\d+:\d+\)`)

// auditLines are the kernel's audit lines holding marker logged at since
// or later, each once: they reach auditd's log where auditd runs (the
// SELinux variant), else the journal through its audit socket, and the
// kernel's log where nothing listens.
func auditLines(since time.Time, marker string) []string {
	from := since.Unix() - 1
	a, _ := os.ReadFile("/var/log/audit/audit.log")
	j, _ := exec.Command("journalctl", "--no-pager", "--since", "@"+strconv.FormatInt(from, 10), "-g", marker).CombinedOutput()
	k, _ := exec.Command("dmesg").CombinedOutput()
	seen := map[string]bool{}
	var out []string
	for _, l := range strings.Split(string(a)+"\n"+string(j)+"\n"+string(k), "\n") {
		if !strings.Contains(l, marker) {
			continue
		}
		m := auditID.FindStringSubmatch(l)
		if m != nil {
			if s, _ := strconv.ParseInt(m[1], 10, 64); s < from || seen[m[0]] {
				continue
			}
			seen[m[0]] = true
		}
		out = append(out, l)
	}
	return out
}

// auditLinesBut are auditLines(since, marker) without the lines of seen
// (by their audit stamps): the lines logged after seen was read, though
// in the same second.
func auditLinesBut(since time.Time, marker string, seen []string) []string {
	old := map[string]bool{}
	for _, l := range seen {
		old[auditKey(l)] = true
	}
	var out []string
	for _, l := range auditLines(since, marker) {
		if !old[auditKey(l)] {
			out = append(out, l)
		}
	}
	return out
}

// auditKey is a line's audit stamp, or the line where it has none.
func auditKey(l string) string {
	if m := auditID.FindString(l); m != "" {
		return m
	}
	return l
}

// waitAuditLine waits for an audit line holding marker and all of parts,
// logged at since or later.
func waitAuditLine(t *testing.T, what string, since time.Time, marker string, parts ...string) {
	t.Helper()
	testutil.WaitFor(t, 30*time.Second, what, func() (bool, string) {
		seen := auditLines(since, marker)
		for _, l := range seen {
			ok := true
			for _, p := range parts {
				ok = ok && strings.Contains(l, p)
			}
			if ok {
				t.Logf("%s: %s", what, l)
				return true, ""
			}
		}
		return false, strings.Join(seen, "\n")
	})
}
