package seccomp

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Install loads the filter into the calling process. It is for the last
// steps before execve: from then on every system call of the process, and
// of the program it executes, goes through the filter.
//
// The kernel accepts a filter only from a thread with no_new_privs set or
// holding CAP_SYS_ADMIN; Install returns an error saying so otherwise.
//
// Threads: a filter attaches to the calling thread, and execve keeps only
// the thread that calls it. In Go the caller must run on the thread that
// will call execve (runtime.LockOSThread). Install also asks the kernel to
// synchronize the filter to every other thread of the process
// (SECCOMP_FILTER_FLAG_TSYNC), so no thread of the Go runtime escapes it
// in the meantime, and threads created later inherit it.
//
// Install refuses on a machine that is not x86_64: the program judges
// x86_64 system call numbers.
func Install(f *Filter) error { return install(f, flagTSync) }

// InstallThread loads the filter into the calling thread only, not into
// the process's other threads: the processes the thread forks inherit it.
// It is for a thread that forks a command and is then retired (locked to
// a goroutine that exits), never for one that goes back to the Go
// runtime.
func InstallThread(f *Filter) error { return install(f, 0) }

func install(f *Filter, extra uint) error {
	if runtime.GOARCH != "amd64" {
		return fmt.Errorf("seccomp: filters are compiled for x86_64, this machine is %s", runtime.GOARCH)
	}
	if f == nil || len(f.Program) == 0 {
		return errors.New("seccomp: empty filter")
	}
	prog := make([]unix.SockFilter, len(f.Program))
	for i, ins := range f.Program {
		prog[i] = unix.SockFilter{Code: ins.Op, Jt: ins.Jt, Jf: ins.Jf, K: ins.K}
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	flags := f.Flags | extra
	r1, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, uintptr(flags), uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(prog)
	switch {
	case errno == 0 && r1 == 0:
		return nil
	case errno == 0:
		return fmt.Errorf("seccomp: thread %d of the process cannot take the filter", r1)
	case errno == unix.EACCES:
		return errors.New("seccomp: installing a filter needs no_new_privs or CAP_SYS_ADMIN")
	case errno == unix.ENOSYS:
		return errors.New("seccomp: the kernel does not support seccomp(2)")
	case errno == unix.EINVAL && f.Flags != 0:
		return fmt.Errorf("seccomp: the kernel refused the filter or its flags %#x: %w", f.Flags, errno)
	default:
		return fmt.Errorf("seccomp: install filter: %w", errno)
	}
}

// Supported tells whether the kernel offers seccomp filters.
func Supported() bool {
	// PR_GET_SECCOMP fails with EINVAL on a kernel without seccomp.
	_, err := unix.PrctlRetInt(unix.PR_GET_SECCOMP, 0, 0, 0, 0)
	return err == nil
}
