package logctx

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
)

func newLogger(buf *bytes.Buffer) *slog.Logger {
	return slog.New(NewHandler(slog.NewTextHandler(buf, &slog.HandlerOptions{
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey && len(groups) == 0 {
				return slog.Attr{}
			}
			return a
		},
	})))
}

func TestContextAttrs(t *testing.T) {
	var buf bytes.Buffer
	log := newLogger(&buf)
	ctx := With(context.Background(), "req", "r1")
	ctx = With(ctx, "pod", "p1", slog.String("container", "c1"))
	for _, c := range []struct {
		log  func()
		want string
	}{
		{func() { log.InfoContext(ctx, "started") }, `level=INFO msg=started req=r1 pod=p1 container=c1`},
		// The line's own pod wins; the request ID is still added.
		{func() { log.WarnContext(ctx, "failed", "pod", "p2") }, `level=WARN msg=failed pod=p2 req=r1 container=c1`},
		// So does the logger's.
		{func() { log.With("pod", "p3").InfoContext(ctx, "x") }, `level=INFO msg=x pod=p3 req=r1 container=c1`},
		// Without the context, nothing is added.
		{func() { log.Info("plain") }, `level=INFO msg=plain`},
		// A later With replaces a key.
		{func() { log.InfoContext(With(ctx, "pod", "p4"), "y") }, `level=INFO msg=y req=r1 pod=p4 container=c1`},
	} {
		buf.Reset()
		c.log()
		if got := strings.TrimSpace(buf.String()); got != c.want {
			t.Errorf("got  %s\nwant %s", got, c.want)
		}
	}
	if got := Attrs(context.Background()); got != nil {
		t.Errorf("a bare context carries %v", got)
	}
}

func TestGroupsKeepContextAttrsOut(t *testing.T) {
	var buf bytes.Buffer
	ctx := With(context.Background(), "req", "r1")
	newLogger(&buf).WithGroup("g").InfoContext(ctx, "m", "k", "v")
	if got := strings.TrimSpace(buf.String()); got != `level=INFO msg=m g.k=v` {
		t.Errorf("got %s", got)
	}
}
