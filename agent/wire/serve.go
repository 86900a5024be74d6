package wire

import (
	"encoding/json"
	"errors"
	"io"
	"net"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// ErrorResponse is the response carrying err's class (errdefs) as its
// code, as the agent answers a failed request.
func ErrorResponse(err error) *api.Response {
	code := api.CodeInternal
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		code = api.CodeNotFound
	case errors.Is(err, errdefs.ErrAlreadyExists):
		code = api.CodeAlreadyExists
	case errors.Is(err, errdefs.ErrInvalidArgument):
		code = api.CodeInvalidArgument
	case errors.Is(err, errdefs.ErrFailedPrecondition):
		code = api.CodeFailedPrecondition
	case errors.Is(err, errdefs.ErrDeadlineExceeded):
		code = api.CodeDeadlineExceeded
	}
	return &api.Response{Code: code, Error: err.Error()}
}

// ClassOf is the errdefs class of a response's or session end's code
// (ErrorResponse's inverse); an unknown code is an internal error.
func ClassOf(code string) error {
	switch code {
	case api.CodeNotFound:
		return errdefs.ErrNotFound
	case api.CodeAlreadyExists:
		return errdefs.ErrAlreadyExists
	case api.CodeInvalidArgument:
		return errdefs.ErrInvalidArgument
	case api.CodeFailedPrecondition:
		return errdefs.ErrFailedPrecondition
	case api.CodeDeadlineExceeded:
		return errdefs.ErrDeadlineExceeded
	default:
		return errors.New("agent internal error")
	}
}

// ServeStdioSession serves an exec or attach session on c, whose request
// was read (in reads c after it): it answers OK, runs fn with the
// client's stdin (it ends at the client's FrameEOF, or with an error when
// the client goes) and writers of stdout and stderr frames, and ends the
// session with fn's exit code. Terminal sizes are not passed on.
func ServeStdioSession(c net.Conn, in io.Reader, fn func(stdin io.Reader, stdout, stderr io.Writer) int32) error {
	if err := json.NewEncoder(c).Encode(&api.Response{}); err != nil {
		return err
	}
	fw := NewWriter(c)
	pr := FramesToPipe(NewReader(in), api.FrameStdin)
	code := fn(pr, fw.Stream(api.FrameStdout), fw.Stream(api.FrameStderr))
	pr.Close()
	return fw.SendJSON(api.FrameEnd, api.SessionEnd{ExitCode: code})
}

// ServePortSession serves a port-forward session on c, whose request was
// read (in reads c after it): it answers OK and runs fn with a stream
// whose reads are the client's data (io.EOF at its FrameEOF) and whose
// writes go to the client; when fn returns, the end of the pod's side is
// sent.
func ServePortSession(c net.Conn, in io.Reader, fn func(stream io.ReadWriter)) error {
	if err := json.NewEncoder(c).Encode(&api.Response{}); err != nil {
		return err
	}
	fw := NewWriter(c)
	pr := FramesToPipe(NewReader(in), api.FrameData)
	fn(struct {
		io.Reader
		io.Writer
	}{pr, fw.Stream(api.FrameData)})
	pr.Close()
	return fw.Send(api.FrameEOF, nil)
}

// FramesToPipe copies the payload of the client's frames of type typ to
// the pipe it returns, until the client's FrameEOF (the pipe then reads
// io.EOF), the end of its stream (the pipe's read fails) or the reader
// closing the pipe.
func FramesToPipe(fr *Reader, typ byte) *io.PipeReader {
	pr, pw := io.Pipe()
	go func() {
		for {
			t, p, err := fr.Next()
			if err != nil {
				pw.CloseWithError(err)
				return
			}
			switch t {
			case typ:
				if _, err := pw.Write(p); err != nil {
					return // the reader stopped
				}
			case api.FrameEOF:
				pw.Close()
			}
		}
	}()
	return pr
}
