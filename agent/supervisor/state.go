package supervisor

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/internal/atomicfile"
)

// stateFile is where an app's last status is kept: <state-dir>/<id>.json.
func stateFile(dir, id string) string { return filepath.Join(dir, id+".json") }

// writeState stores st atomically (temporary file, rename) so a reader
// sees the old or the new record, never a part. The state directory is
// on the run root (the pod's run directory, or the guest's memory): a
// reboot ends the pod with it, so the record is not synced to disk.
func writeState(dir string, st *api.AppStatus) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	if err := atomicfile.WriteVolatile(stateFile(dir, st.ID), b, 0o600); err != nil {
		return fmt.Errorf("state %s: %w", st.ID, err)
	}
	return nil
}

// readStates loads every record in dir. A record that cannot be read is
// returned in bad and otherwise skipped.
func readStates(dir string) (sts []*api.AppStatus, bad []error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, []error{err}
	}
	for _, e := range ents {
		name := e.Name()
		if !strings.HasSuffix(name, ".json") || strings.HasPrefix(name, ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			bad = append(bad, err)
			continue
		}
		var st api.AppStatus
		if err := json.Unmarshal(b, &st); err != nil || st.ID+".json" != name {
			bad = append(bad, fmt.Errorf("state %s: bad record: %v", name, err))
			continue
		}
		sts = append(sts, &st)
	}
	return sts, bad
}
