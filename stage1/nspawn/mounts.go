package nspawn

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// makeShared creates dir and makes it a shared mount point (a bind of
// itself), so that mounts made beneath it later propagate into the pod
// that binds it. Idempotent: an existing shared mount point is kept.
func makeShared(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	ms, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	if !contains(ms, dir) {
		if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s: %w", dir, err)
		}
	}
	if err := unix.Mount("", dir, "", unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make %s shared: %w", dir, err)
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// mountsUnder returns the mount points of this mount namespace at dir or
// beneath it, deepest (latest) first.
func mountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	dir = filepath.Clean(dir)
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		p := unescape(fields[4])
		if p == dir || strings.HasPrefix(p, dir+"/") {
			out = append(out, p)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	// Later lines are mounted later: unmount them first; deeper paths
	// before their parents.
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	sort.SliceStable(out, func(i, j int) bool {
		return strings.Count(out[i], "/") > strings.Count(out[j], "/")
	})
	return out, nil
}

// unescape undoes the kernel's octal escapes in mountinfo (\040).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// unmountAll detaches every mount at dir or beneath it. Mounts already gone
// are not errors.
func unmountAll(dir string) error {
	for range 3 { // a detached parent may take children with it
		ms, err := mountsUnder(dir)
		if err != nil {
			return err
		}
		if len(ms) == 0 {
			return nil
		}
		for _, m := range ms {
			err := unix.Unmount(m, unix.MNT_DETACH)
			if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("unmount %s: %w", m, err)
			}
		}
	}
	ms, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	if len(ms) > 0 {
		return fmt.Errorf("mounts left beneath %s: %v", dir, ms)
	}
	return nil
}

// removeUnmounted unmounts everything at dir or beneath it and removes
// dir. It never removes across a mount: when a mount remains, it fails
// and leaves the files. A missing dir is not an error.
func removeUnmounted(dir string) error {
	if _, err := os.Lstat(dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := unmountAll(dir); err != nil {
		return err
	}
	return os.RemoveAll(dir)
}

// bind binds src (recursively) onto dst, creating dst as a directory or an
// empty file to match src.
func bind(src, dst string) error {
	fi, err := os.Stat(src)
	if err != nil {
		return errdefs.FailedPrecondition("mount source: %v", err)
	}
	if fi.IsDir() {
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return err
		}
	} else {
		f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		f.Close()
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s on %s: %w", src, dst, err)
	}
	return nil
}

// systemdCgroup is the pod's cgroup in the hierarchies systemd-nspawn
// itself moves processes in on a v1 or hybrid host: name=systemd and the
// hybrid cgroup2 mount, where no controller stagelet uses is attached. It
// is "stagelet-pod-<id>" beneath the daemon's own cgroup there (the spec's
// cgroup parent names the controllers' hierarchies only), so no parent is
// created. On a pure v2 host the pod cgroup already is nspawn's, and an
// error is returned.
func systemdCgroup(spec *stage1.PodSpec) (*cgroups.Cgroup, error) {
	var sfs unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &sfs); err != nil {
		return nil, err
	}
	if sfs.Type == unix.CGROUP2_SUPER_MAGIC {
		return nil, errors.New("pure cgroup v2")
	}
	own, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	self := map[string]string{} // "name=systemd" or "" (cgroup2) → path
	for _, line := range strings.Split(string(own), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && (parts[1] == "name=systemd" || parts[1] == "") {
			self[parts[1]] = parts[2]
		}
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	cg := &cgroups.Cgroup{Paths: map[string]string{}}
	for _, line := range strings.Split(string(mi), "\n") {
		f := strings.Fields(line)
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if sep < 5 || len(f) < sep+4 {
			continue
		}
		var key, selfKey string
		switch {
		case f[sep+1] == "cgroup2":
			key, selfKey = "cgroup2", ""
		case f[sep+1] == "cgroup" && contains(strings.Split(f[sep+3], ","), "name=systemd"):
			key, selfKey = "name=systemd", "name=systemd"
		default:
			continue
		}
		if _, dup := cg.Paths[key]; dup {
			continue
		}
		path, ok := self[selfKey]
		if !ok {
			continue
		}
		root := unescape(f[3])
		rel := path
		if root != "/" {
			if r, ok := strings.CutPrefix(path, root); ok && (r == "" || r[0] == '/') {
				rel = r
			}
		}
		point := unescape(f[4])
		cg.Paths[key] = filepath.Join(point, filepath.Clean("/"+rel), "stagelet-pod-"+spec.ID)
	}
	if len(cg.Paths) == 0 {
		return nil, errors.New("no name=systemd or hybrid cgroup2 hierarchy")
	}
	return cg, nil
}
