package kvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
	"github.com/stagelet/stagelet/stage1"
)

// A container's image reaches the guest as a disk rather than over 9p:
// every VM has a virtio-scsi controller (scsiController), and when a
// container whose rootfs the guest would read over 9p as the lower layer
// of its overlay (AppSpec.LocalUpper) is created, its image's read-only
// erofs disk image (made once per image by the image store: Config.
// ImageDisks) is plugged into the VM as a scsi-hd at a SCSI target of its
// own, once per image per pod, and the agent mounts it as that lower
// layer instead (AppSpec.RootfsDisk). The disk is shared by the pod's
// containers of that image and unplugged when the last is removed. qemu
// is handed the disk's file as a descriptor (QMP add-fd), so that a
// confined qemu needs no access to the image store.
//
// The plugged disks are recorded in the VM directory (disksFile), written
// atomically before a disk is plugged and after it is unplugged, so that
// a restarted daemon knows them; Pod.Disks lists them, with what another
// node needs to plug the same bytes at the same address: the image ID,
// the disk's SHA-256, the SCSI target and the qemu IDs.

// ImageDiskFunc returns the read-only erofs disk image of image imageID
// (an image ID): the path of its file and the file's hex SHA-256. It is
// the image store's (image.Store.Disk). Errors: NotFound for an unknown
// image; FailedPrecondition when no disk can be made on this node
// (mkfs.erofs missing).
type ImageDiskFunc func(ctx context.Context, imageID string) (path, sha256 string, err error)

// UseImageDisks gives the backend the image store's disks: from then on
// the containers of pods without a user namespace of their own read
// their image from a disk. Call it before the backend runs any pod.
func (b *Backend) UseImageDisks(f ImageDiskFunc) { b.cfg.ImageDisks = f }

// scsiController is the qemu ID of every VM's virtio-scsi controller;
// its bus is scsiBus.
const (
	scsiController = "scsi0"
	scsiBus        = scsiController + ".0"
	// maxSCSITarget is virtio-scsi's highest target.
	maxSCSITarget = 255
)

// disksFile is the record of a VM's plugged disks, in its VM directory.
const disksFile = "disks.json"

const disksVersion = 1

// PluggedDisk is an image's disk plugged into a pod's VM.
type PluggedDisk struct {
	// ImageID is the image whose files the disk holds; SHA256 the hex
	// SHA-256 of the disk image file, Path that file on this node.
	ImageID string `json:"imageId"`
	SHA256  string `json:"sha256"`
	Path    string `json:"path"`
	// Target is the disk's SCSI target on the VM's virtio-scsi
	// controller (bus scsi0.0, channel 0, LUN 0); Serial the serial
	// number it reports.
	Target int    `json:"target"`
	Serial string `json:"serial"`
	// Node and Device are qemu's IDs of its block node (raw, read-only)
	// and of its scsi-hd device.
	Node   string `json:"node"`
	Device string `json:"device"`
	// Users are the containers that use it.
	Users []string `json:"users"`
}

// diskRecord is disksFile's content.
type diskRecord struct {
	Version int `json:"version"`
	// Next is the target the next disk gets if it is free: targets go
	// round, so that a target a disk was just unplugged from (which the
	// guest may not have let go of yet) is not the next one's.
	Next  int           `json:"next"`
	Disks []PluggedDisk `json:"disks"`
}

// diskPlugs guards a pod's disk record.
type diskPlugs struct {
	mu sync.Mutex
	// controller: the VM was found to have the SCSI controller (VMs
	// started by earlier versions have none).
	controller bool
}

func (p *Pod) disksPath() string { return filepath.Join(p.st.dir(), disksFile) }

// loadDisks reads the record; none yet is an empty one.
func (p *Pod) loadDisks() (*diskRecord, error) {
	b, err := os.ReadFile(p.disksPath())
	if errors.Is(err, os.ErrNotExist) {
		return &diskRecord{Version: disksVersion}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("kvm: the VM's disks: %w", err)
	}
	var r diskRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, errdefs.New(errdefs.ErrInvalidArgument, "kvm: the VM's disks %s: %w", p.disksPath(), err)
	}
	if r.Version != disksVersion {
		return nil, errdefs.New(errdefs.ErrFailedPrecondition, "kvm: the VM's disks %s: version %d, want %d", p.disksPath(), r.Version, disksVersion)
	}
	return &r, nil
}

func (p *Pod) saveDisks(r *diskRecord) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	if err := atomicfile.Write(p.disksPath(), b, 0o600); err != nil {
		return fmt.Errorf("kvm: record the VM's disks: %w", err)
	}
	return nil
}

// Disks lists the image disks plugged into the pod's VM, as recorded
// (a disk being plugged is listed from just before its plug). It reads
// the record on the host and asks nothing of the VM.
func (p *Pod) Disks() ([]PluggedDisk, error) {
	p.disks.mu.Lock()
	defer p.disks.mu.Unlock()
	r, err := p.loadDisks()
	if err != nil {
		return nil, err
	}
	out := make([]PluggedDisk, len(r.Disks))
	for i, d := range r.Disks {
		d.Users = slices.Clone(d.Users)
		out[i] = d
	}
	return out, nil
}

// diskIDs are the qemu IDs of the disk at target.
func diskIDs(target int) (node, device string) {
	t := strconv.Itoa(target)
	return "imgdisk" + t, "imgdisk" + t + "-dev"
}

// attachImageDisk gives container ctr the disk of image imageID: the one
// already plugged for another container of that image, or a new one.
// Idempotent for a container that has it. Errors: the image store's
// (NotFound, FailedPrecondition), FailedPrecondition when every SCSI
// target is taken or qemu refuses the disk.
func (p *Pod) attachImageDisk(ctx context.Context, ctr, imageID string) (*api.Disk, error) {
	p.disks.mu.Lock()
	defer p.disks.mu.Unlock()
	r, err := p.loadDisks()
	if err != nil {
		return nil, err
	}
	for i := range r.Disks {
		d := &r.Disks[i]
		if d.ImageID != imageID {
			continue
		}
		if !slices.Contains(d.Users, ctr) {
			d.Users = append(d.Users, ctr)
			if err := p.saveDisks(r); err != nil {
				return nil, err
			}
		}
		return guestDisk(d), nil
	}
	if err := p.checkController(ctx); err != nil {
		return nil, noDiskError{err}
	}
	path, sum, err := p.b.cfg.ImageDisks(ctx, imageID)
	if err != nil {
		return nil, fmt.Errorf("kvm: the disk of image %s: %w", imageID, noDiskError{err})
	}
	target, ok := freeTarget(r)
	if !ok {
		return nil, errdefs.FailedPrecondition("kvm: the VM has a disk at each of its %d SCSI targets", maxSCSITarget+1)
	}
	node, dev := diskIDs(target)
	d := PluggedDisk{ImageID: imageID, SHA256: sum, Path: path, Target: target, Serial: diskSerial(sum),
		Node: node, Device: dev, Users: []string{ctr}}
	r.Disks = append(r.Disks, d)
	r.Next = (target + 1) % (maxSCSITarget + 1)
	// Recorded first: a crash in between leaves a record the unplug
	// of its last user clears.
	if err := p.saveDisks(r); err != nil {
		return nil, err
	}
	if err := p.plugDisk(ctx, &d); err != nil {
		r.Disks = r.Disks[:len(r.Disks)-1]
		if serr := p.saveDisks(r); serr != nil {
			p.log.WarnContext(ctx, "kvm: record the VM's disks after a failed plug", "err", serr)
		}
		return nil, err
	}
	p.log.DebugContext(ctx, "kvm: image disk plugged", "container", ctr, "image", imageID, "target", target)
	return guestDisk(&d), nil
}

// checkController checks once that the VM has the SCSI controller disks
// are plugged into: FailedPrecondition for a VM started by an earlier
// version, whose containers keep reading their image over 9p. The
// caller holds p.disks.mu.
func (p *Pod) checkController(ctx context.Context) error {
	if p.disks.controller {
		return nil
	}
	q, err := p.dialQMP(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	ok, err := q.peripheral(ctx, scsiController)
	if err != nil {
		return fmt.Errorf("kvm: %w", err)
	}
	if !ok {
		return errdefs.FailedPrecondition("kvm: the VM has no SCSI controller to plug image disks into: it was started by an earlier version")
	}
	p.disks.controller = true
	return nil
}

// freeTarget is the first target from r.Next on that no disk has.
func freeTarget(r *diskRecord) (int, bool) {
	used := map[int]bool{}
	for _, d := range r.Disks {
		used[d.Target] = true
	}
	for i := range maxSCSITarget + 1 {
		t := (r.Next + i) % (maxSCSITarget + 1)
		if !used[t] {
			return t, true
		}
	}
	return 0, false
}

// diskSerial is the serial number a disk reports: the start of its
// SHA-256, which the guest checks.
func diskSerial(sum string) string {
	if len(sum) > 20 {
		return sum[:20]
	}
	return sum
}

// guestDisk is how the agent finds d.
func guestDisk(d *PluggedDisk) *api.Disk {
	return &api.Disk{Target: d.Target, Serial: d.Serial, FSType: "erofs"}
}

// detachImageDisk takes container ctr off the disk it uses, and unplugs
// the disk when no other container uses it. The agent has let go of it
// (RemoveContainer forgets the app first). Idempotent. Failures to
// unplug are logged: the disk goes with the VM at the latest.
func (p *Pod) detachImageDisk(ctx context.Context, ctr string) error {
	p.disks.mu.Lock()
	defer p.disks.mu.Unlock()
	r, err := p.loadDisks()
	if err != nil {
		return err
	}
	for i := range r.Disks {
		d := &r.Disks[i]
		if !slices.Contains(d.Users, ctr) {
			continue
		}
		d.Users = slices.DeleteFunc(d.Users, func(u string) bool { return u == ctr })
		if len(d.Users) > 0 {
			return p.saveDisks(r)
		}
		gone := *d
		if err := p.unplugDisk(ctx, &gone); err != nil {
			if q := p.st.qemu(); q != nil && !q.Alive() {
				// The pod is stopping: the disk went with the VM.
				p.log.DebugContext(ctx, "kvm: image disk not unplugged: the VM is gone", "image", gone.ImageID, "err", err)
			} else {
				p.log.WarnContext(ctx, "kvm: unplug an image disk", "image", gone.ImageID, "target", gone.Target, "err", err)
			}
		}
		r.Disks = slices.Delete(r.Disks, i, i+1)
		return p.saveDisks(r)
	}
	return nil
}

// plugDisk plugs d into the VM: its file handed to qemu as a descriptor,
// a read-only raw block node over it, a scsi-hd on the controller at
// d.Target. Nothing stays plugged on failure.
func (p *Pod) plugDisk(ctx context.Context, d *PluggedDisk) error {
	f, err := os.Open(d.Path)
	if err != nil {
		return fmt.Errorf("kvm: image %s disk: %w", d.ImageID, err)
	}
	defer f.Close()
	q, err := p.dialQMP(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	if err := q.sendFD(f); err != nil {
		return fmt.Errorf("kvm: hand the disk of image %s to qemu: %w", d.ImageID, err)
	}
	ret, err := q.run(ctx, "add-fd", map[string]any{"opaque": "image " + d.ImageID})
	if err != nil {
		return errdefs.FailedPrecondition("kvm: hand the disk of image %s to qemu: %w", d.ImageID, err)
	}
	var set struct {
		FDSet int `json:"fdset-id"`
	}
	if err := json.Unmarshal(ret, &set); err != nil {
		return fmt.Errorf("kvm: add-fd: %w", err)
	}
	_, err = q.run(ctx, "blockdev-add", map[string]any{
		"driver": "raw", "node-name": d.Node, "read-only": true,
		"file": map[string]any{"driver": "file", "filename": "/dev/fdset/" + strconv.Itoa(set.FDSet), "read-only": true},
	})
	// qemu holds its own copy of the descriptor once the node is open.
	if _, rerr := q.run(ctx, "remove-fd", map[string]any{"fdset-id": set.FDSet}); rerr != nil {
		p.log.WarnContext(ctx, "kvm: release a disk's descriptor set", "fdset", set.FDSet, "err", rerr)
	}
	if err != nil {
		return errdefs.FailedPrecondition("kvm: the disk of image %s: %w", d.ImageID, err)
	}
	_, err = q.run(ctx, "device_add", map[string]any{
		"driver": "scsi-hd", "id": d.Device, "drive": d.Node, "bus": scsiBus,
		"scsi-id": d.Target, "lun": 0, "serial": d.Serial,
	})
	if err != nil {
		if _, derr := q.run(ctx, "blockdev-del", map[string]any{"node-name": d.Node}); derr != nil {
			p.log.WarnContext(ctx, "kvm: remove the block node of a disk that failed to plug", "node", d.Node, "err", derr)
		}
		return errdefs.FailedPrecondition("kvm: plug the disk of image %s into the VM: %w", d.ImageID, err)
	}
	return nil
}

// unplugTimeout bounds an unplug: the device's removal, then its node's.
var unplugTimeout = 10 * time.Second

// unplugDisk removes d's scsi-hd (device_del), waits until qemu has let
// it go, then removes its block node. A device or node already gone is
// fine. It runs to its own timeout whether or not ctx ends.
func (p *Pod) unplugDisk(ctx context.Context, d *PluggedDisk) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), unplugTimeout)
	defer cancel()
	q, err := p.dialQMP(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	if _, err := q.run(ctx, "device_del", map[string]any{"id": d.Device}); err != nil && !strings.Contains(err.Error(), "DeviceNotFound") {
		return fmt.Errorf("kvm: device_del %s: %w", d.Device, err)
	}
	for delay := 5 * time.Millisecond; ; delay = min(2*delay, 200*time.Millisecond) {
		present, err := q.peripheral(ctx, d.Device)
		if err != nil {
			return err
		}
		if !present {
			break
		}
		select {
		case <-ctx.Done():
			return errdefs.New(errdefs.ErrDeadlineExceeded, "kvm: disk device %s still in the VM after device_del", d.Device)
		case <-time.After(delay): // polling: qemu's event is not read here
		}
	}
	// The device lets go of its node a moment after it left the tree.
	for delay := 5 * time.Millisecond; ; delay = min(2*delay, 200*time.Millisecond) {
		_, err := q.run(ctx, "blockdev-del", map[string]any{"node-name": d.Node})
		if err == nil || strings.Contains(err.Error(), "Failed to find node") {
			return nil
		}
		if !strings.Contains(err.Error(), "in use") {
			return fmt.Errorf("kvm: blockdev-del %s: %w", d.Node, err)
		}
		select {
		case <-ctx.Done():
			return errdefs.New(errdefs.ErrDeadlineExceeded, "kvm: disk node %s: %w", d.Node, err)
		case <-time.After(delay): // polling: qemu's event is not read here
		}
	}
}

// sendFD passes f to qemu over the QMP socket, for the next command that
// takes a descriptor (add-fd): it rides on one byte of white space,
// which QMP's parser skips.
func (q *qmp) sendFD(f *os.File) error {
	uc, ok := q.conn.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("qmp: not a unix socket: %T", q.conn)
	}
	_, _, err := uc.WriteMsgUnix([]byte(" "), unix.UnixRights(int(f.Fd())), nil)
	return err
}

// peripheral tells whether the VM has a device of qemu ID id.
func (q *qmp) peripheral(ctx context.Context, id string) (bool, error) {
	ret, err := q.run(ctx, "qom-list", map[string]any{"path": "/machine/peripheral"})
	if err != nil {
		return false, err
	}
	var props []struct {
		Name string `json:"name"`
	}
	if err := json.Unmarshal(ret, &props); err != nil {
		return false, fmt.Errorf("qom-list: %w", err)
	}
	for _, pr := range props {
		if pr.Name == id {
			return true, nil
		}
	}
	return false, nil
}

// rootfsDisk gives container spec its image as a disk in out (the spec
// the agent gets) when the guest would read the image over 9p as the
// lower layer of the container's overlay: out.LocalUpper, an image ID and
// image disks to give. Where this node cannot make disks (FailedPrecondition
// from the image store: mkfs.erofs missing) the container keeps the 9p
// lower layer, and the reason is logged.
func (p *Pod) rootfsDisk(ctx context.Context, spec *stage1.ContainerSpec, out *stage1.ContainerSpec) error {
	if !out.LocalUpper || spec.ImageID == "" || p.b.cfg.ImageDisks == nil {
		return nil
	}
	d, err := p.attachImageDisk(ctx, spec.ID, spec.ImageID)
	var nd noDiskError
	if errors.As(err, &nd) && errors.Is(err, errdefs.ErrFailedPrecondition) {
		p.log.WarnContext(ctx, "kvm: the container's image reaches the VM over 9p: no disk of it", "container", spec.ID, "image", spec.ImageID, "err", err)
		return nil
	}
	if err != nil {
		return err
	}
	out.RootfsDisk = d
	return nil
}

// noDiskError is the image store's failure to give an image's disk.
type noDiskError struct{ err error }

func (e noDiskError) Error() string { return e.err.Error() }
func (e noDiskError) Unwrap() error { return e.err }
