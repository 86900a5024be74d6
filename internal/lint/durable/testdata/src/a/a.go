package a

import (
	"os"
	"syscall"
)

func dropped(f *os.File) {
	f.Sync()                         // want `the error of os.File.Sync is dropped`
	os.Rename("a", "b")              // want `the error of os.Rename is dropped`
	defer syscall.Unmount("/mnt", 0) // want `the error of syscall.Unmount is dropped by defer`
	_ = syscall.Fsync(3)             // want `the error of syscall.Fsync is assigned to _`
	go os.Rename("c", "d")           // want `the error of os.Rename is dropped by go`
	syscall.Sync()                   // no error result: nothing to drop
	os.Remove("x")                   // not a durability call
}

func handled(f *os.File) error {
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
