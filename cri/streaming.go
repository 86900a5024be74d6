package cri

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-streaming/pkg/streaming"
	"k8s.io/cri-streaming/pkg/streaming/remotecommand"
	utilexec "k8s.io/utils/exec"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/errdefs"
)

// StreamServer is the HTTP server behind the URLs Exec, Attach and
// PortForward return: the kubelet's own streaming server
// (k8s.io/cri-streaming, SPDY and websocket), whose one-time tokens expire
// after a minute, running every session through the broker.
type StreamServer struct {
	lib  streaming.Server
	http *http.Server
	l    net.Listener
	log  *slog.Logger
}

// NewStreamServer listens on addr ("host:port"; port 0 picks a free port,
// which the URLs then carry). Serve serves it.
func NewStreamServer(b *broker.Broker, addr string, log *slog.Logger) (*StreamServer, error) {
	if log == nil {
		log = slog.Default()
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("streaming server: %w", err)
	}
	cfg := streaming.DefaultConfig
	cfg.Addr = l.Addr().String()
	lib, err := streaming.NewServer(cfg, &streamRuntime{b: b, log: log})
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("streaming server: %w", err)
	}
	return &StreamServer{
		lib:  lib,
		http: &http.Server{Handler: lib, ReadHeaderTimeout: 30 * time.Second},
		l:    l,
		log:  log,
	}, nil
}

// Addr is the address the server listens on.
func (s *StreamServer) Addr() string { return s.l.Addr().String() }

// Serve serves until Close; it returns nil then.
func (s *StreamServer) Serve() error {
	err := s.http.Serve(s.l)
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}

// Close stops listening. Sessions under way end when the daemon exits;
// their pods' agents then kill exec'd commands and detach attachments.
func (s *StreamServer) Close() error { return s.http.Close() }

// Exec returns the URL of an exec session in a running container.
func (s *Server) Exec(ctx context.Context, r *runtimeapi.ExecRequest) (*runtimeapi.ExecResponse, error) {
	if s.stream == nil {
		return nil, errdefs.New(errdefs.ErrUnimplemented, "streaming is not configured")
	}
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	if err := broker.CheckCommand("cmd", r.GetCmd()); err != nil {
		return nil, err
	}
	if err := s.b.CheckRunning(ctx, r.GetContainerId()); err != nil {
		return nil, err
	}
	return s.stream.lib.GetExec(r)
}

// Attach returns the URL of an attach session to a running container.
func (s *Server) Attach(ctx context.Context, r *runtimeapi.AttachRequest) (*runtimeapi.AttachResponse, error) {
	if s.stream == nil {
		return nil, errdefs.New(errdefs.ErrUnimplemented, "streaming is not configured")
	}
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	if err := s.b.CheckRunning(ctx, r.GetContainerId()); err != nil {
		return nil, err
	}
	return s.stream.lib.GetAttach(r)
}

// PortForward returns the URL of a port-forward session into a ready pod.
func (s *Server) PortForward(ctx context.Context, r *runtimeapi.PortForwardRequest) (*runtimeapi.PortForwardResponse, error) {
	if s.stream == nil {
		return nil, errdefs.New(errdefs.ErrUnimplemented, "streaming is not configured")
	}
	if r.GetPodSandboxId() == "" {
		return nil, badRequest("pod_sandbox_id")
	}
	for _, p := range r.GetPort() {
		if p <= 0 || p > 65535 {
			return nil, errdefs.InvalidArgument("port: %d is not a TCP port", p)
		}
	}
	if err := s.b.CheckPodReady(ctx, r.GetPodSandboxId()); err != nil {
		return nil, err
	}
	return s.stream.lib.GetPortForward(r)
}

// streamRuntime runs the streaming library's sessions through the broker.
type streamRuntime struct {
	b   *broker.Broker
	log *slog.Logger
}

var _ streaming.Runtime = (*streamRuntime)(nil)

// Exec runs an exec session; a non-zero exit code is an ExitError, which
// the library reports to the client as the command's exit code.
func (r *streamRuntime) Exec(ctx context.Context, id string, cmd []string, in io.Reader, out, errOut io.WriteCloser, tty bool, resize <-chan remotecommand.TerminalSize) error {
	start := time.Now()
	sio, stop := streamIO(in, out, errOut, tty, resize)
	defer stop()
	code, err := r.b.Exec(ctx, id, cmd, sio)
	r.log.DebugContext(ctx, "exec session", "container", id, "cmd", cmd, "tty", tty, "code", code, "err", err, "took", time.Since(start))
	if err != nil {
		return err
	}
	if code != 0 {
		return utilexec.CodeExitError{Err: fmt.Errorf("command terminated with exit code %d", code), Code: int(code)}
	}
	return nil
}

// Attach runs an attach session.
func (r *streamRuntime) Attach(ctx context.Context, id string, in io.Reader, out, errOut io.WriteCloser, tty bool, resize <-chan remotecommand.TerminalSize) error {
	start := time.Now()
	sio, stop := streamIO(in, out, errOut, tty, resize)
	defer stop()
	err := r.b.Attach(ctx, id, sio)
	r.log.DebugContext(ctx, "attach session", "container", id, "err", err, "took", time.Since(start))
	return err
}

// PortForward runs one forwarded connection.
func (r *streamRuntime) PortForward(ctx context.Context, podID string, port int32, stream io.ReadWriteCloser) error {
	start := time.Now()
	err := r.b.PortForward(ctx, podID, port, stream)
	r.log.DebugContext(ctx, "port-forward session", "pod", podID, "port", port, "err", err, "took", time.Since(start))
	return err
}

// streamIO turns the library's streams into the broker's. Absent streams
// stay nil (not typed nils). stop ends the resize relay.
func streamIO(in io.Reader, out, errOut io.WriteCloser, tty bool, resize <-chan remotecommand.TerminalSize) (broker.StreamIO, func()) {
	sio := broker.StreamIO{TTY: tty}
	if in != nil {
		sio.Stdin = in
	}
	if out != nil {
		sio.Stdout = out
	}
	if errOut != nil {
		sio.Stderr = errOut
	}
	if resize == nil {
		return sio, func() {}
	}
	sizes := make(chan api.TerminalSize)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case sz, ok := <-resize:
				if !ok {
					return
				}
				select {
				case sizes <- api.TerminalSize{Width: sz.Width, Height: sz.Height}:
				case <-done:
					return
				}
			case <-done:
				return
			}
		}
	}()
	sio.Resize = sizes
	return sio, func() { close(done) }
}
