package supervisor

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/transport"
)

func fixedClock() func() time.Time {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
	return func() time.Time { return t0 }
}

const ts = "2026-01-02T03:04:05.000000006Z"

func TestCRILogCopyStream(t *testing.T) {
	long := strings.Repeat("a", maxLogLine+10)
	exact := strings.Repeat("b", maxLogLine)
	tests := []struct {
		name, in string
		want     []string
	}{
		{"lines", "one\ntwo\n", []string{"stdout F one", "stdout F two"}},
		{"empty line", "\n", []string{"stdout F "}},
		{"no final newline", "one\ntail", []string{"stdout F one", "stdout P tail"}},
		{"long line split", long + "\nnext\n", []string{
			"stdout P " + long[:maxLogLine], "stdout F " + long[maxLogLine:], "stdout F next"}},
		{"long line at EOF", long, []string{"stdout P " + long[:maxLogLine], "stdout P " + long[maxLogLine:]}},
		{"exactly the limit", exact + "\n", []string{"stdout P " + exact, "stdout F "}},
		{"nothing", "", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "sub", "dir", "c.log")
			l, err := openCRILog(path)
			if err != nil {
				t.Fatal(err)
			}
			l.now = fixedClock()
			if err := l.copyStream(streamStdout, strings.NewReader(tt.in)); err != nil {
				t.Fatal(err)
			}
			l.close()
			got := readLines(t, path)
			if len(got) != len(tt.want) {
				t.Fatalf("got %d lines, want %d:\n%q", len(got), len(tt.want), got)
			}
			for i := range got {
				if want := ts + " " + tt.want[i]; got[i] != want {
					t.Errorf("line %d = %.80q..., want %.80q...", i, got[i], want)
				}
			}
		})
	}
}

func readLines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s := strings.TrimSuffix(string(b), "\n")
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

func TestCRILogTimestampParses(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.log")
	l, err := openCRILog(path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.close()
	if err := l.writeLine(streamStderr, false, []byte("x")); err != nil {
		t.Fatal(err)
	}
	line := readLines(t, path)[0]
	f := strings.SplitN(line, " ", 4)
	if _, err := time.Parse(time.RFC3339Nano, f[0]); err != nil {
		t.Errorf("timestamp %q: %v", f[0], err)
	}
	if f[1] != "stderr" || f[2] != "F" || f[3] != "x" {
		t.Errorf("line %q", line)
	}
}

func TestCRILogReopen(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "c.log")
	l, err := openCRILog(path)
	if err != nil {
		t.Fatal(err)
	}
	l.now = fixedClock()
	l.writeLine(streamStdout, false, []byte("before"))
	if err := os.Rename(path, path+".1"); err != nil {
		t.Fatal(err)
	}
	if err := l.reopen(); err != nil {
		t.Fatal(err)
	}
	l.writeLine(streamStdout, false, []byte("after"))
	l.close()
	if got := readLines(t, path+".1"); len(got) != 1 || !strings.HasSuffix(got[0], "before") {
		t.Errorf("rotated file: %q", got)
	}
	if got := readLines(t, path); len(got) != 1 || !strings.HasSuffix(got[0], "after") {
		t.Errorf("new file: %q", got)
	}
	// After close, reopen must not resurrect the file.
	os.Remove(path)
	if err := l.reopen(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("reopen after close created the file: %v", err)
	}
}

func TestCRILogDiscard(t *testing.T) {
	l, err := openCRILog("")
	if err != nil {
		t.Fatal(err)
	}
	if err := l.copyStream(streamStdout, strings.NewReader("x\ny")); err != nil {
		t.Fatal(err)
	}
	if err := l.reopen(); err != nil {
		t.Fatal(err)
	}
}

func TestWithoutFlag(t *testing.T) {
	got := withoutFlag([]string{"--socket", "/s", "--netns", "/n", "--state-dir=/d", "-netns=/x", "--log-level", "debug"}, "netns")
	want := []string{"--socket", "/s", "--state-dir=/d", "--log-level", "debug"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func TestLongSocketPath(t *testing.T) {
	dir := t.TempDir()
	for len(dir) < 150 {
		dir = filepath.Join(dir, "a-rather-long-directory-name")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "agent.sock")
	l, err := transport.ListenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("socket not at its path: %v", err)
	}
	go func() {
		c, err := l.Accept()
		if err == nil {
			c.Write([]byte("ok"))
			c.Close()
		}
	}()
	c, err := transport.DialUnix(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	buf := make([]byte, 2)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ok" {
		t.Fatalf("read %q, %v", buf, err)
	}
}

// TestCRILogRefusesLinks: a symlink or a FIFO planted at the log path is
// refused, and nothing is written where a link points.
func TestCRILogRefusesLinks(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	if err := os.WriteFile(target, []byte("keep\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "0.log")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if l, err := openCRILog(link); err == nil {
		l.close()
		t.Fatal("a log opened through a symlink")
	} else if !strings.Contains(err.Error(), "symbolic link") {
		t.Errorf("error %q does not say the path is a link", err)
	}
	if b, _ := os.ReadFile(target); string(b) != "keep\n" {
		t.Errorf("the link's target changed: %q", b)
	}
	fifo := filepath.Join(dir, "1.log")
	if err := unix.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	if l, err := openCRILog(fifo); err == nil {
		l.close()
		t.Fatal("a log opened on a FIFO")
	}
	l, err := openCRILog(filepath.Join(dir, "2.log"))
	if err != nil {
		t.Fatal(err)
	}
	l.close()
}
