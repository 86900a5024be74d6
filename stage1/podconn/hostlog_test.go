package podconn_test

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// waitFile waits until the file at path holds want (as a substring).
func waitFile(t *testing.T, path, want string) {
	t.Helper()
	testutil.WaitFor(t, 10*time.Second, path+" holds "+want, func() (bool, string) {
		b, _ := os.ReadFile(path)
		return strings.Contains(string(b), want), string(b)
	})
}

// TestHostLog: a container with HostLog has its CRI log written on the
// host by the connection; a long line is split into P and F lines; a
// reopen after the file was renamed (the kubelet's rotation) puts the
// next lines in a new file and loses none; removing the container stops
// the writer.
func TestHostLog(t *testing.T) {
	_, pod := startPod(t)
	c := podconn.Connect(pod, nil)
	ctx := testContext(t)
	logPath := filepath.Join(t.TempDir(), "pod", "c", "0.log")
	spec := app(t, "c", "cat")
	spec.LogPath, spec.HostLog, spec.Stdin = logPath, true, true
	if _, err := c.CreateContainer(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartContainer(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	stdin, typing := io.Pipe()
	defer typing.Close()
	attached := make(chan error, 1)
	go func() { attached <- c.Attach(ctx, "c", client.StreamIO{Stdin: stdin}) }()

	long := strings.Repeat("x", 16*1024+5)
	io.WriteString(typing, "one\n"+long+"\n")
	waitFile(t, logPath, " stdout F xxxxx\n")
	b, _ := os.ReadFile(logPath)
	lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
	if len(lines) != 3 || !strings.HasSuffix(lines[0], " stdout F one") || !strings.HasSuffix(lines[1], " stdout P "+long[:16*1024]) {
		t.Fatalf("log:\n%.300s", b)
	}
	if fi, err := os.Stat(logPath); err != nil || fi.Mode().Perm() != 0o640 {
		t.Errorf("log file: %v, %v", fi.Mode(), err)
	}

	rotated := logPath + ".1"
	if err := os.Rename(logPath, rotated); err != nil {
		t.Fatal(err)
	}
	io.WriteString(typing, "two\n")
	waitFile(t, rotated, " stdout F two\n") // the file stays open until the reopen
	if err := c.ReopenLog(ctx, "c"); err != nil {
		t.Fatalf("reopen: %v", err)
	}
	io.WriteString(typing, "three\n")
	waitFile(t, logPath, " stdout F three\n")
	if b, _ := os.ReadFile(logPath); strings.Count(string(b), "\n") != 1 {
		t.Errorf("the new file holds more than the line after the reopen:\n%s", b)
	}
	if c.LogErrors() != 0 {
		t.Errorf("%d log errors", c.LogErrors())
	}
	typing.Close()
	if err := <-attached; err != nil {
		t.Errorf("attach: %v", err)
	}
	if err := c.RemoveContainer(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	// Removing it stopped the writer: a reopen goes to the agent,
	// which knows no such app.
	if err := c.ReopenLog(ctx, "c"); err == nil {
		t.Error("reopen of a removed container's log succeeded")
	}
}

// TestHostLogFollowAgain: a second connection (a daemon that restarted)
// follows a log the first one stopped following, and writes what the
// agent held meanwhile.
func TestHostLogFollowAgain(t *testing.T) {
	_, pod := startPod(t)
	first := podconn.Connect(pod, nil)
	ctx := testContext(t)
	logPath := filepath.Join(t.TempDir(), "0.log")
	spec := app(t, "c", "sh", "-c", "echo before; cat; echo after")
	spec.LogPath, spec.HostLog, spec.Stdin, spec.StdinOnce = logPath, true, true, true
	if _, err := first.CreateContainer(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if _, err := first.StartContainer(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	waitFile(t, logPath, " stdout F before\n")
	first.StopLogs()
	stdin, typing := io.Pipe()
	attached := make(chan error, 1)
	go func() { attached <- first.Attach(ctx, "c", client.StreamIO{Stdin: stdin}) }()
	io.WriteString(typing, "while away\n")
	typing.Close()
	second := podconn.Connect(pod, nil)
	second.FollowLog("c", logPath)
	waitFile(t, logPath, " stdout F after\n")
	// The app's exit waited for its last line to be written.
	if err := <-attached; err != nil {
		t.Fatalf("attach: %v", err)
	}
	b, _ := os.ReadFile(logPath)
	if strings.Count(string(b), " stdout F ") != 3 || !strings.Contains(string(b), " stdout F while away\n") {
		t.Errorf("log:\n%s", b)
	}
	second.StopLogs()
}
