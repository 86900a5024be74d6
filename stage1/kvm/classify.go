package kvm

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"regexp"

	"github.com/stagelet/stagelet/agent/api"
)

// A kvm container's mount reaches the guest one of four ways, decided by
// where its host source is, as the kubelet lays a pod's files out below
// its root (whatever that root is) and as the daemon gives every
// container its pod's files:
//
//   - .../pods/<uid>/volumes/kubernetes.io~empty-dir/<name>: a directory
//     in the guest's memory (api.MountGuest), one per source for the
//     whole pod.
//   - .../kubernetes.io~configmap, ~secret, ~projected and ~downward-api
//     volumes mounted read-only, .../pods/<uid>/etc-hosts and the daemon's resolv.conf,
//     hostname and hosts: a copy in the guest (api.MountCopy), kept
//     current.
//   - .../pods/<uid>/containers/<container>/<id>, the termination
//     message file: a file in the guest (api.MountMessage), copied back
//     when the container exits.
//   - anything else (hostPath, PVCs, CSI volumes, the kubelet's
//     volume-subpaths, devices): the pod's 9p share, as before.
//
// The source is classified by the path its symbolic links resolve to: a
// link from a volume's place to anywhere else is not that volume.

// mountWay is how one mount reaches the guest.
type mountWay struct {
	// Kind is the api.Mount kind; api.MountPath: over 9p.
	Kind string
	// Source is the resolved host path; Name the guest volume's name.
	Source, Name string
	// File: the source is a regular file.
	File bool
}

var (
	kubeletVolume  = regexp.MustCompile(`/pods/[^/]+/volumes/kubernetes\.io~(empty-dir|configmap|secret|projected|downward-api)/[^/]+$`)
	kubeletHosts   = regexp.MustCompile(`/pods/[^/]+/etc-hosts$`)
	kubeletMessage = regexp.MustCompile(`/pods/[^/]+/containers/[^/]+/[^/]+$`)
)

// podFiles are the files the daemon gives a pod's containers, in
// <pod run dir>/etc (broker.writePodFiles).
var podFiles = []string{"resolv.conf", "hostname", "hosts"}

// classifyMount says how mount m of a container of the pod whose run
// directory is runDir reaches the guest. A source that cannot be
// resolved, or a mount with propagation, goes over 9p (where errors are
// reported as before).
func classifyMount(m api.Mount, runDir string) mountWay {
	path := api.MountPath
	if m.Kind != api.MountPath || (m.Propagation != "" && m.Propagation != "private") || !filepath.IsAbs(m.Source) {
		return mountWay{Kind: path}
	}
	src, err := filepath.EvalSymlinks(m.Source)
	if err != nil {
		return mountWay{Kind: path}
	}
	st, err := os.Lstat(src)
	if err != nil {
		return mountWay{Kind: path}
	}
	w := mountWay{Source: src, File: st.Mode().IsRegular()}
	switch {
	case st.IsDir() && kubeletVolume.MatchString(src):
		switch {
		case kubeletVolume.FindStringSubmatch(src)[1] == "empty-dir":
			w.Kind = api.MountGuest
		case m.Readonly:
			w.Kind = api.MountCopy
		default:
			// The kubelet mounts these read-only: a writable one is
			// someone else's, whose writes the host must see.
			return mountWay{Kind: path}
		}
	case w.File && (kubeletHosts.MatchString(src) || isPodFile(src, runDir)):
		w.Kind = api.MountCopy
	case w.File && kubeletMessage.MatchString(src):
		w.Kind = api.MountMessage
	default:
		return mountWay{Kind: path}
	}
	w.Name = volumeName(w.Kind, src)
	return w
}

// isPodFile tells whether src is one of the daemon's files of the pod
// whose run directory is runDir.
func isPodFile(src, runDir string) bool {
	if runDir == "" {
		return false
	}
	dir, err := filepath.EvalSymlinks(filepath.Join(runDir, "etc"))
	if err != nil || filepath.Dir(src) != dir {
		return false
	}
	for _, n := range podFiles {
		if filepath.Base(src) == n {
			return true
		}
	}
	return false
}

// volumeName names the guest volume of kind for source src: the same
// source, the same volume.
func volumeName(kind, src string) string {
	h := sha256.Sum256([]byte(kind + "\x00" + src))
	return kind + "-" + hex.EncodeToString(h[:12])
}
