package seccomp

import (
	"slices"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// RuntimeDefault returns stagelet's default profile (the CRI's
// RuntimeDefault) for a container holding the capabilities caps (names
// like "CAP_SYS_ADMIN").
//
// It is an allow-list in the spirit of Docker's and containerd's default
// profiles: what ordinary programs need is allowed; what reaches kernel
// state shared with the host or other pods (keyrings, kernel modules,
// swap, the clock, kexec, namespaces and mounts, BPF, perf, userfaultfd,
// io_uring, personality changes beyond the usual ones) is refused with
// EPERM unless the container holds the capability guarding it, in which
// case the kernel's permission check is the barrier. clone3 answers ENOSYS
// so that C libraries fall back to clone, whose namespace flags the filter
// can see.
func RuntimeDefault(caps ...string) *Profile {
	eperm := uint(unix.EPERM)
	enosys := uint(unix.ENOSYS)
	has := func(c string) bool { return slices.Contains(caps, c) }
	p := &Profile{
		DefaultAction:   specs.ActErrno,
		DefaultErrnoRet: &eperm,
		Architectures:   []specs.Arch{specs.ArchX86_64},
	}
	allow := func(names ...string) {
		p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: names, Action: specs.ActAllow})
	}
	allowIf := func(args []specs.LinuxSeccompArg, names ...string) {
		p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: names, Action: specs.ActAllow, Args: args})
	}
	allow(defaultAllowed...)

	// socket: every family but AF_ALG (the kernel's crypto API, a large
	// attack surface no ordinary program needs) and AF_VSOCK (host/guest
	// sockets, not namespaced).
	allowIf([]specs.LinuxSeccompArg{
		{Index: 0, Value: unix.AF_ALG, Op: specs.OpNotEqual},
		{Index: 0, Value: unix.AF_VSOCK, Op: specs.OpNotEqual},
	}, "socket")

	// personality: Linux, with address-space randomization off
	// (ADDR_NO_RANDOMIZE, used by debuggers), 32-bit mode (PER_LINUX32),
	// both, and the query.
	for _, v := range []uint64{0x0, 0x0008, 0x20000, 0x20008, 0xffffffff} {
		allowIf([]specs.LinuxSeccompArg{{Index: 0, Value: v, Op: specs.OpEqualTo}}, "personality")
	}

	if has("CAP_SYS_ADMIN") {
		allow("bpf", "clone", "clone3", "fanotify_init", "fsconfig", "fsmount", "fsopen", "fspick",
			"lookup_dcookie", "mount", "mount_setattr", "move_mount", "open_tree", "perf_event_open",
			"quotactl", "quotactl_fd", "setdomainname", "sethostname", "setns", "syslog",
			"umount2", "unshare")
	} else {
		// clone without namespace flags; clone3 hides its flags behind a
		// pointer.
		ns := uint64(unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWUSER |
			unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWCGROUP)
		allowIf([]specs.LinuxSeccompArg{{Index: 0, Value: ns, ValueTwo: 0, Op: specs.OpMaskedEqual}}, "clone")
		p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: []string{"clone3"}, Action: specs.ActErrno, ErrnoRet: &enosys})
	}
	for _, g := range capabilityGated {
		if has(g.cap) {
			allow(g.names...)
		}
	}
	return p
}

// capabilityGated are system calls whose only use is what a capability
// allows: allowed when the container holds it.
var capabilityGated = []struct {
	cap   string
	names []string
}{
	{"CAP_SYS_BOOT", []string{"reboot"}},
	{"CAP_SYS_CHROOT", []string{"chroot"}},
	{"CAP_SYS_MODULE", []string{"init_module", "finit_module", "delete_module"}},
	{"CAP_SYS_PACCT", []string{"acct"}},
	{"CAP_SYS_PTRACE", []string{"kcmp", "pidfd_getfd", "process_madvise"}},
	{"CAP_SYS_RAWIO", []string{"iopl", "ioperm"}},
	{"CAP_SYS_TIME", []string{"settimeofday", "clock_settime"}},
	{"CAP_SYS_TTY_CONFIG", []string{"vhangup"}},
	{"CAP_SYS_NICE", []string{"get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node"}},
	{"CAP_SYSLOG", []string{"syslog"}},
	{"CAP_BPF", []string{"bpf"}},
	{"CAP_PERFMON", []string{"perf_event_open"}},
	{"CAP_DAC_READ_SEARCH", []string{"open_by_handle_at"}},
}

// defaultAllowed are the x86_64 system calls any container may make. Not
// here, and so refused: add_key, keyctl, request_key (keyrings are not
// namespaced); kexec_load, kexec_file_load; swapon, swapoff; pivot_root;
// userfaultfd; io_uring_*; uselib, ustat, sysfs, _sysctl and other
// obsolete calls; nfsservctl, get_kernel_syms, query_module,
// create_module; vm86; and the capability-gated calls above.
var defaultAllowed = []string{
	// Files and directories.
	"access", "chdir", "chmod", "chown", "close", "close_range", "copy_file_range", "creat",
	"dup", "dup2", "dup3", "faccessat", "faccessat2", "fadvise64", "fallocate", "fchdir",
	"fchmod", "fchmodat", "fchmodat2", "fchown", "fchownat", "fcntl", "fdatasync", "flock",
	"fstat", "fstatfs", "fsync", "ftruncate", "futimesat", "getcwd", "getdents", "getdents64",
	"lchown", "link", "linkat", "lseek", "lstat", "mkdir", "mkdirat", "mknod", "mknodat",
	"name_to_handle_at", "newfstatat", "open", "openat", "openat2", "pread64", "preadv",
	"preadv2", "pwrite64", "pwritev", "pwritev2", "read", "readahead", "readlink",
	"readlinkat", "readv", "rename", "renameat", "renameat2", "rmdir", "sendfile", "splice",
	"stat", "statfs", "statx", "symlink", "symlinkat", "sync", "sync_file_range", "syncfs",
	"tee", "truncate", "umask", "unlink", "unlinkat", "utime", "utimensat", "utimes",
	"vmsplice", "write", "writev", "cachestat", "statmount", "listmount",
	// Extended attributes.
	"fgetxattr", "flistxattr", "fremovexattr", "fsetxattr", "getxattr", "lgetxattr",
	"listxattr", "llistxattr", "lremovexattr", "lsetxattr", "removexattr", "setxattr",
	"getxattrat", "listxattrat", "removexattrat", "setxattrat",
	// Waiting on files and events.
	"epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old", "epoll_pwait",
	"epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2", "fanotify_mark",
	"inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch", "pipe", "pipe2",
	"poll", "ppoll", "pselect6", "select", "signalfd", "signalfd4", "timerfd_create",
	"timerfd_gettime", "timerfd_settime",
	// Asynchronous I/O.
	"io_cancel", "io_destroy", "io_getevents", "io_pgetevents", "io_setup", "io_submit",
	"ioctl", "ioprio_get", "ioprio_set",
	// Memory.
	"brk", "madvise", "map_shadow_stack", "membarrier", "memfd_create", "memfd_secret",
	"mincore", "mlock", "mlock2", "mlockall", "mmap", "mprotect", "mremap", "mseal", "msync",
	"munlock", "munlockall", "munmap", "pkey_alloc", "pkey_free", "pkey_mprotect",
	"remap_file_pages",
	// Processes, threads and scheduling.
	"arch_prctl", "capget", "capset", "execve", "execveat", "exit", "exit_group", "fork",
	"futex", "futex_requeue", "futex_wait", "futex_waitv", "futex_wake", "get_robust_list",
	"get_thread_area", "getcpu", "getpgid", "getpgrp", "getpid", "getppid", "getpriority",
	"getrlimit", "getrusage", "getsid", "gettid", "kill", "modify_ldt", "pidfd_open",
	"pidfd_send_signal", "prctl", "prlimit64", "process_mrelease", "ptrace",
	"process_vm_readv", "process_vm_writev", "restart_syscall", "rseq",
	"sched_get_priority_max", "sched_get_priority_min", "sched_getaffinity", "sched_getattr",
	"sched_getparam", "sched_getscheduler", "sched_rr_get_interval", "sched_setaffinity",
	"sched_setattr", "sched_setparam", "sched_setscheduler", "sched_yield", "seccomp",
	"set_robust_list", "set_thread_area", "set_tid_address", "setpgid", "setpriority",
	"setrlimit", "setsid", "tgkill", "tkill", "vfork", "wait4", "waitid", "uretprobe",
	"landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self",
	// Credentials.
	"getegid", "geteuid", "getgid", "getgroups", "getresgid", "getresuid", "getuid",
	"setfsgid", "setfsuid", "setgid", "setgroups", "setregid", "setresgid", "setresuid",
	"setreuid", "setuid",
	// Signals.
	"alarm", "getitimer", "pause", "rt_sigaction", "rt_sigpending", "rt_sigprocmask",
	"rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait",
	"rt_tgsigqueueinfo", "setitimer", "sigaltstack",
	// Time.
	"adjtimex", "clock_adjtime", "clock_getres", "clock_gettime", "clock_nanosleep",
	"gettimeofday", "nanosleep", "time", "timer_create", "timer_delete", "timer_getoverrun",
	"timer_gettime", "timer_settime", "times",
	// Sockets (socket itself is filtered by family).
	"accept", "accept4", "bind", "connect", "getpeername", "getsockname", "getsockopt",
	"listen", "recvfrom", "recvmmsg", "recvmsg", "sendmmsg", "sendmsg", "sendto",
	"setsockopt", "shutdown", "socketpair",
	// System V and POSIX IPC (namespaced per pod).
	"mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive", "mq_timedsend", "mq_unlink",
	"msgctl", "msgget", "msgrcv", "msgsnd", "semctl", "semget", "semop", "semtimedop",
	"shmat", "shmctl", "shmdt", "shmget",
	// The system.
	"sysinfo", "uname",
}
