// Package otlpsink is an OTLP/gRPC trace receiver for tests: it serves the
// collector's TraceService (the OTLP protobuf service) on a loopback port
// and keeps every span it is sent, so a test can check the spans the
// daemon exported, parents included.
package otlpsink

import (
	"context"
	"encoding/hex"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
)

// Span is one received span, its IDs in hex.
type Span struct {
	Name, TraceID, SpanID, ParentID string
	// Service is the resource's service.name.
	Service string
	Attrs   map[string]string
	// Error: the span's status is Error; Message is its description.
	Error   bool
	Message string
	// Start and End are when the span began and ended.
	Start, End time.Time
}

// Sink receives spans on Addr until the test ends.
type Sink struct {
	Addr string

	coltracepb.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []Span
}

// Start serves a sink on 127.0.0.1 and stops it when t ends.
func Start(t testing.TB) *Sink {
	t.Helper()
	return StartAddr(t, "127.0.0.1:0")
}

// StartAddr serves a sink on addr (host:port; port 0 for any) and stops
// it when t ends.
func StartAddr(t testing.TB, addr string) *Sink {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &Sink{Addr: lis.Addr().String()}
	g := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(g, s)
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	return s
}

// Export implements the OTLP TraceService.
func (s *Sink) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				s.spans = append(s.spans, convert(sp, service))
			}
		}
	}
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

func convert(sp *tracepb.Span, service string) Span {
	out := Span{
		Name: sp.GetName(), TraceID: hex.EncodeToString(sp.GetTraceId()), SpanID: hex.EncodeToString(sp.GetSpanId()),
		ParentID: hex.EncodeToString(sp.GetParentSpanId()), Service: service, Attrs: map[string]string{},
		Error: sp.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR, Message: sp.GetStatus().GetMessage(),
		Start: time.Unix(0, int64(sp.GetStartTimeUnixNano())), End: time.Unix(0, int64(sp.GetEndTimeUnixNano())),
	}
	for _, kv := range sp.GetAttributes() {
		switch v := kv.GetValue().GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			out.Attrs[kv.GetKey()] = v.StringValue
		case *commonpb.AnyValue_BoolValue:
			out.Attrs[kv.GetKey()] = strconv.FormatBool(v.BoolValue)
		case *commonpb.AnyValue_IntValue:
			out.Attrs[kv.GetKey()] = strconv.FormatInt(v.IntValue, 10)
		default:
			out.Attrs[kv.GetKey()] = kv.GetValue().String()
		}
	}
	return out
}

// Trace is every span received so far of trace id (hex).
func (s *Sink) Trace(id string) []Span {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Span
	for _, sp := range s.spans {
		if sp.TraceID == id {
			out = append(out, sp)
		}
	}
	return out
}

// All is every span received so far.
func (s *Sink) All() []Span {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Span(nil), s.spans...)
}
