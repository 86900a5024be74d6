package broker

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

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
	return atomicfile.Write(r.podPath(p.ID), b, 0o600)
}

func (r *records) saveContainer(c *ContainerRecord) error {
	c.Version = recordVersion
	b, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(r.containerPath(c.ID), b, 0o600)
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

// loadAll reads every record. A record that cannot be read is reported in
// bad (path → reason) and skipped, never fatal.
func (r *records) loadAll() (pods []*PodRecord, ctrs []*ContainerRecord, bad map[string]string, err error) {
	bad = map[string]string{}
	if err := loadDir(filepath.Join(r.dir, "pods"), bad, func(b []byte) (string, error) {
		var p PodRecord
		if err := json.Unmarshal(b, &p); err != nil {
			return "", err
		}
		if p.Version != recordVersion || p.ID == "" {
			return "", fmt.Errorf("unsupported record version %d", p.Version)
		}
		pods = append(pods, &p)
		return p.ID, nil
	}); err != nil {
		return nil, nil, nil, err
	}
	if err := loadDir(filepath.Join(r.dir, "containers"), bad, func(b []byte) (string, error) {
		var c ContainerRecord
		if err := json.Unmarshal(b, &c); err != nil {
			return "", err
		}
		if c.Version != recordVersion || c.ID == "" {
			return "", fmt.Errorf("unsupported record version %d", c.Version)
		}
		ctrs = append(ctrs, &c)
		return c.ID, nil
	}); err != nil {
		return nil, nil, nil, err
	}
	return pods, ctrs, bad, nil
}

func loadDir(dir string, bad map[string]string, decode func([]byte) (string, error)) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		name := e.Name()
		if !strings.HasSuffix(name, ".json") {
			continue // temp files from an interrupted write
		}
		p := filepath.Join(dir, name)
		b, err := os.ReadFile(p)
		if err != nil {
			bad[p] = err.Error()
			continue
		}
		id, err := decode(b)
		if err != nil {
			bad[p] = err.Error()
			continue
		}
		if id+".json" != name {
			bad[p] = fmt.Sprintf("record names id %q", id)
		}
	}
	return nil
}
