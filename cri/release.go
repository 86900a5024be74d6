package cri

import (
	"context"
	"runtime/debug"
	"sync/atomic"

	"google.golang.org/grpc/stats"
)

// largeReply is the size of a reply whose memory the daemon gives back to
// the system once it is sent.
const largeReply = 1 << 20

// replyRelease is a gRPC stats handler: when a call marked by
// markLargeReply ends, its reply written, the daemon returns the freed
// memory to the system at once, so that one large ExecSync output does
// not leave it at many times its idle size until the runtime's scavenger
// gets round to it.
type replyRelease struct{}

type largeReplyKey struct{}

// execSyncMethod is the only call whose reply can be large.
const execSyncMethod = "/runtime.v1.RuntimeService/ExecSync"

func (replyRelease) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	if info.FullMethodName != execSyncMethod {
		return ctx
	}
	return context.WithValue(ctx, largeReplyKey{}, new(atomic.Bool))
}

func (replyRelease) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, end := s.(*stats.End); !end {
		return
	}
	if large, _ := ctx.Value(largeReplyKey{}).(*atomic.Bool); large != nil && large.Load() {
		go debug.FreeOSMemory()
	}
}

func (replyRelease) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }

func (replyRelease) HandleConn(context.Context, stats.ConnStats) {}

// markLargeReply asks for the call's memory to be released once its reply
// of size bytes is sent, when it is large.
func markLargeReply(ctx context.Context, size int) {
	if large, _ := ctx.Value(largeReplyKey{}).(*atomic.Bool); large != nil && size >= largeReply {
		large.Store(true)
	}
}

// StatsHandler is the gRPC stats handler the server is to be made with
// (grpc.StatsHandler).
func (s *Server) StatsHandler() stats.Handler { return replyRelease{} }
