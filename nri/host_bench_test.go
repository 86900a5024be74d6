package nri

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"

	"github.com/stagelet/stagelet/internal/testutil"
)

// benchRuntime is a daemon of no pods that accepts every adjustment.
type benchRuntime struct{}

func (benchRuntime) NRIState(context.Context) ([]*nriapi.PodSandbox, []*nriapi.Container) {
	return nil, nil
}

func (benchRuntime) NRIUpdate(context.Context, []*nriapi.ContainerUpdate) ([]*nriapi.ContainerUpdate, error) {
	return nil, nil
}
func (benchRuntime) NRIEvict(context.Context, []*nriapi.ContainerEviction) error { return nil }
func (benchRuntime) NRIValidate(context.Context, *nriapi.ValidateContainerAdjustmentRequest) error {
	return nil
}

// noopPlugin answers every event it is sent with nothing.
type noopPlugin struct{}

func (noopPlugin) RunPodSandbox(context.Context, *nriapi.PodSandbox) error { return nil }
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

// BenchmarkPodStart is what hosting NRI adds to one pod start (the events
// a pod and its container's start send: RunPodSandbox, CreateContainer,
// PostCreate, StartContainer, PostStart, with the views they carry),
// with no plugin and with one no-op plugin connected over its socket.
// Set beside stagelet-bench's pod start (make bench prints both) for the
// ratio: NRI on and no plugin within 1.02x, one no-op plugin within 1.1x.
func BenchmarkPodStart(b *testing.B) {
	for _, plugins := range []int{0, 1} {
		name := map[int]string{0: "no-plugin", 1: "one-noop-plugin"}[plugins]
		b.Run(name, func(b *testing.B) {
			sock := filepath.Join(b.TempDir(), "nri.sock")
			h, err := New(Config{SocketPath: sock, PluginPath: b.TempDir(), PluginConfigPath: b.TempDir()}, "bench", "0", slog.New(slog.NewTextHandler(io.Discard, nil)))
			if err != nil {
				b.Fatal(err)
			}
			if err := h.Start(benchRuntime{}); err != nil {
				b.Fatal(err)
			}
			defer h.Stop()
			if plugins == 1 {
				st, err := stub.New(noopPlugin{}, stub.WithSocketPath(sock), stub.WithPluginIdx("50"), stub.WithPluginName("noop"))
				if err != nil {
					b.Fatal(err)
				}
				if err := st.Start(context.Background()); err != nil {
					b.Fatal(err)
				}
				defer st.Stop()
				testutil.WaitFor(b, time.Minute, "the no-op plugin connected", func() (bool, string) {
					ps, _ := h.Plugins()
					return len(ps) == 1, ""
				})
			}
			ctx := context.Background()
			b.ResetTimer()
			for range b.N {
				pod := PodOf(PodInfo{ID: "p", Name: "pod", UID: "u", Namespace: "default", NetNSPath: "/run/netns/p"})
				ctr := &nriapi.Container{Id: "c", PodSandboxId: "p", Name: "c", Args: []string{"sleep", "3600"}}
				if err := h.RunPodSandbox(ctx, pod); err != nil {
					b.Fatal(err)
				}
				if _, err := h.CreateContainer(ctx, pod, ctr); err != nil {
					b.Fatal(err)
				}
				if err := h.PostCreateContainer(ctx, pod, ctr); err != nil {
					b.Fatal(err)
				}
				if err := h.StartContainer(ctx, pod, ctr); err != nil {
					b.Fatal(err)
				}
				if err := h.PostStartContainer(ctx, pod, ctr); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
