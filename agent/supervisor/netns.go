package supervisor

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// reexecInNamespaces moves the calling thread into the network namespace
// at netns (unless empty) and, with privateIPC, into a new IPC namespace,
// and executes the agent again from that thread without those flags. A
// multithreaded Go process cannot move itself into a namespace as a whole,
// but execve keeps the namespaces of the thread that calls it, so the new
// process (and every app it forks) runs in them. It returns only on
// failure.
func reexecInNamespaces(netns string, privateIPC bool, args []string) error {
	runtime.LockOSThread() // never unlocked: the thread is replaced or the process fails
	if netns != "" {
		fd, err := unix.Open(netns, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			unix.Close(fd)
			return fmt.Errorf("setns: %w", err)
		}
		unix.Close(fd)
	}
	if privateIPC {
		if err := unix.Unshare(unix.CLONE_NEWIPC); err != nil {
			return fmt.Errorf("new IPC namespace: %w", err)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	argv := append([]string{os.Args[0], "agent"}, withoutBoolFlag(withoutFlag(args, "netns"), "private-ipc")...)
	return unix.Exec(exe, argv, os.Environ())
}

// withoutBoolFlag drops -name/--name (and --name=v) from args.
func withoutBoolFlag(args []string, name string) []string {
	var out []string
	for _, a := range args {
		bare := strings.TrimLeft(a, "-")
		if a != bare && (bare == name || strings.HasPrefix(bare, name+"=")) {
			continue
		}
		out = append(out, a)
	}
	return slices.Clip(out)
}

// withoutFlag drops -name/--name with its value (both "--name v" and
// "--name=v") from args.
func withoutFlag(args []string, name string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		bare := strings.TrimLeft(a, "-")
		if a != bare && (bare == name) {
			i++ // skip the value
			continue
		}
		if a != bare && strings.HasPrefix(bare, name+"=") {
			continue
		}
		out = append(out, a)
	}
	return slices.Clip(out)
}
