package errdefs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"syscall"
	"testing"
)

func TestNewKeepsItsCause(t *testing.T) {
	err := New(ErrUnavailable, "write the record: %w", syscall.ENOSPC)
	if err.Error() != "write the record: no space left on device" {
		t.Errorf("text %q", err)
	}
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("errors.Is: class %v, cause %v", errors.Is(err, ErrUnavailable), errors.Is(err, syscall.ENOSPC))
	}
	// Wrapped again, as callers do.
	outer := fmt.Errorf("pod x: %w", err)
	if !errors.Is(outer, ErrUnavailable) || !errors.Is(outer, syscall.ENOSPC) {
		t.Error("lost through fmt.Errorf")
	}
	_, perr := os.Open("/nonexistent/stagelet")
	err = FailedPrecondition("mount source: %w", perr)
	var pe *fs.PathError
	if !errors.As(err, &pe) || pe.Path != "/nonexistent/stagelet" {
		t.Errorf("errors.As to *fs.PathError: %v", err)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		t.Error("the cause's ErrNotExist is not reachable")
	}
}

// An error's class is its outermost one: a cause classed otherwise below
// does not make it of that class too.
func TestClassIsTheOutermost(t *testing.T) {
	err := FailedPrecondition("setting up: %w", NotFound("container c"))
	if IsNotFound(err) {
		t.Error("a FailedPrecondition whose cause was NotFound reads as NotFound")
	}
	if !errors.Is(err, ErrFailedPrecondition) {
		t.Error("lost its own class")
	}
	plain := InvalidArgument("bad %s", "input")
	if !errors.Is(plain, ErrInvalidArgument) || errors.Is(plain, ErrNotFound) {
		t.Error("a message without %w")
	}
	var ce *classError
	if !errors.As(plain, &ce) || ce.cause != nil {
		t.Errorf("a message without %%w has a cause: %+v", ce)
	}
}

func TestStorageNamesAFullFileSystem(t *testing.T) {
	write := &os.PathError{Op: "write", Path: "/var/lib/stagelet/pods/x.json", Err: syscall.ENOSPC}
	err := Storage(write, "/var/lib/stagelet")
	if !errors.Is(err, ErrResourceExhausted) || !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("%v: want ResourceExhausted with ENOSPC as its cause", err)
	}
	if !strings.Contains(err.Error(), "the file system of /var/lib/stagelet is full") || !strings.Contains(err.Error(), write.Path) {
		t.Errorf("%q does not name the file system and the file", err)
	}
	if err := Storage(&os.PathError{Op: "write", Path: "/q", Err: syscall.EDQUOT}, "/q"); !errors.Is(err, ErrResourceExhausted) {
		t.Errorf("a quota: %v", err)
	}
	other := &os.PathError{Op: "write", Path: "/x", Err: syscall.EIO}
	if err := Storage(other, "/x"); err != error(other) {
		t.Errorf("another error changed: %v", err)
	}
	if Storage(nil, "/x") != nil {
		t.Error("nil changed")
	}
}
