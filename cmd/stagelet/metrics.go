package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"google.golang.org/grpc"

	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/metrics"
)

// newMetrics returns the daemon's metrics when the configuration enables
// the endpoint, else nil (metrics off: nothing is counted).
func newMetrics(cfg *config.Config) *metrics.Metrics {
	if cfg.Metrics.Address == "" {
		return nil
	}
	return metrics.New()
}

// serveMetrics listens on addr and serves m at /metrics until the returned
// stop is called; a server that fails later reports on errc. Nil m: no
// endpoint, and stop does nothing.
func serveMetrics(log *slog.Logger, addr string, m *metrics.Metrics, errc chan<- error) (stop func(), err error) {
	if m == nil {
		return func() {}, nil
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics.address: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", m.Handler())
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("metrics server: %w", err)
		}
	}()
	log.Info("serving metrics", "address", "http://"+lis.Addr().String()+"/metrics")
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	}, nil
}

// interceptors are the gRPC server options of the CRI server's unary and
// stream interceptors, preceded by m's (nil: metrics off), which then see
// the status codes the CRI server chose.
func interceptors(m *metrics.Metrics, unary grpc.UnaryServerInterceptor, stream grpc.StreamServerInterceptor) []grpc.ServerOption {
	if m == nil {
		return []grpc.ServerOption{grpc.UnaryInterceptor(unary), grpc.StreamInterceptor(stream)}
	}
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(m.UnaryInterceptor(), unary),
		grpc.ChainStreamInterceptor(m.StreamInterceptor(), stream),
	}
}
