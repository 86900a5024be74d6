// Package osthread runs code that moves its OS thread into other
// namespaces (setns, unshare) on a thread that no other goroutine ever
// runs on afterwards.
package osthread

import (
	"runtime"

	"golang.org/x/sys/unix"
)

// Run runs fn on an OS thread locked to it that ends when fn returns, so
// fn may leave the thread in any namespace. That thread is never the
// process's main thread: the Go runtime cannot end the main thread and
// parks it instead, still in the namespace fn joined, and what the kernel
// shows as /proc/self (mountinfo, net, ns) is the main thread's view: the
// whole process would read a pod's mounts as its own.
func Run(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // not unlocked after fn: the thread ends with the goroutine
		main := onMainThread()
		errc <- offMainThread(fn)
		if main {
			// fn ran elsewhere: the main thread is as it was.
			runtime.UnlockOSThread()
		}
	}()
	return <-errc
}

// offMainThread runs fn on the calling goroutine's thread, to which the
// caller has locked it, unless that is the main thread: then through Run,
// whose goroutine cannot get the main thread while the caller holds it.
func offMainThread(fn func() error) error {
	if !onMainThread() {
		return fn()
	}
	return Run(fn)
}

func onMainThread() bool { return unix.Gettid() == unix.Getpid() }
