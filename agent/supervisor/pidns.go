package supervisor

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// forkInPIDNamespace runs start, which must fork (os.StartProcess forks
// from the calling thread), on a thread whose children go into the PID
// namespace ns: setns(CLONE_NEWPID) changes only where the thread's future
// children go, so the agent itself stays where it is. The thread's own
// setting is restored afterwards; a thread that cannot be restored is
// retired with its goroutine.
func forkInPIDNamespace(ns *os.File, start func() error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		own, err := os.Open("/proc/thread-self/ns/pid")
		if err != nil {
			runtime.UnlockOSThread()
			done <- err
			return
		}
		defer own.Close()
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWPID); err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("enter the app's PID namespace: %w", err)
			return
		}
		err = start()
		if rerr := unix.Setns(int(own.Fd()), unix.CLONE_NEWPID); rerr != nil {
			// Stay locked: the goroutine ends and the thread with it.
			done <- err
			return
		}
		runtime.UnlockOSThread()
		done <- err
	}()
	return <-done
}
