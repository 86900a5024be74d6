package agent

import (
	"encoding/json"
	"io"
	"net"

	"github.com/stagelet/stagelet/agent/api"
)

// What another implementation of the agent's protocol (a test double
// such as stage1/fake's agent) needs to answer as Agent does: the same
// responses, error codes and session frames.

// ErrorResponse is the response carrying err's class (errdefs) as its
// code, as Agent answers a failed request.
func ErrorResponse(err error) *api.Response { return errResponse(err) }

// ServeStdioSession serves an exec or attach session on c, whose request
// was read (in reads c after it): it answers OK, runs fn with the
// client's stdin (it ends at the client's FrameEOF, or with an error when
// the client goes) and writers of stdout and stderr frames, and ends the
// session with fn's exit code. Terminal sizes are not passed on.
func ServeStdioSession(c net.Conn, in io.Reader, fn func(stdin io.Reader, stdout, stderr io.Writer) int32) error {
	if err := json.NewEncoder(c).Encode(&api.Response{}); err != nil {
		return err
	}
	fw := newFrameWriter(c)
	pr := framesToPipe(newFrameReader(in), api.FrameStdin)
	code := fn(pr, streamWriter{fw, api.FrameStdout}, streamWriter{fw, api.FrameStderr})
	pr.Close()
	return fw.writeJSON(api.FrameEnd, api.SessionEnd{ExitCode: code})
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
	fw := newFrameWriter(c)
	pr := framesToPipe(newFrameReader(in), api.FrameData)
	fn(struct {
		io.Reader
		io.Writer
	}{pr, streamWriter{fw, api.FrameData}})
	pr.Close()
	return fw.write(api.FrameEOF, nil)
}

// framesToPipe copies the payload of the client's frames of type typ to
// the pipe it returns, until the client's FrameEOF (the pipe then reads
// io.EOF), the end of its stream (the pipe's read fails) or the reader
// closing the pipe.
func framesToPipe(fr *frameReader, typ byte) *io.PipeReader {
	pr, pw := io.Pipe()
	go func() {
		for {
			t, p, err := fr.read()
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
