package supervisor

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"sync"
	"time"

	"github.com/stagelet/stagelet/internal/logfile"
)

// maxLogLine is the longest content the CRI log writer puts on one line; a
// longer line is split into partial ("P") lines, the last one full ("F").
const maxLogLine = 16 * 1024

// Streams of a CRI log line.
const (
	streamStdout = "stdout"
	streamStderr = "stderr"
)

// criLog writes an app's output to a file in the CRI log format the kubelet
// reads: "<RFC3339Nano time> <stream> <F|P> <content>\n". Writes from the
// stdout and stderr copiers are serialised so lines never interleave.
// An empty path discards everything. With mem set (AppSpec.HostLog) the
// lines go to the app's log buffer instead of a file, for the daemon to
// write on the host; a full buffer blocks the writer. Write errors (a full disk) are
// remembered and reported once by the copier; output keeps being drained so
// the app never blocks on a full pipe.
type criLog struct {
	mu   sync.Mutex
	path string
	f    *os.File
	mem  *logBuffer
	now  func() time.Time
	buf  []byte
	// closed: the app is gone; reopen does nothing any more.
	closed bool
}

// openCRILog opens (creating parent directories) the log at path for
// appending. An empty path gives a writer that discards.
func openCRILog(path string) (*criLog, error) {
	l := &criLog{path: path, now: time.Now}
	if path == "" {
		return l, nil
	}
	f, err := openLogFile(path)
	if err != nil {
		return nil, err
	}
	l.f = f
	return l, nil
}

func openLogFile(path string) (*os.File, error) { return logfile.Open(path) }

// writeLine writes one CRI log line. partial marks a chunk of a line that
// continues in the next one.
func (l *criLog) writeLine(stream string, partial bool, content []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil && l.mem == nil {
		return nil
	}
	tag := "F"
	if partial {
		tag = "P"
	}
	b := l.buf[:0]
	b = l.now().AppendFormat(b, time.RFC3339Nano)
	b = append(b, ' ')
	b = append(b, stream...)
	b = append(b, ' ')
	b = append(b, tag...)
	b = append(b, ' ')
	b = append(b, content...)
	b = append(b, '\n')
	l.buf = b
	if l.mem != nil {
		return l.mem.write(b)
	}
	_, err := l.f.Write(b)
	return err
}

// reopen closes the file and opens path again (the kubelet renamed it when
// rotating). A no-op for a discarding or closed writer.
func (l *criLog) reopen() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.path == "" || l.closed {
		return nil
	}
	f, err := openLogFile(l.path)
	if errors.Is(err, os.ErrNotExist) && l.f != nil {
		// A 9p mount without a dentry cache of its own (a kvm guest's
		// shared directory) keeps the open file's dentry under its old
		// name after the host renamed it, and finds that instead of
		// creating a new file: once the old file is closed the dentry
		// goes, and the name is looked up afresh.
		l.f.Close()
		l.f = nil
		f, err = openLogFile(l.path)
	}
	if err != nil {
		return err
	}
	if l.f != nil {
		l.f.Close()
	}
	l.f = f
	return nil
}

// close closes the file (ends the buffer: the daemon's session ends once
// it took what is left); later writes are discarded.
func (l *criLog) close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	if l.mem != nil {
		l.mem.end()
		l.mem = nil
	}
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// copyStream reads r until EOF and writes it to l as lines of stream
// (without a "\r" before the newline, as containerd writes them). A
// line longer than maxLogLine becomes P chunks ended by an F chunk. A last
// line without a newline is written as P at EOF, as containerd writes it:
// readers (the kubelet's termination message from the log among them) then
// add no newline the container never wrote. It returns the first
// write error (copying goes on after it) or a read error other than EOF
// or a closed file.
func (l *criLog) copyStream(stream string, r io.Reader) error {
	br := bufio.NewReaderSize(r, maxLogLine)
	var werr error
	note := func(err error) {
		if err != nil && werr == nil {
			werr = err
		}
	}
	for {
		line, err := br.ReadSlice('\n')
		switch {
		case err == nil:
			// A terminal ends lines with "\r\n"; the log keeps the text.
			line = bytes.TrimSuffix(line[:len(line)-1], []byte{'\r'})
			note(l.writeLine(stream, false, line))
		case errors.Is(err, bufio.ErrBufferFull):
			note(l.writeLine(stream, true, line))
		default:
			if len(line) > 0 {
				note(l.writeLine(stream, true, line))
			}
			if err == io.EOF || errors.Is(err, os.ErrClosed) {
				return werr
			}
			if werr != nil {
				return werr
			}
			return err
		}
	}
}
