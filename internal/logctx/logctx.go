// Package logctx ties log lines to the call they belong to: a context
// carries attributes (the CRI request ID, the pod and container a call
// names) and a handler wrapped with NewHandler adds them to every line
// logged with that context (Logger.InfoContext and the like), however deep
// below the call the line is written.
package logctx

import (
	"context"
	"log/slog"
	"slices"
	"time"
)

type key struct{}

// With returns a copy of ctx whose log lines carry args (slog's key-value
// pairs or Attrs) besides what ctx already carries; a key given again
// replaces its earlier value.
func With(ctx context.Context, args ...any) context.Context {
	prev := Attrs(ctx)
	r := slog.NewRecord(time.Time{}, 0, "", 0)
	r.Add(args...)
	out := slices.Clone(prev)
	r.Attrs(func(a slog.Attr) bool {
		if i := slices.IndexFunc(out, func(b slog.Attr) bool { return b.Key == a.Key }); i >= 0 {
			out[i] = a
		} else {
			out = append(out, a)
		}
		return true
	})
	return context.WithValue(ctx, key{}, out)
}

// Attrs are the attributes ctx carries for log lines.
func Attrs(ctx context.Context) []slog.Attr {
	if ctx == nil {
		return nil
	}
	as, _ := ctx.Value(key{}).([]slog.Attr)
	return as
}

// Value is the value of key among the attributes ctx carries, as a
// string; "" when it carries none.
func Value(ctx context.Context, key string) string {
	for _, a := range Attrs(ctx) {
		if a.Key == key {
			return a.Value.String()
		}
	}
	return ""
}

// NewHandler wraps h: a record gets the attributes its context carries,
// except those whose key the record or the logger already has (a line
// that names its pod itself keeps its own).
func NewHandler(h slog.Handler) slog.Handler { return &handler{inner: h} }

type handler struct {
	inner slog.Handler
	keys  []string // keys of the logger's own attributes (Logger.With)
	group bool     // the logger opened a group: ctx attributes would land in it
}

func (h *handler) Enabled(ctx context.Context, l slog.Level) bool { return h.inner.Enabled(ctx, l) }

func (h *handler) Handle(ctx context.Context, r slog.Record) error {
	as := Attrs(ctx)
	if len(as) == 0 || h.group {
		return h.inner.Handle(ctx, r)
	}
	have := slices.Clone(h.keys)
	r.Attrs(func(a slog.Attr) bool {
		have = append(have, a.Key)
		return true
	})
	r = r.Clone()
	for _, a := range as {
		if !slices.Contains(have, a.Key) {
			r.AddAttrs(a)
		}
	}
	return h.inner.Handle(ctx, r)
}

func (h *handler) WithAttrs(as []slog.Attr) slog.Handler {
	n := &handler{inner: h.inner.WithAttrs(as), keys: slices.Clone(h.keys), group: h.group}
	if !h.group {
		for _, a := range as {
			n.keys = append(n.keys, a.Key)
		}
	}
	return n
}

func (h *handler) WithGroup(name string) slog.Handler {
	if name == "" {
		return h
	}
	return &handler{inner: h.inner.WithGroup(name), keys: h.keys, group: true}
}
