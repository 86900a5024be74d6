package host

import (
	"errors"
	"log/slog"

	"github.com/stagelet/stagelet/stage1"
)

// StateForRelease reads a pod's state for DestroyPod with the backend's
// parse. A state a newer stagelet wrote is returned as its error: what it
// names is that stagelet's to release. An unreadable one is logged and
// replaced by the zero state, which the backend then fills from its
// naming convention (a crash before the first persist leaves none).
func StateForRelease[S any](log *slog.Logger, backend, podID string, b []byte, parse func([]byte) (*S, error)) (*S, error) {
	st, err := parse(b)
	if errors.Is(err, stage1.ErrNewerState) {
		return nil, err
	}
	if err != nil {
		log.Warn(backend+": unreadable pod state; releasing by convention", "pod", podID, "err", err)
		return new(S), nil
	}
	return st, nil
}
