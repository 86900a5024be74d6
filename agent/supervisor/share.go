package supervisor

import (
	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// runMountShare runs Config.MountShare, which is idempotent: an agent
// without it (not a VM's, or a VM whose share is mounted at boot or
// absent) is FailedPrecondition.
func (a *Agent) runMountShare() error {
	if a.mountShare == nil {
		return errdefs.FailedPrecondition("mountshare: this agent has no shared directory to mount on demand")
	}
	return a.mountShare()
}

// runNetwork runs Config.Network: an agent without it (not a VM's) is
// FailedPrecondition.
func (a *Agent) runNetwork(req *api.Request) error {
	if a.network == nil {
		return errdefs.FailedPrecondition("network: this agent does not configure its pod's network")
	}
	return a.network(req)
}
