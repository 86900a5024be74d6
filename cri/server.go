// Package cri is stagelet's CRI endpoint: it turns k8s.io/cri-api runtime/v1
// requests into the broker's own types and back. Kubernetes types stop here.
// gRPC status codes are chosen here, once, in an interceptor, from errdefs
// error classes; calls are refused with Unavailable until the broker has
// finished recovery.
package cri

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	crierrors "k8s.io/cri-api/pkg/errors"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/logctx"
	"github.com/stagelet/stagelet/tracing"
)

// Server implements the CRI RuntimeService and ImageService. Methods it
// does not implement answer Unimplemented.
type Server struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	runtimeapi.UnimplementedImageServiceServer

	b       *broker.Broker
	log     *slog.Logger
	version string
	// CgroupDriver reported by RuntimeConfig: "cgroupfs" or "systemd".
	cgroupDriver runtimeapi.CgroupDriver
	startedAt    time.Time
	// stream serves exec, attach and port-forward sessions; nil answers
	// those calls Unimplemented.
	stream *StreamServer
	// stopping is closed by Stop: long-lived streams end.
	stopping chan struct{}
	stopOnce sync.Once
	// nodeInfo is what the node's preflight found (SetNodeInfo), shown in
	// verbose Status.
	nodeInfo atomic.Pointer[map[string]string]
	// handlers is Status's list of runtime handlers, made once per policy.
	handlers atomic.Pointer[handlerList]
}

// SetNodeInfo replaces the node facts verbose Status shows beside its own
// (the daemon's preflight report, computed off the status path).
func (s *Server) SetNodeInfo(info map[string]string) { s.nodeInfo.Store(&info) }

// Stop ends the calls that would otherwise last as long as their client
// (GetContainerEvents), so that a graceful stop of the gRPC server does
// not wait for them. Idempotent.
func (s *Server) Stop() { s.stopOnce.Do(func() { close(s.stopping) }) }

// Options configure a Server.
type Options struct {
	Version       string
	SystemdCgroup bool
	Log           *slog.Logger
	// Stream serves the URLs Exec, Attach and PortForward return.
	Stream *StreamServer
}

// New returns a CRI server backed by b.
func New(b *broker.Broker, opts Options) *Server {
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	s := &Server{b: b, log: opts.Log, version: opts.Version, startedAt: time.Now(), cgroupDriver: runtimeapi.CgroupDriver_CGROUPFS, stream: opts.Stream, stopping: make(chan struct{})}
	if opts.SystemdCgroup {
		s.cgroupDriver = runtimeapi.CgroupDriver_SYSTEMD
	}
	return s
}

// Register adds both CRI services to g.
func (s *Server) Register(g *grpc.Server) {
	runtimeapi.RegisterRuntimeServiceServer(g, s)
	runtimeapi.RegisterImageServiceServer(g, s)
}

// Interceptors returns the unary and stream interceptors: readiness gate,
// request logging and error-class → gRPC code mapping. Each call's
// context carries its request ID and the pod and container it names
// (logctx), so every line logged with it down the call, and the line
// reporting its error, can be found by that ID.
func (s *Server) Interceptors() (grpc.UnaryServerInterceptor, grpc.StreamServerInterceptor) {
	unary := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if !s.b.Ready() {
			return nil, status.Error(codes.Unavailable, "stagelet is recovering its pods after a restart; retry shortly")
		}
		ctx = callContext(ctx, req)
		start := time.Now()
		resp, err := handler(ctx, req)
		took := time.Since(start)
		// The logger is not derived per call: most calls (the kubelet's
		// lists, every second) log nothing.
		if err != nil {
			st := toStatus(err)
			lvl := slog.LevelWarn
			if (st.Code() == codes.Unknown || st.Code() == codes.Internal) && !errors.Is(err, crierrors.ErrSignatureValidationFailed) {
				lvl = slog.LevelError
			}
			if st.Code() == codes.NotFound {
				lvl = slog.LevelDebug // the kubelet asks about removed objects routinely
			}
			s.log.Log(ctx, lvl, "CRI call failed", "method", info.FullMethod, "code", st.Code().String(), "err", st.Message(), "took", took)
			return nil, st.Err()
		}
		if s.log.Enabled(ctx, slog.LevelDebug) {
			s.log.DebugContext(ctx, "CRI call", "method", info.FullMethod, "took", took)
		}
		return resp, nil
	}
	stream := func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if !s.b.Ready() {
			return status.Error(codes.Unavailable, "stagelet is recovering its pods after a restart; retry shortly")
		}
		ctx := callContext(ss.Context(), nil)
		log := s.log.With("method", info.FullMethod)
		start := time.Now()
		err := handler(srv, &contextStream{ServerStream: ss, ctx: ctx})
		if err != nil {
			st := toStatus(err)
			lvl := slog.LevelWarn
			if st.Code() == codes.Canceled {
				lvl = slog.LevelDebug // the client went away
			}
			log.Log(ctx, lvl, "CRI stream failed", "code", st.Code().String(), "err", st.Message(), "took", time.Since(start))
			return st.Err()
		}
		log.DebugContext(ctx, "CRI stream ended", "took", time.Since(start))
		return nil
	}
	return unary, stream
}

// callContext is ctx carrying a new request ID and the pod and container
// IDs req names, for log lines (logctx).
func callContext(ctx context.Context, req any) context.Context {
	id := requestID()
	args := []any{"req", id}
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		// A traced call: its span names the request, its lines the trace.
		span.SetAttributes(attribute.String("stagelet.request_id", id))
		traceID, _ := tracing.IDs(ctx)
		args = append(args, "trace_id", traceID)
	}
	if r, ok := req.(interface{ GetPodSandboxId() string }); ok && r.GetPodSandboxId() != "" {
		args = append(args, "pod", r.GetPodSandboxId())
	}
	if r, ok := req.(interface{ GetContainerId() string }); ok && r.GetContainerId() != "" {
		args = append(args, "container", r.GetContainerId())
	}
	return logctx.With(ctx, args...)
}

// contextStream is a server stream whose handler sees ctx.
type contextStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *contextStream) Context() context.Context { return s.ctx }

func requestID() string {
	var b [6]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// toStatus maps an error to a gRPC status by its errdefs class.
func toStatus(err error) *status.Status {
	if st, ok := status.FromError(err); ok {
		return st
	}
	code := codes.Unknown
	switch {
	case errors.Is(err, crierrors.ErrSignatureValidationFailed):
		// The kubelet recognizes the reason by the message's prefix,
		// which it sees only in an Unknown status.
		code = codes.Unknown
	case errors.Is(err, errdefs.ErrNotFound):
		code = codes.NotFound
	case errors.Is(err, errdefs.ErrAlreadyExists):
		code = codes.AlreadyExists
	case errors.Is(err, errdefs.ErrInvalidArgument):
		code = codes.InvalidArgument
	case errors.Is(err, errdefs.ErrFailedPrecondition):
		code = codes.FailedPrecondition
	case errors.Is(err, errdefs.ErrPermissionDenied):
		code = codes.PermissionDenied
	case errors.Is(err, errdefs.ErrUnavailable):
		code = codes.Unavailable
	case errors.Is(err, errdefs.ErrUnimplemented):
		code = codes.Unimplemented
	case errors.Is(err, errdefs.ErrResourceExhausted):
		code = codes.ResourceExhausted
	case errors.Is(err, errdefs.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		code = codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		code = codes.Canceled
	default:
		code = codes.Internal
	}
	return status.New(code, err.Error())
}

// badRequest is InvalidArgument naming the field.
func badRequest(field string) error {
	return errdefs.InvalidArgument("%s: must be set", field)
}

// statusPath are the calls of the status path: they answer from memory,
// the kubelet makes them every second or so, and they are not traced.
var statusPath = map[string]bool{}

func init() {
	for _, m := range []string{
		"RuntimeService/Version", "RuntimeService/Status", "RuntimeService/RuntimeConfig",
		"RuntimeService/ListPodSandbox", "RuntimeService/PodSandboxStatus",
		"RuntimeService/ListContainers", "RuntimeService/ContainerStatus",
		"RuntimeService/ListContainerStats", "RuntimeService/ContainerStats",
		"RuntimeService/ListPodSandboxStats", "RuntimeService/PodSandboxStats",
		"RuntimeService/ListMetricDescriptors", "RuntimeService/ListPodSandboxMetrics",
		"RuntimeService/GetContainerEvents",
		"ImageService/ListImages", "ImageService/ImageStatus", "ImageService/ImageFsInfo",
	} {
		statusPath["/runtime.v1."+m] = true
	}
}

// StatusPath says whether fullMethod ("/runtime.v1.RuntimeService/Status")
// is a call of the status path: one that answers from what the daemon
// holds and that the kubelet makes every second or so. Such calls are not
// traced: a trace of each would bury the ones of the calls that change
// something.
func StatusPath(fullMethod string) bool { return statusPath[fullMethod] }
