package client

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"

	"go.opentelemetry.io/otel/trace"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/errdefs"
)

// Logs runs the OpLogs session of app id (created with AppSpec.HostLog):
// write is given each frame of whole CRI log lines, and the frame is
// acknowledged once write returned nil. A write that fails ends the
// session, unacknowledged: the next session gets the frame again. Logs
// returns nil once the app's output ended and all of it was written.
// A frame that is not whole lines, or longer than api.MaxLogFrame, is refused
// (ErrUnavailable wrapping ErrUntrusted). NotFound, FailedPrecondition (the
// app writes its own log), ErrUnavailable (the agent went away, or a newer
// session replaced this one), ctx's end.
func (c *Client) Logs(ctx context.Context, id string, write func(p []byte) error) error {
	req := &api.Request{Op: api.OpLogs, ID: id}
	conn, _, in, err := c.roundTrip(ctx, req, trace.SpanContext{})
	if err != nil {
		return err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	fw := wire.NewWriter(conn)
	fr := wire.NewReader(in)
	var ack [8]byte
	for {
		typ, p, err := fr.Next()
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("agent: %s: %w", req.Op, ctx.Err())
			}
			return errdefs.New(errdefs.ErrUnavailable, "agent: %s: session: %w", req.Op, err)
		}
		switch typ {
		case api.FrameLog:
			if len(p) == 0 || len(p) > api.MaxLogFrame || p[len(p)-1] != '\n' {
				return c.refuse(req.Op, FieldSession, ReasonInvalid, fmt.Sprintf("a log frame of %d bytes that is not whole lines of at most %d", len(p), api.MaxLogFrame))
			}
			if err := write(p); err != nil {
				return fmt.Errorf("agent: %s: %w", req.Op, err)
			}
			binary.BigEndian.PutUint64(ack[:], uint64(len(p)))
			if err := fw.Send(api.FrameLogAck, ack[:]); err != nil {
				if ctx.Err() != nil {
					return fmt.Errorf("agent: %s: %w", req.Op, ctx.Err())
				}
				return errdefs.New(errdefs.ErrUnavailable, "agent: %s: session: %w", req.Op, err)
			}
		case api.FrameEnd:
			var end api.SessionEnd
			if err := json.Unmarshal(p, &end); err != nil {
				return errdefs.New(errdefs.ErrUnavailable, "agent: %s: bad end of session: %w", req.Op, err)
			}
			c.vetSessionEnd(&end)
			if end.Code != api.CodeOK {
				return errdefs.New(wire.ClassOf(end.Code), "%s", end.Error)
			}
			return nil
		}
	}
}
