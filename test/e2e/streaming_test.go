package e2e

import (
	"bytes"
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/client-go/transport/spdy"
	utilexec "k8s.io/client-go/util/exec"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// The streaming tests use client-go's clients of the kubelet's streaming
// protocols, as kubectl does: SPDY (what the kubelet speaks to a runtime)
// and websocket.

// streamBuffer collects a stream's output for a reader on another
// goroutine.
type streamBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *streamBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *streamBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitFor waits until the output holds want.
func (s *streamBuffer) waitFor(t *testing.T, want string) {
	t.Helper()
	testutil.WaitFor(t, stateTimeout, fmt.Sprintf("output %q", want), func() (bool, string) {
		got := s.String()
		return strings.Contains(got, want), got
	})
}

// sizeQueue feeds terminal sizes to an executor.
type sizeQueue chan remotecommand.TerminalSize

func (q sizeQueue) Next() *remotecommand.TerminalSize {
	s, ok := <-q
	if !ok {
		return nil
	}
	return &s
}

// executor is a client of an exec or attach URL, over SPDY or (websocket)
// the channel.k8s.io websocket protocol.
func executor(t *testing.T, rawURL string, websocket bool) remotecommand.Executor {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("streaming URL %q: %v", rawURL, err)
	}
	if u.Scheme != "http" || !strings.HasPrefix(u.Host, "127.0.0.1:") {
		t.Fatalf("streaming URL %q: want http on loopback (the default streaming address)", rawURL)
	}
	var ex remotecommand.Executor
	if websocket {
		ex, err = remotecommand.NewWebSocketExecutorForProtocols(&rest.Config{}, "GET", rawURL, "v4.channel.k8s.io")
	} else {
		ex, err = remotecommand.NewSPDYExecutor(&rest.Config{}, "POST", u)
	}
	if err != nil {
		t.Fatal(err)
	}
	return ex
}

// exitCode is the exit code an exec session reported through err: 0 for
// nil, -1 when err is no exit code.
func exitCode(err error) int {
	if err == nil {
		return 0
	}
	var ee utilexec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitStatus()
	}
	return -1
}

func md5hex(s string) string {
	sum := md5.Sum([]byte(s))
	return hex.EncodeToString(sum[:])
}

// execURL asks for an exec session's URL.
func (e *env) execURL(req *runtimeapi.ExecRequest) string {
	e.t.Helper()
	resp, err := e.rt().Exec(e.ctx(), req)
	if err != nil {
		e.t.Fatalf("Exec %q in %s: %v", req.Cmd, req.ContainerId, err)
	}
	return resp.Url
}

// streamExec runs cmd in a container through the streaming server and
// returns stdout, stderr and the session's error (an exit code, see
// exitCode).
func (e *env) streamExec(ctrID string, websocket bool, stdin io.Reader, cmd ...string) (string, string, error) {
	e.t.Helper()
	u := e.execURL(&runtimeapi.ExecRequest{ContainerId: ctrID, Cmd: cmd, Stdin: stdin != nil, Stdout: true, Stderr: true})
	var out, errOut streamBuffer
	err := executor(e.t, u, websocket).StreamWithContext(e.ctx(), remotecommand.StreamOptions{Stdin: stdin, Stdout: &out, Stderr: &errOut})
	return out.String(), errOut.String(), err
}

// session runs an executor in the background.
type session struct {
	done chan error
}

func startSession(ctx context.Context, ex remotecommand.Executor, opts remotecommand.StreamOptions) *session {
	s := &session{done: make(chan error, 1)}
	go func() { s.done <- ex.StreamWithContext(ctx, opts) }()
	return s
}

func (s *session) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-s.done:
		return err
	case <-time.After(stateTimeout):
		t.Fatal("the streaming session did not end")
		return nil
	}
}

// checkExec runs the exec checks every stage1 must pass in ctr, a running
// container of busybox whose user is root.
func checkExec(t *testing.T, e *env, ctr string) {
	for _, ws := range []bool{false, true} {
		proto := map[bool]string{false: "spdy", true: "websocket"}[ws]
		out, errOut, err := e.streamExec(ctr, ws, nil, "sh", "-c", "echo out; echo err >&2; exit 3")
		if out != "out\n" || errOut != "err\n" || exitCode(err) != 3 {
			t.Errorf("%s exec: stdout %q, stderr %q, err %v; want out, err and exit code 3", proto, out, errOut, err)
		}
	}
	// Stdin, to its end (the websocket protocol runtimes serve, v4, has no
	// way to end stdin: that came with v5, which the API server turns into
	// SPDY towards the kubelet).
	body := strings.Repeat("stdin reaches the command\n", 5000)
	sum, _, err := e.streamExec(ctr, false, strings.NewReader(body), "md5sum")
	if err != nil || !strings.HasPrefix(sum, md5hex(body)) {
		t.Errorf("exec with stdin: %q %v, want the md5 of what was sent", sum, err)
	}

	// A terminal: the size the client sets and later changes, the
	// terminal's own name, input typed on it.
	u := e.execURL(&runtimeapi.ExecRequest{ContainerId: ctr, Cmd: []string{"sh"}, Stdin: true, Stdout: true, Tty: true})
	stdin, typing := io.Pipe()
	defer typing.Close()
	sizes := make(sizeQueue, 1)
	defer close(sizes)
	sizes <- remotecommand.TerminalSize{Width: 100, Height: 40}
	var out streamBuffer
	s := startSession(e.ctx(), executor(t, u, false), remotecommand.StreamOptions{Stdin: stdin, Stdout: &out, Tty: true, TerminalSizeQueue: sizes})
	fmt.Fprintln(typing, `while [ "$(stty size)" != "40 100" ]; do sleep 0.05; done; echo "size=$(stty size) tty=$(tty) term=$TERM"`)
	out.waitFor(t, "term=xterm\r\n")
	if !regexp.MustCompile(`size=40 100 tty=/dev/pts/\d+ term=xterm\r\n`).MatchString(out.String()) {
		t.Errorf("terminal session output:\n%q", out.String())
	}
	sizes <- remotecommand.TerminalSize{Width: 60, Height: 20}
	fmt.Fprintln(typing, `while [ "$(stty size)" != "20 60" ]; do sleep 0.05; done; echo resized; exit 5`)
	if err := s.wait(t); exitCode(err) != 5 || !strings.Contains(out.String(), "resized\r\n") {
		t.Errorf("terminal session: %v, output %q; want exit code 5 after the resize", err, out.String())
	}

	// Refusals come from the CRI call, before any URL.
	_, err = e.rt().Exec(e.ctx(), &runtimeapi.ExecRequest{ContainerId: ctr, Stdout: true})
	requireCode(t, err, codes.InvalidArgument, "Exec without a command")
	_, err = e.rt().Exec(e.ctx(), &runtimeapi.ExecRequest{ContainerId: ctr, Cmd: []string{"true"}, Tty: true, Stdout: true, Stderr: true})
	requireCode(t, err, codes.InvalidArgument, "Exec with a terminal and stderr")
	_, err = e.rt().Exec(e.ctx(), &runtimeapi.ExecRequest{ContainerId: "nosuch", Cmd: []string{"true"}, Stdout: true})
	requireCode(t, err, codes.NotFound, "Exec in an unknown container")
	// A URL serves one session.
	u = e.execURL(&runtimeapi.ExecRequest{ContainerId: ctr, Cmd: []string{"true"}, Stdout: true})
	if err := executor(t, u, false).StreamWithContext(e.ctx(), remotecommand.StreamOptions{Stdout: io.Discard}); err != nil {
		t.Errorf("exec true: %v", err)
	}
	if err := executor(t, u, false).StreamWithContext(e.ctx(), remotecommand.StreamOptions{Stdout: io.Discard}); err == nil {
		t.Errorf("a used exec URL served a second session")
	}
}

// checkAttach runs the attach checks every stage1 must pass in the pod.
func checkAttach(t *testing.T, e *env, podID string, podCfg *runtimeapi.PodSandboxConfig, ns *runtimeapi.NamespaceOption) {
	// A container on a terminal, attached to and detached from twice: it
	// keeps running, and its terminal's output is in its log.
	cfg := e.containerConfig("tty", "sh", "-c", "echo started; exec sh")
	cfg.Linux.SecurityContext.NamespaceOptions = ns
	cfg.Stdin, cfg.Tty = true, true
	ctr := e.createAndStart(podID, podCfg, cfg)
	e.waitLogLine(logPath(podCfg, cfg), "stdout", "started")
	for i := range 2 {
		resp, err := e.rt().Attach(e.ctx(), &runtimeapi.AttachRequest{ContainerId: ctr, Stdin: true, Stdout: true, Tty: true})
		if err != nil {
			t.Fatalf("Attach: %v", err)
		}
		stdin, typing := io.Pipe()
		var out streamBuffer
		s := startSession(e.ctx(), executor(t, resp.Url, false), remotecommand.StreamOptions{Stdin: stdin, Stdout: &out, Tty: true})
		// Input is read once the session receives the output: the
		// answer to the first line reaches it.
		fmt.Fprintf(typing, "echo attached-$((%d*7))\n", 6+i)
		out.waitFor(t, fmt.Sprintf("attached-%d\r\n", (6+i)*7))
		typing.Close() // detach
		if err := s.wait(t); err != nil {
			t.Errorf("attach #%d: %v", i+1, err)
		}
		if st := e.containerStatus(ctr); st.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
			t.Fatalf("after detaching: %s, want RUNNING", st.State)
		}
	}
	e.waitLogLine(logPath(podCfg, cfg), "stdout", "attached-49")

	// A container with stdin_once (kubectl run -i): the first session's
	// end closes its stdin, and the shell reading it exits.
	cfg = e.containerConfig("once", "sh")
	cfg.Linux.SecurityContext.NamespaceOptions = ns
	cfg.Stdin, cfg.StdinOnce = true, true
	ctr = e.createAndStart(podID, podCfg, cfg)
	resp, err := e.rt().Attach(e.ctx(), &runtimeapi.AttachRequest{ContainerId: ctr, Stdin: true, Stdout: true, Stderr: true})
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	var out, errOut streamBuffer
	err = executor(t, resp.Url, false).StreamWithContext(e.ctx(), remotecommand.StreamOptions{
		Stdin: strings.NewReader("echo hello; echo oops >&2\n"), Stdout: &out, Stderr: &errOut,
	})
	if err != nil || out.String() != "hello\n" || errOut.String() != "oops\n" {
		t.Errorf("attach to a stdin_once container: %v, stdout %q, stderr %q", err, out.String(), errOut.String())
	}
	if st := e.waitContainerState(ctr, runtimeapi.ContainerState_CONTAINER_EXITED, stateTimeout); st.ExitCode != 0 {
		t.Errorf("stdin_once container after its session: exit code %d", st.ExitCode)
	}
	_, err = e.rt().Attach(e.ctx(), &runtimeapi.AttachRequest{ContainerId: ctr, Stdout: true})
	requireCode(t, err, codes.FailedPrecondition, "Attach to an exited container")
}

// forward forwards a local port on 127.0.0.1 to port in the pod over
// SPDY, as kubectl port-forward does, and returns the local port; the
// forwarding ends with the test.
func (e *env) forward(podID string, port int32) uint16 {
	t := e.t
	t.Helper()
	resp, err := e.rt().PortForward(e.ctx(), &runtimeapi.PortForwardRequest{PodSandboxId: podID, Port: []int32{port}})
	if err != nil {
		t.Fatalf("PortForward: %v", err)
	}
	u, err := url.Parse(resp.Url)
	if err != nil {
		t.Fatal(err)
	}
	transport, upgrader, err := spdy.RoundTripperFor(&rest.Config{})
	if err != nil {
		t.Fatal(err)
	}
	dialer := spdy.NewDialer(upgrader, &http.Client{Transport: transport}, "POST", u)
	stop, ready := make(chan struct{}), make(chan struct{})
	var errOut streamBuffer
	pf, err := portforward.NewOnAddresses(dialer, []string{"127.0.0.1"}, []string{fmt.Sprintf("0:%d", port)}, stop, ready, io.Discard, &errOut)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- pf.ForwardPorts() }()
	t.Cleanup(func() {
		close(stop)
		if err := <-done; err != nil {
			t.Errorf("port-forward: %v (%s)", err, errOut.String())
		}
	})
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("port-forward: %v (%s)", err, errOut.String())
	case <-time.After(stateTimeout):
		t.Fatal("port-forward not ready")
	}
	ports, err := pf.GetPorts()
	if err != nil || len(ports) != 1 {
		t.Fatalf("forwarded ports: %v %v", ports, err)
	}
	return ports[0].Local
}

// loopbackServer serves body on 127.0.0.1:8080 only: the server is reached
// from inside the pod's network namespace, never through the pod's
// address.
func loopbackServer(body string) []string {
	return []string{"sh", "-c", fmt.Sprintf("mkdir -p /www && echo %s > /www/index.html && exec httpd -f -p 127.0.0.1:8080 -h /www", body)}
}

// checkPortForward forwards to a server on the pod's loopback, several
// connections over one session. web is the server's container.
func checkPortForward(t *testing.T, e *env, podID, web, body string) {
	// A connection the pod refuses ends the whole forwarding in client-go:
	// wait for the server first, from inside the pod.
	testutil.WaitFor(t, stateTimeout, "the server listening in the pod", func() (bool, string) {
		r := e.execSync(web, wget("http://127.0.0.1:8080/")...)
		return r.ExitCode == 0, string(r.Stderr)
	})
	local := e.forward(podID, 8080)
	for range 3 {
		e.waitHTTP(fmt.Sprintf("http://127.0.0.1:%d/", local), body+"\n")
	}
	_, err := e.rt().PortForward(e.ctx(), &runtimeapi.PortForwardRequest{PodSandboxId: "nosuch", Port: []int32{80}})
	requireCode(t, err, codes.NotFound, "PortForward to an unknown pod")
}

// TestStreamingExec: exec with and without a terminal, stdin, resize and
// exit codes, over SPDY and websocket, in fly and nspawn pods.
func TestStreamingExec(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("exec", s)
		pod := e.runStage1Pod(cfg, s)
		ctr := e.createAndStart(pod, cfg, e.netContainer(s, "app", "sleep", "100000"))
		checkExec(t, e, ctr)
	})
}

// TestStreamingAttach: attach to a container on a terminal and to a
// stdin_once container, in fly and nspawn pods.
func TestStreamingAttach(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("attach", s)
		pod := e.runStage1Pod(cfg, s)
		checkAttach(t, e, pod, cfg, s.podNetNS())
	})
}

// TestStreamingPortForward: port-forward to a server listening on the
// loopback of an nspawn pod's and a fly pod's network namespace.
func TestStreamingPortForward(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("pf", s)
		pod := e.runStage1Pod(cfg, s)
		web := e.createAndStart(pod, cfg, e.netContainer(s, "web", loopbackServer("served-in-"+s.handler)...))
		checkPortForward(t, e, pod, web, "served-in-"+s.handler)
	})
}

// TestStreamingKVM: exec, attach and port-forward into a VM pod; the
// forwarded port is the guest's loopback, which nothing on the host can
// reach otherwise.
func TestStreamingKVM(t *testing.T) {
	e := newKVMEnv(t)
	cfg := e.netPodConfig("vm", kvmStage1)
	pod := e.runStage1Pod(cfg, kvmStage1)
	web := e.createAndStart(pod, cfg, e.netContainer(kvmStage1, "web", loopbackServer("served-in-the-vm")...))
	ctr := e.createAndStart(pod, cfg, e.netContainer(kvmStage1, "app", "sleep", "100000"))
	checkPortForward(t, e, pod, web, "served-in-the-vm")
	checkExec(t, e, ctr)
	checkAttach(t, e, pod, cfg, kvmStage1.podNetNS())
}

// TestStreamingAcrossRestart: sessions end with the daemon that served
// them and its URLs with them; after a restart new sessions work, into
// the pods that kept running.
func TestStreamingAcrossRestart(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy}, true)
	cfg := e.netPodConfig("restart", nspawnStage1)
	pod := e.runStage1Pod(cfg, nspawnStage1)
	ctr := e.createAndStart(pod, cfg, e.netContainer(nspawnStage1, "app", "sleep", "100000"))
	web := e.createAndStart(pod, cfg, e.netContainer(nspawnStage1, "web", loopbackServer("still-served")...))

	// A session under way when the daemon stops, and a URL not used yet.
	u := e.execURL(&runtimeapi.ExecRequest{ContainerId: ctr, Cmd: []string{"sh", "-c", "echo started; exec sleep 99999"}, Stdout: true})
	var out streamBuffer
	s := startSession(e.ctx(), executor(t, u, false), remotecommand.StreamOptions{Stdout: &out})
	out.waitFor(t, "started\n")
	unused := e.execURL(&runtimeapi.ExecRequest{ContainerId: ctr, Cmd: []string{"true"}, Stdout: true})

	if err := e.d.Stop(t.Context(), 30*time.Second); err != nil {
		t.Fatalf("stop the daemon: %v", err)
	}
	// The session ends with its connection (client-go reports a dropped
	// connection as a clean end).
	s.wait(t)
	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	if err := e.d.Restart(ctx); err != nil {
		t.Fatalf("restart: %v", err)
	}
	e.waitContainerState(ctr, runtimeapi.ContainerState_CONTAINER_RUNNING, stateTimeout)
	if err := executor(t, unused, false).StreamWithContext(e.ctx(), remotecommand.StreamOptions{Stdout: io.Discard}); err == nil {
		t.Errorf("a URL of the previous daemon served a session")
	}
	// The command of the session that ended was killed with it.
	testutil.WaitFor(t, stateTimeout, "the exec'd sleep gone", func() (bool, string) {
		r := e.execSync(ctr, "ps", "-o", "args")
		return !strings.Contains(string(r.Stdout), "sleep 99999"), string(r.Stdout)
	})
	if out, _, err := e.streamExec(ctr, false, nil, "echo", "after the restart"); err != nil || out != "after the restart\n" {
		t.Errorf("exec after the restart: %q %v", out, err)
	}
	checkPortForward(t, e, pod, web, "still-served")
}
