package broker

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
)

// records persists pod and container records as versioned JSON files under
// dir/pods and dir/containers, each written atomically.
type records struct {
	dir string
}

func (r *records) podPath(id string) string {
	return filepath.Join(r.dir, "pods", id+".json")
}

func (r *records) containerPath(id string) string {
	return filepath.Join(r.dir, "containers", id+".json")
}

func (r *records) init() error {
	for _, d := range []string{"pods", "containers"} {
		if err := os.MkdirAll(filepath.Join(r.dir, d), 0o700); err != nil {
			return err
		}
	}
	return nil
}

func (r *records) savePod(p *PodRecord) error {
	p.Version = recordVersion
	b, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		return err
	}
	// A full state file system answers ResourceExhausted, naming it.
	return errdefs.Storage(atomicfile.Write(r.podPath(p.ID), b, 0o600), r.dir)
}

func (r *records) saveContainer(c *ContainerRecord) error {
	c.Version = recordVersion
	b, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return err
	}
	return errdefs.Storage(atomicfile.Write(r.containerPath(c.ID), b, 0o600), r.dir)
}

func (r *records) deletePod(id string) error {
	return removeIfExists(r.podPath(id))
}

func (r *records) deleteContainer(id string) error {
	return removeIfExists(r.containerPath(id))
}

func removeIfExists(p string) error {
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// badRecord is a record loadAll could not take.
type badRecord struct {
	// ID is the record's, from its file name.
	ID     string
	Reason string
	// Newer: a later stagelet wrote it (its version is above
	// recordVersion); it is left where it is, for that stagelet.
	Newer bool
}

// errNewerRecord marks a record a later stagelet wrote.
var errNewerRecord = errors.New("written by a newer stagelet")

// checkVersion accepts the record versions this stagelet reads.
func checkVersion(v int) error {
	switch {
	case v > recordVersion:
		return fmt.Errorf("%w: record version %d, this stagelet reads up to %d", errNewerRecord, v, recordVersion)
	case v != recordVersion:
		return fmt.Errorf("unsupported record version %d", v)
	}
	return nil
}

// quarantine moves an unreadable record out of the records, into
// dir/quarantine, and returns where it went.
func (r *records) quarantine(path string) (string, error) {
	qdir := filepath.Join(r.dir, "quarantine")
	if err := os.MkdirAll(qdir, 0o700); err != nil {
		return "", err
	}
	dst := filepath.Join(qdir, filepath.Base(filepath.Dir(path))+"-"+filepath.Base(path))
	for i := 1; ; i++ {
		if _, err := os.Lstat(dst); errors.Is(err, fs.ErrNotExist) {
			break
		}
		dst = filepath.Join(qdir, fmt.Sprintf("%s-%s.%d", filepath.Base(filepath.Dir(path)), filepath.Base(path), i))
	}
	return dst, os.Rename(path, dst)
}

// release moves a set-aside record (in quarantine, or in place) into
// dir/quarantine/released, where it is kept and no longer set aside.
func (r *records) release(path string) error {
	rdir := filepath.Join(r.dir, "quarantine", releasedDir)
	if err := os.MkdirAll(rdir, 0o700); err != nil {
		return err
	}
	name := filepath.Base(path)
	if filepath.Dir(path) != filepath.Join(r.dir, "quarantine") {
		name = filepath.Base(filepath.Dir(path)) + "-" + name
	}
	dst := filepath.Join(rdir, name)
	for i := 1; ; i++ {
		if _, err := os.Lstat(dst); errors.Is(err, fs.ErrNotExist) {
			break
		}
		dst = filepath.Join(rdir, fmt.Sprintf("%s.%d", name, i))
	}
	return os.Rename(path, dst)
}

// quarantined returns the IDs of the records in dir/quarantine (named
// <kind>-<id>.json, maybe with a .N suffix).
func (r *records) quarantined() []string {
	ents, _ := os.ReadDir(filepath.Join(r.dir, "quarantine"))
	var ids []string
	for _, e := range ents {
		_, rest, ok := strings.Cut(e.Name(), "-")
		if id, _, ok2 := strings.Cut(rest, ".json"); ok && ok2 && id != "" {
			ids = append(ids, id)
		}
	}
	return ids
}

// loadAll reads every record. A record that cannot be read is reported in
// bad (path → why) and skipped, never fatal.
//
// With tidy (recovery, the daemon's own) an interrupted write's temporary
// file is removed. Without it (a tool reading beside a running daemon)
// nothing is changed: temporary files are skipped, as are records removed
// while they are read and directories not made yet.
func (r *records) loadAll(tidy bool) (pods []*PodRecord, ctrs []*ContainerRecord, bad map[string]badRecord, err error) {
	bad = map[string]badRecord{}
	if err := loadDir(filepath.Join(r.dir, "pods"), tidy, bad, func(b []byte, id string) error {
		var p PodRecord
		if err := json.Unmarshal(b, &p); err != nil {
			return err
		}
		if err := checkVersion(p.Version); err != nil {
			return err
		}
		if p.ID != id {
			return fmt.Errorf("the record names pod %q", p.ID)
		}
		pods = append(pods, &p)
		return nil
	}); err != nil {
		return nil, nil, nil, err
	}
	if err := loadDir(filepath.Join(r.dir, "containers"), tidy, bad, func(b []byte, id string) error {
		var c ContainerRecord
		if err := json.Unmarshal(b, &c); err != nil {
			return err
		}
		if err := checkVersion(c.Version); err != nil {
			return err
		}
		if c.ID != id {
			return fmt.Errorf("the record names container %q", c.ID)
		}
		ctrs = append(ctrs, &c)
		return nil
	}); err != nil {
		return nil, nil, nil, err
	}
	return pods, ctrs, bad, nil
}

func loadDir(dir string, tidy bool, bad map[string]badRecord, decode func(b []byte, id string) error) error {
	ents, err := os.ReadDir(dir)
	if !tidy && errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, e := range ents {
		name := e.Name()
		if atomicfile.IsTemp(name) && e.Type().IsRegular() {
			if !tidy {
				continue
			}
			// A write the daemon died in: the record it was replacing
			// is intact beside it (or was never written).
			if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("remove an interrupted write: %w", err)
			}
			continue
		}
		if !strings.HasSuffix(name, ".json") {
			continue
		}
		p := filepath.Join(dir, name)
		fileID := strings.TrimSuffix(name, ".json")
		b, err := os.ReadFile(p)
		if !tidy && errors.Is(err, fs.ErrNotExist) {
			continue // removed since the listing
		}
		if err != nil {
			bad[p] = badRecord{ID: fileID, Reason: err.Error()}
			continue
		}
		if err := decode(b, fileID); err != nil {
			bad[p] = badRecord{ID: fileID, Reason: err.Error(), Newer: errors.Is(err, errNewerRecord)}
		}
	}
	return nil
}
