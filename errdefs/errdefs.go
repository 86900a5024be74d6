// Package errdefs defines the error classes stagelet uses across package
// boundaries. Code deep in the stack wraps one of these sentinels with %w;
// the CRI layer maps the class to a gRPC code exactly once. Nothing in
// stagelet classifies an error by its text.
//
// The idiom for a classed error with a cause is New (or a shorthand) with
// the cause wrapped by %w:
//
//	errdefs.New(errdefs.ErrUnavailable, "agent %s: dial: %w", id, err)
//	errdefs.InvalidArgument("config.devices[%d].host_path: %w", i, err)
//
// The message is the user's, the class is the outermost one whatever the
// cause's own class was, and errors.Is and errors.As still reach the
// cause (syscall.ENOSPC, an *os.PathError). Context added above a classed
// error is fmt.Errorf("...: %w", err), which keeps both. A cause formatted
// with %v is lost to errors.Is, and so is one beside a class in
// fmt.Errorf("...: %v: %w", err, errdefs.ErrX): TestOneIdiom refuses both
// forms anywhere in the module. A write that may meet a full file system
// goes through Storage.
package errdefs

import (
	"errors"
	"fmt"
	"syscall"
)

// The error classes. Wrap them: fmt.Errorf("pod %s: %w", id, errdefs.ErrNotFound).
var (
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrPermissionDenied   = errors.New("permission denied")
	ErrUnavailable        = errors.New("unavailable")
	ErrUnimplemented      = errors.New("not implemented")
	ErrDeadlineExceeded   = errors.New("deadline exceeded")
	// ErrResourceExhausted: something ran out, a file system (Storage).
	ErrResourceExhausted = errors.New("resource exhausted")
)

// classError carries a class and a message without repeating the class
// text, and the errors the message wrapped with %w (cause).
type classError struct {
	class error
	msg   string
	cause error
}

func (e *classError) Error() string { return e.msg }

func (e *classError) Unwrap() []error {
	if e.cause == nil {
		return []error{e.class}
	}
	return []error{e.class, cause{e.cause}}
}

// cause is what a classError wraps: errors.Is and errors.As reach through
// it to the system and library errors beneath (syscall.ENOSPC, an
// *os.PathError), but not to an error class: the class of an error is
// its outermost one, whatever its cause was classed as below.
type cause struct{ err error }

func (c cause) Error() string { return c.err.Error() }

func (c cause) Is(target error) bool { return !isClass(target) && errors.Is(c.err, target) }

func (c cause) As(target any) bool { return errors.As(c.err, target) }

var classes = []error{ErrNotFound, ErrAlreadyExists, ErrInvalidArgument, ErrFailedPrecondition,
	ErrPermissionDenied, ErrUnavailable, ErrUnimplemented, ErrDeadlineExceeded, ErrResourceExhausted}

func isClass(err error) bool {
	for _, c := range classes {
		if err == c {
			return true
		}
	}
	return false
}

// New returns an error of the given class whose text is the formatted
// message alone (the class name is not appended), for messages shown to
// users. What the format wraps with %w stays reachable with errors.Is and
// errors.As, its own class aside: errors.Is(err, syscall.ENOSPC) holds
// for New(ErrUnavailable, "write: %w", syscall.ENOSPC).
func New(class error, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	e := &classError{class: class, msg: err.Error()}
	switch err.(type) {
	case interface{ Unwrap() error }, interface{ Unwrap() []error }:
		e.cause = err
	}
	return e
}

// InvalidArgument is a shorthand for New(ErrInvalidArgument, ...).
func InvalidArgument(format string, args ...any) error {
	return New(ErrInvalidArgument, format, args...)
}

// NotFound is a shorthand for New(ErrNotFound, ...).
func NotFound(format string, args ...any) error { return New(ErrNotFound, format, args...) }

// AlreadyExists is a shorthand for New(ErrAlreadyExists, ...).
func AlreadyExists(format string, args ...any) error {
	return New(ErrAlreadyExists, format, args...)
}

// FailedPrecondition is a shorthand for New(ErrFailedPrecondition, ...).
func FailedPrecondition(format string, args ...any) error {
	return New(ErrFailedPrecondition, format, args...)
}

// Storage classes err, a failed write beneath dir: a full file system or
// quota (ENOSPC, EDQUOT) is ErrResourceExhausted naming dir's file
// system, with err as its cause; any other error is returned as it is.
func Storage(err error, dir string) error {
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return New(ErrResourceExhausted, "the file system of %s is full: %w", dir, err)
	}
	return err
}

// IsNotFound reports whether err is of class ErrNotFound.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }
