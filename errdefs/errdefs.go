// Package errdefs defines the error classes stagelet uses across package
// boundaries. Code deep in the stack wraps one of these sentinels with %w;
// the CRI layer maps the class to a gRPC code exactly once. Nothing in
// stagelet classifies an error by its text.
package errdefs

import (
	"errors"
	"fmt"
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
)

// classError carries a class and a message without repeating the class text.
type classError struct {
	class error
	msg   string
}

func (e *classError) Error() string { return e.msg }
func (e *classError) Unwrap() error { return e.class }

// New returns an error of the given class whose text is the formatted message
// alone (the class name is not appended), for messages shown to users.
func New(class error, format string, args ...any) error {
	return &classError{class: class, msg: fmt.Sprintf(format, args...)}
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

// IsNotFound reports whether err is of class ErrNotFound.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }
