package kvm

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
	"github.com/stagelet/stagelet/stage1"
)

// A kvm pod's volumes that do not reach its guest over 9p (classify.go):
// the copies the daemon keeps current, the termination message files it
// copies back, and, for the others, which mounts of each container
// still go over 9p (SharedMounts: a pod with one cannot move). All of
// it is recorded in <VM directory>/volumes.json, written atomically at
// each change, so that a restarted daemon resumes the copies' watches
// (RecoverPod) and still copies messages back.

const (
	// volumesFile is the record's name in the VM directory.
	volumesFile = "volumes.json"
	// copySettle is how long a copy's source must stay quiet after a
	// change before it is copied again: the kubelet's atomic writer
	// changes a volume in a few steps.
	copySettle = 100 * time.Millisecond
	// copyRetry is how long a failed copy waits before it is tried
	// again.
	copyRetry = 2 * time.Second
	// volumeCallTimeout bounds one agent call of a volume.
	volumeCallTimeout = 30 * time.Second
)

// SharedMount is a container's mount that reaches the guest over the
// pod's 9p share.
type SharedMount struct {
	// Source is the host path, Destination the path in the container.
	Source      string `json:"source"`
	Destination string `json:"destination"`
}

// volumeRecord is what volumes.json holds.
type volumeRecord struct {
	// Copies are the copied trees, by guest volume name: their host
	// sources.
	Copies map[string]string `json:"copies,omitempty"`
	// Messages are the host termination message files, by container.
	Messages map[string]string `json:"messages,omitempty"`
	// Shared are the mounts over 9p, by container.
	Shared map[string][]SharedMount `json:"shared,omitempty"`
}

// podVolumes are a pod's volumes (Pod.vols).
type podVolumes struct {
	file string
	log  *slog.Logger
	// agent reaches the pod's agent.
	agent *client.Client

	mu  sync.Mutex
	rec volumeRecord
	// watches stop each copy's watch, by name.
	watches map[string]func()
	stopped bool
	// featureKnown: featureOK says whether the agent takes guest
	// volumes (guestVolumes).
	featureKnown, featureOK bool
}

func newPodVolumes(dir string, log *slog.Logger, agent *client.Client) *podVolumes {
	v := &podVolumes{file: filepath.Join(dir, volumesFile), log: log, agent: agent, watches: map[string]func(){}}
	if dir == "" {
		v.file = ""
	}
	return v
}

// load reads the record a running pod's earlier daemon left, and
// resumes the watches of its copies (each copied once more at once).
// A bad record is logged: the copies then stay as they are.
func (v *podVolumes) load() {
	if v.file == "" {
		return
	}
	b, err := os.ReadFile(v.file)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	var rec volumeRecord
	if err == nil {
		err = json.Unmarshal(b, &rec)
	}
	if err != nil {
		v.log.Warn("kvm: the pod's volume record", "err", err)
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	v.rec = rec
	for name, src := range rec.Copies {
		v.watchLocked(name, src, [32]byte{})
	}
}

// saveLocked writes the record; v.mu is held.
func (v *podVolumes) saveLocked() error {
	if v.file == "" {
		return nil
	}
	b, err := json.Marshal(&v.rec)
	if err != nil {
		return err
	}
	return atomicfile.WriteVolatile(v.file, b, 0o600)
}

// guestVolumes tells whether the pod's agent takes guest volumes
// (api.FeatureGuestVolumes), asked once: an agent started by an earlier
// daemon does not. An agent that does not answer is taken not to.
func (v *podVolumes) guestVolumes(ctx context.Context) bool {
	v.mu.Lock()
	known, ok := v.featureKnown, v.featureOK
	v.mu.Unlock()
	if known {
		return ok
	}
	cctx, cancel := context.WithTimeout(ctx, volumeCallTimeout)
	defer cancel()
	info, err := v.agent.Info(cctx)
	if err != nil {
		v.log.WarnContext(ctx, "kvm: ask the agent for its features; the pod's volumes go over 9p", "err", err)
		return false
	}
	ok = client.HasFeature(info, api.FeatureGuestVolumes)
	v.mu.Lock()
	v.featureKnown, v.featureOK = true, ok
	v.mu.Unlock()
	return ok
}

// stop ends every copy's watch. Idempotent.
func (v *podVolumes) stop() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.stopped = true
	for name, stop := range v.watches {
		stop()
		delete(v.watches, name)
	}
}

// SharedMounts are the mounts of the pod's containers that reach its
// guest over 9p, as "<container>: <host source> on <destination>",
// sorted; none: the pod needs no 9p for its volumes. It does no I/O.
func (p *Pod) SharedMounts() []string {
	v := p.vols
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []string
	for id, ms := range v.rec.Shared {
		for _, m := range ms {
			out = append(out, fmt.Sprintf("%s: %s on %s", id, m.Source, m.Destination))
		}
	}
	slices.Sort(out)
	return out
}

// guestMounts places spec's mounts (Share): those that live in the
// guest are made there (copies put, their watches started) and given
// their kinds and names, in place in the result; the others are left in
// rest, in order, for the 9p share, and place records them and puts
// them back in order. In a pod with a user namespace of its own every
// mount goes over 9p, as before (the guest's copies would need its IDs
// mapped), and so do they in a pod whose agent, an earlier daemon's,
// has no guest volumes.
func (p *Pod) guestMounts(ctx context.Context, spec *stage1.ContainerSpec) (rest *stage1.ContainerSpec, place func(shared []api.Mount) []api.Mount, err error) {
	ways := make([]mountWay, len(spec.Mounts))
	r := *spec
	r.Mounts = nil
	guest := p.st.UserNS == nil && len(spec.Mounts) > 0 && p.vols.guestVolumes(ctx)
	for i, m := range spec.Mounts {
		if guest {
			ways[i] = classifyMount(m, p.runDir)
		}
		if ways[i].Kind == api.MountCopy {
			err := p.vols.putCopy(ctx, ways[i].Name, ways[i].Source)
			var cannot errCannotCopy
			if errors.As(err, &cannot) {
				// Too big, or holding what a copy cannot: shared.
				p.log.WarnContext(ctx, "kvm: a volume cannot be copied into the VM; it is shared over 9p", "container", spec.ID, "source", m.Source, "err", err)
				ways[i] = mountWay{Kind: api.MountPath}
			} else if err != nil {
				return nil, nil, fmt.Errorf("container %s: copy %s into the VM: %w", spec.ID, ways[i].Source, err)
			}
		}
		if ways[i].Kind == api.MountPath {
			r.Mounts = append(r.Mounts, m)
		}
	}
	place = func(shared []api.Mount) []api.Mount {
		p.recordContainer(spec.ID, spec.Mounts, ways)
		out := make([]api.Mount, 0, len(spec.Mounts))
		for i, m := range spec.Mounts {
			w := ways[i]
			if w.Kind == api.MountPath {
				out = append(out, shared[0])
				shared = shared[1:]
				continue
			}
			m.Kind, m.Source = w.Kind, w.Name
			if w.Kind != api.MountCopy {
				m.Mode, m.UID, m.GID = ownerOf(w.Source)
			}
			out = append(out, m)
		}
		return out
	}
	return &r, place, nil
}

// ownerOf is the mode (permission, set-ID and sticky bits) and owner of
// path; zeros when it cannot be read.
func ownerOf(path string) (mode, uid, gid uint32) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, 0, 0
	}
	return st.Mode & 0o7777, st.Uid, st.Gid
}

// recordContainer records container id's 9p mounts and termination
// message file, its mounts placed as ways say.
func (p *Pod) recordContainer(id string, mounts []api.Mount, ways []mountWay) {
	v := p.vols
	var shared []SharedMount
	msg := ""
	for i, m := range mounts {
		switch ways[i].Kind {
		case api.MountPath:
			shared = append(shared, SharedMount{Source: m.Source, Destination: m.Destination})
		case api.MountMessage:
			msg = ways[i].Source
		}
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(shared) > 0 {
		if v.rec.Shared == nil {
			v.rec.Shared = map[string][]SharedMount{}
		}
		v.rec.Shared[id] = shared
	}
	if msg != "" {
		if v.rec.Messages == nil {
			v.rec.Messages = map[string]string{}
		}
		v.rec.Messages[id] = msg
	}
	if err := v.saveLocked(); err != nil {
		p.log.Warn("kvm: record the pod's volumes", "container", id, "err", err)
	}
}

// forgetContainer drops container id from the record (Unshare).
func (p *Pod) forgetContainer(id string) {
	v := p.vols
	v.mu.Lock()
	defer v.mu.Unlock()
	_, s := v.rec.Shared[id]
	_, m := v.rec.Messages[id]
	if !s && !m {
		return
	}
	delete(v.rec.Shared, id)
	delete(v.rec.Messages, id)
	if err := v.saveLocked(); err != nil {
		p.log.Warn("kvm: record the pod's volumes", "container", id, "err", err)
	}
}

var _ stage1.AppExitReporter = (*Pod)(nil)

// AppExited implements stage1.AppExitReporter: a container with a
// termination message file in the guest has its end copied to the host
// file the kubelet reads. Errors: the agent's, the host file's.
func (p *Pod) AppExited(ctx context.Context, id string) error {
	p.vols.mu.Lock()
	dst := p.vols.rec.Messages[id]
	p.vols.mu.Unlock()
	if dst == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, volumeCallTimeout)
	defer cancel()
	msg, err := p.vols.agent.TerminationMessage(ctx, id)
	if err != nil {
		return fmt.Errorf("kvm: container %s: termination message: %w", id, err)
	}
	// The kubelet made the file; it is written over, not replaced.
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_TRUNC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("kvm: container %s: termination message: %w", id, err)
	}
	_, err = f.Write(msg)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("kvm: container %s: termination message: %w", id, err)
	}
	return nil
}

// errCannotCopy is why a tree cannot be copied into the guest.
type errCannotCopy struct{ error }

func (e errCannotCopy) Unwrap() error { return e.error }

// putCopy copies tree src into the guest as volume name, unless it is
// there already, and watches it. errCannotCopy: the tree cannot be read
// or copied (readTree).
func (v *podVolumes) putCopy(ctx context.Context, name, src string) error {
	v.mu.Lock()
	_, known := v.rec.Copies[name]
	v.mu.Unlock()
	if known {
		return nil
	}
	tree, err := readTree(name, src)
	if err != nil {
		return errCannotCopy{err}
	}
	cctx, cancel := context.WithTimeout(ctx, volumeCallTimeout)
	defer cancel()
	if err := v.agent.PutFiles(cctx, tree); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.stopped {
		return errdefs.FailedPrecondition("kvm: the pod is stopping")
	}
	if v.rec.Copies == nil {
		v.rec.Copies = map[string]string{}
	}
	if _, known := v.rec.Copies[name]; known {
		return nil
	}
	v.rec.Copies[name] = src
	if err := v.saveLocked(); err != nil {
		delete(v.rec.Copies, name)
		return fmt.Errorf("kvm: record the pod's volumes: %w", err)
	}
	v.watchLocked(name, src, treeDigest(tree))
	return nil
}

// watchLocked starts watching copy name's source src (inotify on it, or
// on its directory for a file): each change, once the source settled,
// is copied to the guest; put is the digest of what the guest has (zero:
// unknown, copied at once). The watch ends with stop, or when the
// source is gone (the kubelet removed the volume). v.mu is held.
func (v *podVolumes) watchLocked(name, src string, put [32]byte) {
	if v.stopped || v.watches[name] != nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	v.watches[name] = cancel
	go v.follow(ctx, name, src, put)
}

// follow is copy name's watch (watchLocked).
func (v *podVolumes) follow(ctx context.Context, name, src string, last [32]byte) {
	log := v.log.With("volume", name, "source", src)
	w, err := fsnotify.NewWatcher()
	if err != nil {
		log.Warn("kvm: watch a copied volume", "err", err)
		return
	}
	defer w.Close()
	st, err := os.Lstat(src)
	if err != nil {
		log.Debug("kvm: a copied volume's source is gone", "err", err)
		return
	}
	watched, only := src, ""
	if !st.IsDir() {
		watched, only = filepath.Dir(src), src
	}
	if err := w.Add(watched); err != nil {
		log.Warn("kvm: watch a copied volume", "err", err)
		return
	}
	// A first look at once: the source may have changed since it was
	// put, or while the daemon was down.
	settle := time.NewTimer(0)
	defer settle.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-w.Events:
			if !ok {
				return
			}
			if only != "" && ev.Name != only {
				continue
			}
			settle.Reset(copySettle)
		case err, ok := <-w.Errors:
			if !ok {
				return
			}
			log.Warn("kvm: watch a copied volume", "err", err)
			settle.Reset(copySettle)
		case <-settle.C:
			if _, err := os.Lstat(src); errors.Is(err, fs.ErrNotExist) {
				return
			}
			tree, err := readTree(name, src)
			if err == nil && treeDigest(tree) == last {
				continue
			}
			if err == nil {
				cctx, cancel := context.WithTimeout(ctx, volumeCallTimeout)
				err = v.agent.PutFiles(cctx, tree)
				cancel()
			}
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				log.Warn("kvm: copy a changed volume into the VM", "err", err)
				settle.Reset(copyRetry)
				continue
			}
			last = treeDigest(tree)
			log.Debug("kvm: copied a changed volume into the VM")
		}
	}
}

// treeDigest identifies a tree's contents.
func treeDigest(t *api.FileTree) [32]byte {
	b, _ := json.Marshal(t)
	return sha256.Sum256(b)
}

// readTree reads the tree at src (a directory or a regular file, links
// not followed) as guest volume name. FailedPrecondition: it holds
// something other than directories, regular files and links, or more
// than api.FileTree.Check takes.
func readTree(name, src string) (*api.FileTree, error) {
	t := &api.FileTree{Name: name}
	size := 0
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		e := api.FileEntry{Path: filepath.ToSlash(rel), Mode: info.Mode()}
		if sys, ok := info.Sys().(*syscall.Stat_t); ok {
			e.UID, e.GID = sys.Uid, sys.Gid
		}
		switch {
		case info.IsDir():
		case info.Mode()&fs.ModeSymlink != 0:
			if e.Link, err = os.Readlink(p); err != nil {
				return err
			}
		case info.Mode().IsRegular():
			if size += int(info.Size()); size > api.MaxFileTreeBytes {
				return errdefs.FailedPrecondition("more than %d bytes", api.MaxFileTreeBytes)
			}
			if e.Data, err = readRegular(p); err != nil {
				return err
			}
		default:
			return errdefs.FailedPrecondition("%s is not a file, directory or link", p)
		}
		t.Entries = append(t.Entries, e)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if err := t.Check(); err != nil {
		return nil, errdefs.FailedPrecondition("%w", err)
	}
	return t, nil
}

// readRegular reads the regular file p, not following a link there.
func readRegular(p string) ([]byte, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() || st.Size() > api.MaxFileTreeBytes {
		return nil, errdefs.FailedPrecondition("%s changed while it was read", p)
	}
	b, err := io.ReadAll(io.LimitReader(f, api.MaxFileTreeBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > api.MaxFileTreeBytes {
		return nil, errdefs.FailedPrecondition("%s grew while it was read", p)
	}
	return b, nil
}
