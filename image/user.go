package image

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	securejoin "github.com/cyphar/filepath-securejoin"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
)

// maxUserDB bounds how much of /etc/passwd or /etc/group is read.
const maxUserDB = 4 << 20

type passwdEntry struct {
	name     string
	uid, gid uint32
	home     string
}

// User is a user spec resolved in a container's root filesystem.
type User struct {
	UID, GID       uint32
	AdditionalGIDs []uint32
	// Home is the user's home directory in the image's /etc/passwd; "/"
	// for a user it does not list, or lists without one (runc's rule
	// for HOME).
	Home string
}

type groupEntry struct {
	name    string
	gid     uint32
	members []string
}

// ResolveUser resolves an image or pod user spec against the container's
// root filesystem: "" (root), "name", "uid", "name:group", "uid:gid",
// "name:gid", "uid:group". It reads rootfs/etc/passwd and rootfs/etc/group,
// resolving them inside rootfs (symlinks cannot lead outside it); missing
// files are treated as empty.
//
// A numeric uid absent from /etc/passwd gets gid 0, as Docker does. The
// supplementary groups are the /etc/group groups that list the user's name
// as a member. Errors: ErrInvalidArgument for an unknown user or group name,
// or a malformed spec.
func ResolveUser(rootfs, user string) (User, error) {
	uid, gid, groups, pw, err := resolveUser(rootfs, user)
	if err != nil {
		return User{}, err
	}
	u := User{UID: uid, GID: gid, AdditionalGIDs: groups, Home: "/"}
	if pw != nil && pw.home != "" {
		u.Home = pw.home
	}
	return u, nil
}

// resolveUser is ResolveUser's work; pw is the user's passwd entry, nil
// when the image has none.
func resolveUser(rootfs, user string) (uid, gid uint32, additionalGIDs []uint32, pw *passwdEntry, err error) {
	userPart, groupPart, hasGroup := strings.Cut(user, ":")
	if hasGroup && groupPart == "" {
		return 0, 0, nil, nil, errdefs.InvalidArgument("user %q: empty group", user)
	}
	if userPart == "" {
		if hasGroup {
			return 0, 0, nil, nil, errdefs.InvalidArgument("user %q: empty user", user)
		}
		userPart = "0"
	}
	passwd, err := readDB(rootfs, "/etc/passwd", parsePasswd)
	if err != nil {
		return 0, 0, nil, nil, err
	}
	if n, ok := parseID(userPart); ok {
		uid = n
		for i := range passwd {
			if passwd[i].uid == n {
				pw = &passwd[i]
				break
			}
		}
	} else {
		for i := range passwd {
			if passwd[i].name == userPart {
				pw = &passwd[i]
				break
			}
		}
		if pw == nil {
			return 0, 0, nil, nil, errdefs.InvalidArgument("user %q: no user named %q in the image's /etc/passwd", user, userPart)
		}
		uid = pw.uid
	}
	if pw != nil {
		gid = pw.gid
	}
	groups, err := readDB(rootfs, "/etc/group", parseGroup)
	if err != nil {
		return 0, 0, nil, nil, err
	}
	if hasGroup {
		if n, ok := parseID(groupPart); ok {
			gid = n
		} else {
			found := false
			for _, g := range groups {
				if g.name == groupPart {
					gid, found = g.gid, true
					break
				}
			}
			if !found {
				return 0, 0, nil, nil, errdefs.InvalidArgument("user %q: no group named %q in the image's /etc/group", user, groupPart)
			}
		}
	}
	if pw != nil {
		for _, g := range groups {
			if slices.Contains(g.members, pw.name) && !slices.Contains(additionalGIDs, g.gid) {
				additionalGIDs = append(additionalGIDs, g.gid)
			}
		}
	}
	return uid, gid, additionalGIDs, pw, nil
}

func parseID(s string) (uint32, bool) {
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, false
	}
	return uint32(n), true
}

// readDB reads file (an absolute path inside rootfs) resolved as if rootfs
// were "/", parsing each line with parse. A missing file yields nothing.
// Anything but a regular file is refused without being read (a FIFO would
// block).
func readDB[T any](rootfs, file string, parse func(string) (T, bool)) ([]T, error) {
	p, err := securejoin.SecureJoin(rootfs, file)
	if err != nil {
		return nil, errdefs.InvalidArgument("resolve %s in %s: %w", file, rootfs, err)
	}
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("open %s of the container: %w", file, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, errdefs.InvalidArgument("%s of the container is not a regular file", file)
	}
	var out []T
	sc := bufio.NewScanner(io.LimitReader(f, maxUserDB))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if e, ok := parse(line); ok {
			out = append(out, e)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, errdefs.InvalidArgument("read %s of the container: %w", file, err)
	}
	return out, nil
}

// parsePasswd parses "name:x:uid:gid:gecos:home:shell".
func parsePasswd(line string) (passwdEntry, bool) {
	f := strings.Split(line, ":")
	if len(f) < 4 {
		return passwdEntry{}, false
	}
	uid, ok1 := parseID(f[2])
	gid, ok2 := parseID(f[3])
	if !ok1 || !ok2 || f[0] == "" {
		return passwdEntry{}, false
	}
	e := passwdEntry{name: f[0], uid: uid, gid: gid}
	if len(f) > 5 {
		e.home = f[5]
	}
	return e, true
}

// parseGroup parses "name:x:gid:member,member".
func parseGroup(line string) (groupEntry, bool) {
	f := strings.Split(line, ":")
	if len(f) < 3 {
		return groupEntry{}, false
	}
	gid, ok := parseID(f[2])
	if !ok || f[0] == "" {
		return groupEntry{}, false
	}
	g := groupEntry{name: f[0], gid: gid}
	if len(f) > 3 && f[3] != "" {
		for _, m := range strings.Split(f[3], ",") {
			if m = strings.TrimSpace(m); m != "" {
				g.members = append(g.members, m)
			}
		}
	}
	return g, true
}
