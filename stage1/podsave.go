package stage1

import (
	"context"
	"time"
)

// PodSaver is a Pod whose whole state can be saved while it runs: its
// apps with the kernel and memory they run in (a VM's), as one image, not
// app by app (AppCheckpointer). SavePod writes it into the empty
// directory dir and leaves the pod running. FailedPrecondition, saying
// why, when the pod cannot be saved (a VM with a host share mounted, a
// device passed through).
type PodSaver interface {
	SavePod(ctx context.Context, dir string) (*PodSaved, error)
}

// PodSaved is how a SavePod went.
type PodSaved struct {
	// Bytes is the size of the saved image; Total how long the save
	// took; Downtime how long the pod was paused for it.
	Bytes           int64
	Total, Downtime time.Duration
}

// PodRestorer is a Pod that can take, in place of its own apps, the state
// a PodSaver of its stage1 saved in dir (on this node or another): its
// apps then run on in it as they ran in the saved pod, their records and
// processes the saved pod's, with this pod's network, hostname and host
// resources. The pod's State changes (the caller persists it again).
// FailedPrecondition, saying why, when the image cannot be restored
// here (another VM size or device set, a stage1 image of another
// version); the pod is then as it was, or stopped when the failure came
// after its own state was given up (the error says so).
type PodRestorer interface {
	RestorePod(ctx context.Context, dir string) (*PodRestored, error)
}

// PodRestored is how a RestorePod went.
type PodRestored struct {
	// Load is from the start of the image's load to its apps' agent
	// answering, with the network taken.
	Load time.Duration
}
