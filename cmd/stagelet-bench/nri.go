package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	nrilog "github.com/containerd/nri/pkg/log"
	"github.com/containerd/nri/pkg/stub"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// NRI in the measured daemon: what its hosting of NRI plugins costs a
// pod start, set against a run without it (-save, -against).
const (
	nriOff  = "off"  // nri.disable: no NRI at all
	nriOn   = "on"   // the default config: NRI on, no plugin connected
	nriNoop = "noop" // NRI on and noopPlugin connected
)

// The default is the daemon's default config (NRI on), so that runs
// without the flag measure what they measured before it existed.
var nriMode = flag.String("nri", nriOn, "NRI in the daemon: off (nri.disable), on (the daemon's default config: NRI on, no plugin connected) or noop (on, and one plugin of this command that answers every event it can subscribe to with nothing, connected before the runs)")

// checkNRIMode refuses an -nri value that is none of the modes.
func checkNRIMode(mode string) error {
	switch mode {
	case nriOff, nriOn, nriNoop:
		return nil
	}
	return fmt.Errorf("-nri %q: want off, on or noop", mode)
}

// noopPluginName is noopPlugin's name as the daemon lists it: index,
// dash, name.
const (
	noopPluginIdx  = "50"
	noopPluginName = "bench-noop"
)

// noopPlugin is an NRI plugin subscribed to every pod and container event
// the stub relays, answering each with nothing: no adjustment, no update,
// no error. Its cost is the daemon's round trips to a plugin, not any
// work of the plugin's.
type noopPlugin struct{}

func (noopPlugin) RunPodSandbox(context.Context, *nriapi.PodSandbox) error { return nil }
func (noopPlugin) UpdatePodSandbox(context.Context, *nriapi.PodSandbox, *nriapi.LinuxResources, *nriapi.LinuxResources) error {
	return nil
}
func (noopPlugin) PostUpdatePodSandbox(context.Context, *nriapi.PodSandbox) error { return nil }
func (noopPlugin) StopPodSandbox(context.Context, *nriapi.PodSandbox) error       { return nil }
func (noopPlugin) RemovePodSandbox(context.Context, *nriapi.PodSandbox) error     { return nil }
func (noopPlugin) CreateContainer(context.Context, *nriapi.PodSandbox, *nriapi.Container) (*nriapi.ContainerAdjustment, []*nriapi.ContainerUpdate, error) {
	return nil, nil, nil
}
func (noopPlugin) PostCreateContainer(context.Context, *nriapi.PodSandbox, *nriapi.Container) error {
	return nil
}
func (noopPlugin) StartContainer(context.Context, *nriapi.PodSandbox, *nriapi.Container) error {
	return nil
}
func (noopPlugin) PostStartContainer(context.Context, *nriapi.PodSandbox, *nriapi.Container) error {
	return nil
}
func (noopPlugin) UpdateContainer(context.Context, *nriapi.PodSandbox, *nriapi.Container, *nriapi.LinuxResources) ([]*nriapi.ContainerUpdate, error) {
	return nil, nil
}
func (noopPlugin) PostUpdateContainer(context.Context, *nriapi.PodSandbox, *nriapi.Container) error {
	return nil
}
func (noopPlugin) StopContainer(context.Context, *nriapi.PodSandbox, *nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	return nil, nil
}
func (noopPlugin) RemoveContainer(context.Context, *nriapi.PodSandbox, *nriapi.Container) error {
	return nil
}

// connectNoopPlugin, with -nri noop, connects a noopPlugin to d's NRI
// socket and waits, up to a minute, until d's verbose Status lists it;
// tb's cleanup disconnects it. Other modes connect nothing.
func connectNoopPlugin(ctx context.Context, tb *fixtureTB, d *harness.Daemon, log *slog.Logger) error {
	if *nriMode != nriNoop {
		return nil
	}
	nrilog.Set(stubLogger{log})
	st, err := stub.New(noopPlugin{}, stub.WithSocketPath(d.NRISocket),
		stub.WithPluginIdx(noopPluginIdx), stub.WithPluginName(noopPluginName))
	if err != nil {
		return fmt.Errorf("NRI plugin: %w", err)
	}
	pctx, cancel := context.WithCancel(context.Background())
	if err := st.Start(pctx); err != nil {
		cancel()
		return fmt.Errorf("NRI plugin: connect to %s: %w", d.NRISocket, err)
	}
	tb.Cleanup(func() { st.Stop(); cancel() })
	want := noopPluginIdx + "-" + noopPluginName
	return tb.do(func() {
		testutil.WaitFor(tb, time.Minute, "NRI plugin "+want+" listed in the daemon's Status", func() (bool, string) {
			if err := ctx.Err(); err != nil {
				tb.Fatal(err)
			}
			return nriListed(ctx, d, want)
		})
	})
}

// nriListed says whether d's verbose Status lists the NRI plugin named
// name as connected, and else what its "nri" key holds.
func nriListed(ctx context.Context, d *harness.Daemon, name string) (bool, string) {
	resp, err := d.Runtime().Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		return false, err.Error()
	}
	info := resp.GetInfo()["nri"]
	var st struct {
		Plugins []struct{ Name string }
	}
	if err := json.Unmarshal([]byte(info), &st); err != nil {
		return false, info
	}
	for _, p := range st.Plugins {
		if p.Name == name {
			return true, ""
		}
	}
	return false, info
}

// stubLogger passes the stub's lines to the bench's log: its progress at
// debug (-v), its warnings and errors as such.
type stubLogger struct{ log *slog.Logger }

func (l stubLogger) Debugf(ctx context.Context, format string, args ...any) {
	l.log.DebugContext(ctx, "NRI plugin: "+fmt.Sprintf(format, args...))
}

func (l stubLogger) Infof(ctx context.Context, format string, args ...any) {
	l.log.DebugContext(ctx, "NRI plugin: "+fmt.Sprintf(format, args...))
}

func (l stubLogger) Warnf(ctx context.Context, format string, args ...any) {
	l.log.WarnContext(ctx, "NRI plugin: "+fmt.Sprintf(format, args...))
}

func (l stubLogger) Errorf(ctx context.Context, format string, args ...any) {
	l.log.ErrorContext(ctx, "NRI plugin: "+fmt.Sprintf(format, args...))
}

// describeNRI says, for the report, what NRI the daemon ran with.
func describeNRI() string {
	switch *nriMode {
	case nriOff:
		return "NRI off"
	case nriNoop:
		return "NRI on, one no-op plugin connected"
	}
	return "NRI on, no plugin"
}
