package supervisor

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
)

// Terminals. An app or exec'd command with a terminal opens it itself,
// inside its own root, from the /dev/ptmx it sees there (the devpts
// instance of the app, as runc does): the terminal is then its own, named
// in its /dev/pts. The child sends the master to the agent over the sync
// socket (SCM_RIGHTS) with a {"pty": true} message, makes the slave its
// controlling terminal and stdio, and goes on. The agent keeps the master:
// it reads the output, writes input and sets the window size.

// openTerminal opens a new terminal in the caller's /dev/ptmx and returns
// its master and slave. The slave belongs to uid, as a login's terminal
// does. size, when set, is the initial window size.
func openTerminal(uid uint32, size *api.TerminalSize) (master, slave int, err error) {
	master, err = unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, -1, fmt.Errorf("open /dev/ptmx: %w", err)
	}
	fail := func(err error) (int, int, error) {
		unix.Close(master)
		return -1, -1, err
	}
	if err := unix.IoctlSetPointerInt(master, unix.TIOCSPTLCK, 0); err != nil {
		return fail(fmt.Errorf("unlock terminal: %w", err))
	}
	// TIOCGPTPEER opens the slave through the master, with no path lookup
	// an app could redirect.
	s, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(master), unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	slave = int(s)
	if errno != 0 {
		n, err := unix.IoctlGetInt(master, unix.TIOCGPTN)
		if err != nil {
			return fail(fmt.Errorf("terminal number: %w", err))
		}
		if slave, err = unix.Open("/dev/pts/"+strconv.Itoa(n), unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0); err != nil {
			return fail(fmt.Errorf("open terminal: %w", err))
		}
	}
	if err := unix.Fchown(slave, int(uid), -1); err != nil {
		unix.Close(slave)
		return fail(fmt.Errorf("chown terminal: %w", err))
	}
	if size != nil {
		if err := setWinsize(master, *size); err != nil {
			unix.Close(slave)
			return fail(err)
		}
	}
	return master, slave, nil
}

// becomeTerminal makes slave the controlling terminal of the calling
// session leader and its stdin, stdout and stderr, then closes slave.
func becomeTerminal(slave int) error {
	if err := unix.IoctlSetInt(slave, unix.TIOCSCTTY, 0); err != nil {
		return fmt.Errorf("set controlling terminal: %w", err)
	}
	for fd := 0; fd <= 2; fd++ {
		if err := unix.Dup3(slave, fd, 0); err != nil {
			return fmt.Errorf("terminal as fd %d: %w", fd, err)
		}
	}
	if slave > 2 {
		unix.Close(slave)
	}
	return nil
}

func setWinsize(fd int, size api.TerminalSize) error {
	if err := unix.IoctlSetWinsize(fd, unix.TIOCSWINSZ, &unix.Winsize{Row: size.Height, Col: size.Width}); err != nil {
		return fmt.Errorf("set terminal size: %w", err)
	}
	return nil
}

// terminal is the agent's end of an app's or command's terminal.
type terminal struct {
	f *os.File
	// mu serialises writes of input and end-of-file.
	mu sync.Mutex
}

func newTerminal(f *os.File) *terminal { return &terminal{f: f} }

// Read reads the terminal's output. EIO, which a master reads once every
// slave is closed, is the end of the output.
func (t *terminal) Read(p []byte) (int, error) {
	n, err := t.f.Read(p)
	if errors.Is(err, unix.EIO) {
		err = io.EOF
	}
	return n, err
}

// Write types input.
func (t *terminal) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.f.Write(p)
}

// resize sets the window size; the foreground process gets SIGWINCH.
func (t *terminal) resize(size api.TerminalSize) error {
	conn, err := t.f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := conn.Control(func(fd uintptr) { serr = setWinsize(int(fd), size) }); err != nil {
		return err
	}
	return serr
}

// endInput is what closing stdin means on a terminal: the terminal's
// end-of-file character, as a user ends input by typing it. In canonical
// (line) mode it makes a read at the start of a line return end of file;
// line editors in raw mode (shells) take it the same way.
func (t *terminal) endInput() error {
	conn, err := t.f.SyscallConn()
	if err != nil {
		return err
	}
	var tio *unix.Termios
	var terr error
	if err := conn.Control(func(fd uintptr) { tio, terr = unix.IoctlGetTermios(int(fd), unix.TCGETS) }); err != nil {
		return err
	}
	if terr != nil {
		return terr
	}
	_, err = t.Write([]byte{tio.Cc[unix.VEOF]})
	return err
}

func (t *terminal) Close() error { return t.f.Close() }

// rightsReader reads a unix stream socket and keeps the file descriptors
// that arrive with the bytes (SCM_RIGHTS), in order.
type rightsReader struct {
	c   *net.UnixConn
	oob []byte
	fds []int
}

func newRightsReader(c net.Conn) (*rightsReader, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return nil, fmt.Errorf("sync socket is a %T, not a unix socket", c)
	}
	return &rightsReader{c: uc, oob: make([]byte, unix.CmsgSpace(4*4))}, nil
}

func (r *rightsReader) Read(p []byte) (int, error) {
	n, oobn, _, _, err := r.c.ReadMsgUnix(p, r.oob)
	if n < 0 {
		// ReadMsgUnix passes on recvmsg's -1 with an error (a reset,
		// when the child exec'd leaving bytes unread); an io.Reader
		// never returns a negative count, and json.Decoder panics on one.
		n = 0
	}
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(r.oob[:oobn])
		if perr == nil {
			for _, m := range msgs {
				if fds, err := unix.ParseUnixRights(&m); err == nil {
					for _, fd := range fds {
						unix.CloseOnExec(fd)
					}
					r.fds = append(r.fds, fds...)
				}
			}
		}
	}
	if n == 0 && err == nil {
		err = io.EOF
	}
	return n, err
}

// take returns the first descriptor received and not yet taken, as a
// non-blocking file (closing it interrupts a pending read); nil when
// there is none.
func (r *rightsReader) take(name string) *os.File {
	if len(r.fds) == 0 {
		return nil
	}
	fd := r.fds[0]
	r.fds = r.fds[1:]
	unix.SetNonblock(fd, true)
	return os.NewFile(uintptr(fd), name)
}

// close closes every descriptor not taken.
func (r *rightsReader) close() {
	for _, fd := range r.fds {
		unix.Close(fd)
	}
	r.fds = nil
}
