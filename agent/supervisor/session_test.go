package supervisor_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
)

// syncBuffer is a bytes buffer for output written by one goroutine and
// read by another.
type syncBuffer struct{ lockedBuffer }

// waitFor waits until the buffer holds want.
func (b *syncBuffer) waitFor(t *testing.T, want string) {
	t.Helper()
	testutil.WaitFor(t, 20*time.Second, fmt.Sprintf("output %q", want), func() (bool, string) {
		s := b.String()
		return strings.Contains(s, want), s
	})
}

// session runs an exec or attach in the background; wait returns its
// outcome.
type session struct {
	done chan struct{}
	code int32
	err  error
}

func (s *session) wait(t *testing.T) (int32, error) {
	t.Helper()
	select {
	case <-s.done:
		return s.code, s.err
	case <-time.After(30 * time.Second):
		t.Fatal("session did not end")
		return 0, nil
	}
}

func (ta *testAgent) execStream(id string, cmd []string, sio client.StreamIO) *session {
	s := &session{done: make(chan struct{})}
	go func() {
		defer close(s.done)
		s.code, s.err = ta.c.ExecStream(ctx(ta.t), id, cmd, sio)
	}()
	return s
}

func (ta *testAgent) attach(c context.Context, id string, sio client.StreamIO) *session {
	s := &session{done: make(chan struct{})}
	go func() {
		defer close(s.done)
		s.err = ta.c.Attach(c, id, sio)
	}()
	return s
}

// stdinPipe is a session's stdin the test writes to; it is closed when the
// test ends.
func stdinPipe(t *testing.T) (*io.PipeReader, *io.PipeWriter) {
	r, w := io.Pipe()
	t.Cleanup(func() { r.Close(); w.Close() })
	return r, w
}

func TestExecStream(t *testing.T) {
	ta := startAgent(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: makeRootfs(t), Args: []string{"sleep", "1000"}, Env: []string{"PATH=/bin"}})

	var out, errOut syncBuffer
	code, err := ta.c.ExecStream(ctx(t), "a", sh("echo out; echo err >&2; exit 3"), client.StreamIO{Stdout: &out, Stderr: &errOut})
	if err != nil || code != 3 || out.String() != "out\n" || errOut.String() != "err\n" {
		t.Errorf("exec: code %d, err %v, stdout %q, stderr %q", code, err, out.String(), errOut.String())
	}

	// Stdin goes to the command, and its end closes the command's stdin.
	in := strings.NewReader(strings.Repeat("0123456789", 10000))
	out = syncBuffer{}
	code, err = ta.c.ExecStream(ctx(t), "a", []string{"wc", "-c"}, client.StreamIO{Stdin: in, Stdout: &out})
	if err != nil || code != 0 || strings.TrimSpace(out.String()) != "100000" {
		t.Errorf("exec with stdin: code %d, err %v, stdout %q", code, err, out.String())
	}

	// Output the client did not ask for is not sent.
	out = syncBuffer{}
	if code, err := ta.c.ExecStream(ctx(t), "a", sh("echo out; echo err >&2"), client.StreamIO{Stdout: &out}); err != nil || code != 0 || out.String() != "out\n" {
		t.Errorf("exec without stderr: code %d, err %v, stdout %q", code, err, out.String())
	}

	if _, err := ta.c.ExecStream(ctx(t), "a", []string{"nosuch"}, client.StreamIO{Stdout: &out}); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "not found in $PATH") {
		t.Errorf("exec nosuch: %v", err)
	}
	if _, err := ta.c.ExecStream(ctx(t), "nosuch", []string{"true"}, client.StreamIO{Stdout: &out}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("exec in an unknown app: %v", err)
	}
	if _, err := ta.c.ExecStream(ctx(t), "a", []string{"true"}, client.StreamIO{Stdout: &out, Stderr: &out, TTY: true}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("exec with a terminal and stderr: %v", err)
	}
}

func TestExecStreamTerminal(t *testing.T) {
	ta := startAgent(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: makeRootfs(t), Args: []string{"sleep", "1000"}, UID: 1000, GID: 1000, Env: []string{"PATH=/bin"}})

	stdin, typing := stdinPipe(t)
	var out syncBuffer
	resize := make(chan api.TerminalSize, 1)
	resize <- api.TerminalSize{Width: 101, Height: 41}
	s := ta.execStream("a", []string{"sh"}, client.StreamIO{Stdin: stdin, Stdout: &out, TTY: true, Resize: resize})

	// The shell runs on a terminal of the app's own devpts, owned by the
	// app's user, and sees the size the client set.
	fmt.Fprintln(typing, `while [ "$(stty size)" != "41 101" ]; do sleep 0.05; done; echo "size=$(stty size)"; echo "tty=$(tty)"; ls -ln $(tty) | awk '{print "owner=" $3}'; echo TERM=$TERM; echo "end-$((20+6))"`)
	// The terminal echoes the command line too: wait for what only its
	// run prints, after the lines checked.
	out.waitFor(t, "end-26\r\n")
	text := out.String()
	for _, want := range []string{"size=41 101\r\n", "owner=1000\r\n", "TERM=xterm\r\n"} {
		if !strings.Contains(text, want) {
			t.Errorf("terminal output lacks %q:\n%q", want, text)
		}
	}
	if !regexp.MustCompile(`tty=/dev/pts/\d+\r\n`).MatchString(text) {
		t.Errorf("the command's terminal is not in the app's /dev/pts:\n%q", text)
	}
	// A later resize reaches the running shell.
	resize <- api.TerminalSize{Width: 70, Height: 20}
	fmt.Fprintln(typing, `while [ "$(stty size)" != "20 70" ]; do sleep 0.05; done; echo resized; exit 4`)
	code, err := s.wait(t)
	if err != nil || code != 4 || !strings.Contains(out.String(), "resized\r\n") {
		t.Errorf("exec: code %d, err %v, output %q", code, err, out.String())
	}

	// The end of the client's input is the end of the terminal's input.
	out = syncBuffer{}
	code, err = ta.c.ExecStream(ctx(t), "a", sh("cat; echo done"), client.StreamIO{Stdin: strings.NewReader("typed\n"), Stdout: &out, TTY: true})
	if err != nil || code != 0 || !strings.Contains(out.String(), "typed\r\n") || !strings.Contains(out.String(), "done\r\n") {
		t.Errorf("exec cat: code %d, err %v, output %q", code, err, out.String())
	}
}

// TestExecStreamClientGone: a client that goes away has its command
// killed.
func TestExecStreamClientGone(t *testing.T) {
	ta := startAgent(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: makeRootfs(t), Args: []string{"sleep", "1000"}, Env: []string{"PATH=/bin"}})
	c, cancel := context.WithCancel(ctx(t))
	var out syncBuffer
	s := &session{done: make(chan struct{})}
	go func() {
		defer close(s.done)
		s.code, s.err = ta.c.ExecStream(c, "a", sh("echo started; exec sleep 999"), client.StreamIO{Stdout: &out})
	}()
	out.waitFor(t, "started\n")
	cancel()
	if _, err := s.wait(t); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled exec: %v", err)
	}
	testutil.WaitFor(t, 10*time.Second, "the exec'd command killed: only the app left in its cgroup", func() (bool, string) {
		pids, err := ta.cg.Child("app-a").Procs()
		return err == nil && len(pids) == 1, fmt.Sprint(pids, err)
	})
}

func TestAttachStdinOnce(t *testing.T) {
	ta := startAgent(t)
	logPath := filepath.Join(t.TempDir(), "a.log")
	ta.run(&api.AppSpec{ID: "a", Rootfs: makeRootfs(t), Args: []string{"sh"}, Env: []string{"PATH=/bin"}, LogPath: logPath, Stdin: true, StdinOnce: true})

	stdin, typing := stdinPipe(t)
	var out, errOut syncBuffer
	s := ta.attach(ctx(t), "a", client.StreamIO{Stdin: stdin, Stdout: &out, Stderr: &errOut})
	fmt.Fprintln(typing, "echo hello; echo oops >&2")
	out.waitFor(t, "hello\n")
	errOut.waitFor(t, "oops\n")
	// The end of the first session's input closes the app's stdin: the
	// shell reads end of file and exits, which ends the session.
	typing.Close()
	if _, err := s.wait(t); err != nil {
		t.Errorf("attach: %v", err)
	}
	st := ta.waitExited("a")
	if st.ExitCode != 0 {
		t.Errorf("app: %+v", st)
	}
	// Its output went to its log as well.
	b, _ := os.ReadFile(logPath)
	if !strings.Contains(string(b), " stdout F hello\n") || !strings.Contains(string(b), " stderr F oops\n") {
		t.Errorf("log:\n%s", b)
	}
	if err := ta.c.Attach(ctx(t), "a", client.StreamIO{Stdout: &out}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("attach to an exited app: %v", err)
	}
}

// TestAttachDetach: without StdinOnce, ending a session's input detaches
// it and the app keeps running; two sessions see the same output.
func TestAttachDetach(t *testing.T) {
	ta := startAgent(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: makeRootfs(t), Args: []string{"sh"}, Env: []string{"PATH=/bin"}, Stdin: true})

	var watcher syncBuffer
	wctx, stopWatching := context.WithCancel(ctx(t))
	w := ta.attach(wctx, "a", client.StreamIO{Stdout: &watcher})

	for _, word := range []string{"one", "two"} {
		stdin, typing := stdinPipe(t)
		var out syncBuffer
		s := ta.attach(ctx(t), "a", client.StreamIO{Stdin: stdin, Stdout: &out})
		// The session's input is read once it is subscribed to the
		// output: the answer to the first line reaches it.
		fmt.Fprintf(typing, "echo %s\n", word)
		out.waitFor(t, word+"\n")
		typing.Close()
		if _, err := s.wait(t); err != nil {
			t.Errorf("attach %s: %v", word, err)
		}
		if st, err := ta.c.Status(ctx(t), "a"); err != nil || st.State != api.StateRunning {
			t.Fatalf("after detaching: %+v %v", st, err)
		}
	}
	watcher.waitFor(t, "two\n")
	stopWatching()
	if _, err := w.wait(t); !errors.Is(err, context.Canceled) {
		t.Errorf("watcher: %v", err)
	}
}

// TestAttachTerminal: an app on a terminal logs its output as stdout and
// takes input and window sizes from a session; with StdinOnce, the end of
// the session's input is the terminal's end-of-file character.
func TestAttachTerminal(t *testing.T) {
	ta := startAgent(t)
	logPath := filepath.Join(t.TempDir(), "a.log")
	// cat reads the terminal in canonical (line) mode throughout, where
	// the end-of-file character is sure to end its input. (A shell's line
	// editor switches modes between lines: one that switches the instant
	// the character arrives misses it.)
	script := `echo started; while [ "$(stty size)" != "33 99" ]; do sleep 0.05; done; echo "sized $(tty)"; cat; echo cat-done`
	ta.run(&api.AppSpec{ID: "a", Rootfs: makeRootfs(t), Args: sh(script), Env: []string{"PATH=/bin"}, LogPath: logPath, TTY: true, Stdin: true, StdinOnce: true})
	testutil.WaitFor(t, 20*time.Second, "the app's first line in its log", func() (bool, string) {
		b, _ := os.ReadFile(logPath)
		return strings.Contains(string(b), " stdout F started\n"), string(b)
	})

	stdin, typing := stdinPipe(t)
	var out syncBuffer
	resize := make(chan api.TerminalSize, 1)
	resize <- api.TerminalSize{Width: 99, Height: 33}
	s := ta.attach(ctx(t), "a", client.StreamIO{Stdin: stdin, Stdout: &out, Stderr: &out, TTY: true, Resize: resize})
	out.waitFor(t, "sized /dev/pts/")
	fmt.Fprintln(typing, "typed")
	out.waitFor(t, "typed\r\ntyped\r\n") // the terminal's echo, then cat's
	typing.Close()
	if _, err := s.wait(t); err != nil {
		t.Errorf("attach: %v", err)
	}
	if st := ta.waitExited("a"); st.ExitCode != 0 {
		t.Errorf("app after its terminal's input ended: %+v", st)
	}
	b, _ := os.ReadFile(logPath)
	if !regexp.MustCompile(` stdout F sized /dev/pts/\d+\n(.* stdout F typed\n){2}.* stdout F cat-done\n`).Match(b) {
		t.Errorf("the terminal's output is not in the log as stdout lines:\n%s", b)
	}
}

// TestPortForward: the agent connects to a port on its network
// namespace's loopback and passes each side's end on as a half-close.
func TestPortForward(t *testing.T) {
	ta := startAgent(t)
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b, _ := io.ReadAll(c) // until the client's half-close
				fmt.Fprintf(c, "got %d bytes ending %q", len(b), b[max(0, len(b)-4):])
			}()
		}
	}()
	port := int32(l.Addr().(*net.TCPAddr).Port)
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var got lockedBuffer
			body := strings.Repeat("x", 200000) + fmt.Sprintf("end%d", i)
			stream := struct {
				io.Reader
				io.Writer
			}{strings.NewReader(body), &got}
			if err := ta.c.PortForward(ctx(t), port, stream); err != nil {
				t.Errorf("port-forward %d: %v", i, err)
			}
			if want := fmt.Sprintf("got %d bytes ending %q", len(body), fmt.Sprintf("end%d", i)); got.String() != want {
				t.Errorf("port-forward %d: %q, want %q", i, got.String(), want)
			}
		}()
	}
	wg.Wait()

	l.Close()
	if err := ta.c.PortForward(ctx(t), port, struct {
		io.Reader
		io.Writer
	}{strings.NewReader(""), io.Discard}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("port-forward to a closed port: %v", err)
	}
	if err := ta.c.PortForward(ctx(t), 70000, nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("port-forward to port 70000: %v", err)
	}
}
