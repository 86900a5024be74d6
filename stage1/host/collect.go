package host

import (
	"context"
	"errors"
	"slices"
	"strings"

	"github.com/stagelet/stagelet/cgroups"
)

// CollectUnits releases the units of a UnitLauncher named after a pod
// ("stagelet-pod-<id>", or "stagelet-pod-<id>-<what>" for a pod's other
// processes) whose pod keep refuses: under the systemd driver, what a
// lost record leaves running. Without a UnitLauncher there is nothing to
// do. It returns the pods whose units it released.
func CollectUnits(ctx context.Context, l Launcher, keep func(podID string) bool) ([]string, error) {
	u, ok := l.(UnitLauncher)
	if !ok {
		return nil, nil
	}
	names, err := u.Units(ctx, cgroups.PodCgroupPrefix)
	if err != nil {
		return nil, err
	}
	var done []string
	var errs []error
	for _, name := range names {
		id := strings.TrimPrefix(name, cgroups.PodCgroupPrefix)
		if len(id) > 64 && id[64] == '-' {
			id = id[:64]
		}
		if !cgroups.ValidPodID(id) || keep(id) {
			continue
		}
		if err := u.Release(ctx, name); err != nil {
			errs = append(errs, err)
			continue
		}
		if !slices.Contains(done, id) {
			done = append(done, id)
		}
	}
	slices.Sort(done)
	return done, errors.Join(errs...)
}
