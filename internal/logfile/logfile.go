// Package logfile opens a container's CRI log file for appending, the one
// way both of its writers do: the agent, which writes the file itself
// (fly, nspawn), and the daemon, which writes it on the host from the
// agent's log session (a VM's containers).
package logfile

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Mode is the log file's mode when it is created.
const Mode = 0o640

// Open opens the log at path for appending, creating it (Mode) and its
// parent directories (0755). It never opens through a symbolic link
// planted at path, and only a regular file: a link or anything else is an
// error.
func Open(path string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("log %s: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND|unix.O_NOFOLLOW|unix.O_NONBLOCK, Mode)
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("log %s is a symbolic link: logs are not written through links", path)
	}
	if err != nil {
		return nil, fmt.Errorf("log %s: %w", path, err)
	}
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		if err == nil {
			err = fmt.Errorf("a %s, not a regular file", fi.Mode().Type())
		}
		return nil, fmt.Errorf("log %s: %w", path, err)
	}
	return f, nil
}
