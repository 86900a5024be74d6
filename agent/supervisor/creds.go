package supervisor

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/moby/sys/capability"
)

// defaultPath is the search path when the app's environment has no PATH,
// the one container runtimes use.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// parseCaps turns capability names ("CAP_CHOWN", also "chown" and any
// case) into capabilities. An unknown name is an error naming it.
func parseCaps(names []string) ([]capability.Cap, error) {
	known := map[string]capability.Cap{}
	for _, c := range capability.ListKnown() {
		known["CAP_"+strings.ToUpper(c.String())] = c
	}
	var caps []capability.Cap
	seen := map[capability.Cap]bool{}
	for _, n := range names {
		key := strings.ToUpper(strings.TrimSpace(n))
		if !strings.HasPrefix(key, "CAP_") {
			key = "CAP_" + key
		}
		c, ok := known[key]
		if !ok {
			return nil, fmt.Errorf("unknown capability %q", n)
		}
		if !seen[c] {
			seen[c] = true
			caps = append(caps, c)
		}
	}
	return caps, nil
}

// capName is the CAP_ name of c.
func capName(c capability.Cap) string { return "CAP_" + strings.ToUpper(c.String()) }

// envValue returns the value of key in env ("KEY=value" entries; the last
// one wins) and whether it is set.
func envValue(env []string, key string) (string, bool) {
	val, ok := "", false
	for _, e := range env {
		if k, v, found := strings.Cut(e, "="); found && k == key {
			val, ok = v, true
		}
	}
	return val, ok
}

// lookPath finds file the way execvp does, using the PATH in env (or
// defaultPath when unset) on the current root: a name containing a slash is
// used as it is; otherwise the first executable regular file in the path
// wins. The error text matches os/exec's, e.g.
// `exec: "nosuch": executable file not found in $PATH`.
func lookPath(file string, env []string) (string, error) {
	if file == "" {
		return "", errors.New(`exec: "": executable file not found in $PATH`)
	}
	if strings.Contains(file, "/") {
		if err := checkExecutable(file); err != nil {
			return "", fmt.Errorf("exec: %q: %w", file, err)
		}
		return file, nil
	}
	path, ok := envValue(env, "PATH")
	if !ok {
		path = defaultPath
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, file)
		if checkExecutable(p) == nil {
			if !filepath.IsAbs(p) {
				// Like os/exec: a match through a relative PATH entry is
				// used as a relative name, never silently as a lookup.
				p = "./" + p
			}
			return p, nil
		}
	}
	return "", fmt.Errorf("exec: %q: executable file not found in $PATH", file)
}

// checkExecutable reports whether path is a regular file with an execute
// bit set.
func checkExecutable(path string) error {
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	if st.IsDir() || !st.Mode().IsRegular() {
		return &fs.PathError{Op: "exec", Path: path, Err: errors.New("is not a regular file")}
	}
	if st.Mode().Perm()&0o111 == 0 {
		return &fs.PathError{Op: "exec", Path: path, Err: fs.ErrPermission}
	}
	return nil
}
