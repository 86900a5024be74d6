package nspawn

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// podPath is the pod's PathMapper: a host path beneath the pod's shared
// mounts directory maps to the same path beneath /mnt/stagelet; any other
// path is not reachable from inside the pod (InvalidArgument).
func (p *Pod) podPath(host string) (string, error) {
	rel, err := filepath.Rel(p.st.Mounts, filepath.Clean(host))
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", errdefs.InvalidArgument("nspawn: %s is not reachable from inside the pod", host)
	}
	return filepath.Join(podMounts, rel), nil
}

// containerDir is where a container's binds go on the host.
func (p *Pod) containerDir(id string) (string, error) {
	if id == "" || id == "." || id == ".." || strings.ContainsAny(id, "/\x00") {
		return "", errdefs.InvalidArgument("nspawn: bad container id %q", id)
	}
	return filepath.Join(p.st.Mounts, id), nil
}

// CreateContainer implements stage1.Pod. The container's rootfs, the
// directory of its log file and the source of each of its mounts are bound
// beneath the pod's shared directory on the host (<Mounts>/<id>/rootfs,
// log, m<N>), whence they propagate into the running pod, and the agent is
// given the paths it sees them at. Errors: InvalidArgument (bad id),
// AlreadyExists (a known container), FailedPrecondition (a mount source
// that does not exist), and the agent's. On failure the binds are undone.
func (p *Pod) CreateContainer(ctx context.Context, spec *stage1.ContainerSpec) (_ *api.AppStatus, retErr error) {
	if spec == nil {
		return nil, errdefs.InvalidArgument("create container: no spec")
	}
	dir, err := p.containerDir(spec.ID)
	if err != nil {
		return nil, err
	}
	if err := os.Mkdir(dir, 0o700); errors.Is(err, os.ErrExist) {
		// Either a known container or the leftovers of a create that
		// did not finish (a crash between the binds and the agent).
		if _, err := p.ContainerStatus(ctx, spec.ID); err == nil {
			return nil, errdefs.AlreadyExists("container %q already exists", spec.ID)
		} else if !errdefs.IsNotFound(err) {
			return nil, err
		}
		if err := removeUnmounted(dir); err != nil {
			return nil, fmt.Errorf("nspawn: container %s: %w", spec.ID, err)
		}
		if err := os.Mkdir(dir, 0o700); err != nil {
			return nil, fmt.Errorf("nspawn: %w", err)
		}
	} else if err != nil {
		return nil, fmt.Errorf("nspawn: %w", err)
	}
	defer func() {
		if retErr != nil {
			if err := removeUnmounted(dir); err != nil {
				p.log.Warn("nspawn: undoing a failed create", "container", spec.ID, "err", err)
			}
		}
	}()

	inPod := *spec
	if spec.Rootfs == "" {
		return nil, errdefs.InvalidArgument("container %s: no rootfs", spec.ID)
	}
	inPod.Rootfs = filepath.Join(dir, "rootfs")
	if err := bind(spec.Rootfs, inPod.Rootfs); err != nil {
		return nil, fmt.Errorf("container %s: rootfs: %w", spec.ID, err)
	}
	if spec.LogPath != "" {
		if !filepath.IsAbs(spec.LogPath) {
			return nil, errdefs.InvalidArgument("container %s: log path %q is not absolute", spec.ID, spec.LogPath)
		}
		logDir := filepath.Dir(spec.LogPath)
		if err := os.MkdirAll(logDir, 0o755); err != nil {
			return nil, fmt.Errorf("container %s: log: %w", spec.ID, err)
		}
		if err := bind(logDir, filepath.Join(dir, "log")); err != nil {
			return nil, fmt.Errorf("container %s: log: %w", spec.ID, err)
		}
		inPod.LogPath = filepath.Join(dir, "log", filepath.Base(spec.LogPath))
	}
	if len(spec.Mounts) > 0 {
		inPod.Mounts = append([]api.Mount(nil), spec.Mounts...)
		for i, m := range spec.Mounts {
			if !filepath.IsAbs(m.Source) {
				return nil, errdefs.InvalidArgument("container %s: mount source %q is not absolute", spec.ID, m.Source)
			}
			target := filepath.Join(dir, "m"+strconv.Itoa(i))
			if err := bind(m.Source, target); err != nil {
				return nil, fmt.Errorf("container %s: mount %s: %w", spec.ID, m.Destination, err)
			}
			inPod.Mounts[i].Source = target
		}
	}
	// AgentPod maps the host paths beneath the shared directory to the
	// agent's view (podPath).
	return p.AgentPod.CreateContainer(ctx, &inPod)
}

// RemoveContainer implements stage1.Pod: the agent forgets the container,
// then its binds are undone. Idempotent.
func (p *Pod) RemoveContainer(ctx context.Context, id string) error {
	dir, err := p.containerDir(id)
	if err != nil {
		return err
	}
	if err := p.AgentPod.RemoveContainer(ctx, id); err != nil {
		return err
	}
	if err := removeUnmounted(dir); err != nil {
		return fmt.Errorf("nspawn: container %s: %w", id, err)
	}
	return nil
}
