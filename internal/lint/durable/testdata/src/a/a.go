package a

import (
	"os"
	"syscall"
)

// syncDir returns a watched call's error: a wrapper.
func syncDir(fd int) error { // want syncDir:`wraps syscall.Fsync`
	return syscall.Fsync(fd)
}

// publish wraps a wrapper.
func publish(fd int) error { // want publish:`wraps syscall.Fsync`
	if fd < 0 {
		return nil
	}
	return syncDir(fd)
}

// logged handles the error itself: not a wrapper.
func logged(fd int) error {
	if err := syscall.Fsync(fd); err != nil {
		println(err.Error())
	}
	return nil
}

func wrappers() {
	_ = syncDir(3) // want `the error of a.syncDir \(a wrapper of syscall.Fsync\) is assigned to _`
	publish(3)     // want `the error of a.publish \(a wrapper of syscall.Fsync\) is dropped`
	logged(3)
}

func dropped(f *os.File) {
	f.Sync()                         // want `the error of os.File.Sync is dropped`
	os.Rename("a", "b")              // want `the error of os.Rename is dropped`
	defer syscall.Unmount("/mnt", 0) // want `the error of syscall.Unmount is dropped by defer`
	_ = syscall.Fsync(3)             // want `the error of syscall.Fsync is assigned to _`
	go os.Rename("c", "d")           // want `the error of os.Rename is dropped by go`
	syscall.Sync()                   // no error result: nothing to drop
	os.Remove("x")                   // not a durability call
}

func handled(f *os.File) error { // want handled:`wraps syscall.Fsync`
	if err := f.Sync(); err != nil {
		return err
	}
	err := os.Rename("a", "b")
	if err != nil {
		return err
	}
	defer func() {
		if err := syscall.Unmount("/mnt", 0); err != nil {
			panic(err)
		}
	}()
	return syscall.Fsync(3)
}
