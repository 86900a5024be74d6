package stage1

import (
	"context"
	"net"
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

// PodRestored is how a RestorePod or ReceivePod went.
type PodRestored struct {
	// Load is from the start of the image's load (for ReceivePod: the
	// end of its stream) to its apps' agent answering, with the network
	// taken.
	Load time.Duration
	// For ReceivePod: Bytes is what the stream carried; Downtime from
	// the source's pause to the agent answering here, by the two nodes'
	// clocks.
	Bytes    int64
	Downtime time.Duration
}

// PodSender is a PodSaver whose pod can also move live: its state
// streams to the other node while it runs, and it pauses only for the
// last of it. DescribePod writes into the empty directory dir what the
// target checks before it takes the pod (what SavePod writes, without
// the state); SendPod streams the pod over conn, authenticated already,
// to a PodReceiver (the frames of package livemove). Once the target
// has the state the pod here is stopped for good and its agent gone;
// until then a failure leaves it running. FailedPrecondition as for
// SavePod.
type PodSender interface {
	PodSaver
	DescribePod(ctx context.Context, dir string) error
	SendPod(ctx context.Context, conn net.Conn) (*PodSaved, error)
}

// PodReceiver is a PodRestorer that can also take a pod moving live: the
// pod DescribePod described in dir, streamed over conn by a PodSender.
// Its own apps are replaced as by RestorePod.
type PodReceiver interface {
	PodRestorer
	ReceivePod(ctx context.Context, dir string, conn net.Conn) (*PodRestored, error)
}
