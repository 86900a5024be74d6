package supervisor

import (
	"context"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/rlimit"
)

// Toy is a System for tests that have no root (stage1/fake): the agent's
// request handling runs as it does in a pod, over processes that are
// goroutines. A started app's or exec's process is Run, called with the
// process's stdio (pipes, or a terminal's slave) and a context that ends
// when the process is signalled (it then ends as killed by that signal).
// No namespace, mount or cgroup is made; the cgroups are in memory and
// apply nothing. Set the exported fields before New.
type Toy struct {
	// Run runs a process's command line and returns its exit code; it
	// returns soon once ctx ends. stdin is nil for a process without one.
	Run func(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int32
	// Serve answers a connection to port on the pod's loopback (a
	// port-forward); nil: nothing accepts.
	Serve func(port int32, conn net.Conn)

	mu      sync.Mutex
	nextPID int
	// procs are the live processes by app: the app's own and its execs'.
	procs   map[string][]*toyProc
	sysctls map[string]string
	// devices are the device rules each app's cgroup was given.
	devices map[string][]specs.LinuxDeviceCgroup
}

var _ System = (*Toy)(nil)

// useRlimits implements System: the toy's processes have no limits of
// their own.
func (*Toy) useRlimits([]rlimit.Limit) {}

// toyProc is one process of a Toy.
type toyProc struct {
	app    string
	main   bool // the app's own process, not an exec's
	pid    int
	cancel context.CancelFunc
	wait   chan syscall.WaitStatus
	once   sync.Once
	// closers are the process's ends of its stdio, closed when it ends.
	closers []io.Closer
}

// end ends the process with status ws (once: the first end stands).
func (p *toyProc) end(t *Toy, ws syscall.WaitStatus) bool {
	ended := false
	p.once.Do(func() {
		ended = true
		p.cancel()
		for _, c := range p.closers {
			c.Close()
		}
		t.mu.Lock()
		t.procs[p.app] = slices.DeleteFunc(t.procs[p.app], func(q *toyProc) bool { return q == p })
		if len(t.procs[p.app]) == 0 {
			delete(t.procs, p.app)
		}
		t.mu.Unlock()
		p.wait <- ws
	})
	return ended
}

// kernel implements System.
func (t *Toy) kernel() string { return "toy" }

// start implements System: the process's stdio are pipes (or a terminal),
// and Run starts at once.
func (t *Toy) start(s *startSpec) (*child, error) {
	if t.Run == nil {
		return nil, errdefs.FailedPrecondition("toy: no Run")
	}
	if s.exec && (s.appProc == nil || !t.running(s.app.ID)) {
		return nil, errdefs.FailedPrecondition("app %s is not running", s.app.ID)
	}
	if !s.deadline.IsZero() && time.Now().After(s.deadline) {
		return nil, errdefs.ErrDeadlineExceeded
	}
	c := &child{}
	var theirs []io.Closer
	fail := func(err error) (*child, error) {
		for _, f := range theirs {
			f.Close()
		}
		c.closeStdio()
		return nil, err
	}
	var stdin io.Reader
	var stdout, stderr io.Writer
	if s.cio.tty {
		master, slave, err := openTerminal(uint32(os.Getuid()), s.size)
		if err != nil {
			return fail(err)
		}
		c.pty = newTerminal(os.NewFile(uintptr(master), "pty-master"))
		f := os.NewFile(uintptr(slave), "pty-slave")
		theirs = append(theirs, f)
		stdout, stderr = f, f
		if s.cio.stdin {
			stdin = f
		}
	} else {
		if s.cio.stdin {
			r, w, err := os.Pipe()
			if err != nil {
				return fail(err)
			}
			c.stdin, stdin = w, r
			theirs = append(theirs, r)
		}
		outs := []*io.Writer{&stdout, &stderr}
		for i, mine := range []**os.File{&c.stdout, &c.stderr} {
			r, w, err := os.Pipe()
			if err != nil {
				return fail(err)
			}
			*mine, *outs[i] = r, w
			theirs = append(theirs, w)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.mu.Lock()
	if t.procs == nil {
		t.procs = map[string][]*toyProc{}
	}
	t.nextPID++
	p := &toyProc{app: s.app.ID, main: !s.exec, pid: 100 + t.nextPID, cancel: cancel, wait: make(chan syscall.WaitStatus, 1), closers: theirs}
	t.procs[p.app] = append(t.procs[p.app], p)
	t.mu.Unlock()
	c.proc, c.pid, c.wait = &toySignaller{t: t, p: p}, p.pid, p.wait
	go func() {
		code := t.Run(ctx, s.args, stdin, stdout, stderr)
		p.end(t, syscall.WaitStatus(uint32(code&0xff)<<8))
	}()
	return c, nil
}

// toySignaller is a toy process as the agent controls it.
type toySignaller struct {
	t *Toy
	p *toyProc
}

func (s *toySignaller) Signal(sig os.Signal) error {
	n, _ := sig.(syscall.Signal)
	if n == 0 {
		if s.t.alive(s.p) {
			return nil
		}
		return os.ErrProcessDone
	}
	if !s.p.end(s.t, syscall.WaitStatus(n)) {
		return os.ErrProcessDone
	}
	return nil
}

func (s *toySignaller) Release() error { return nil }

func (t *Toy) alive(p *toyProc) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Contains(t.procs[p.app], p)
}

func (t *Toy) running(app string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.ContainsFunc(t.procs[app], func(p *toyProc) bool { return p.main })
}

// Exit makes app id's own process exit with code, as if its command
// ended so; false when it does not run.
func (t *Toy) Exit(id string, code int32) bool {
	t.mu.Lock()
	var main *toyProc
	for _, p := range t.procs[id] {
		if p.main {
			main = p
		}
	}
	t.mu.Unlock()
	return main != nil && main.end(t, syscall.WaitStatus(uint32(code&0xff)<<8))
}

// Running lists the apps whose own process runs.
func (t *Toy) Running() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var ids []string
	for id, ps := range t.procs {
		if slices.ContainsFunc(ps, func(p *toyProc) bool { return p.main }) {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

// Sysctls are the IPC sysctls the agent set.
func (t *Toy) Sysctls() map[string]string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[string]string, len(t.sysctls))
	for k, v := range t.sysctls {
		out[k] = v
	}
	return out
}

// setSysctls implements System: the names are checked as on Linux, then
// kept.
func (t *Toy) setSysctls(sysctls map[string]string, _ string) error {
	for k := range sysctls {
		if _, err := ipcSysctlPath("/proc", k); err != nil {
			return err
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.sysctls == nil {
		t.sysctls = map[string]string{}
	}
	for k, v := range sysctls {
		t.sysctls[k] = v
	}
	return nil
}

// dialPort implements System: a connection Serve answers.
func (t *Toy) dialPort(port int32) (net.Conn, error) {
	if t.Serve == nil {
		return nil, errdefs.FailedPrecondition("port-forward: nothing accepts connections on port %d in the pod", port)
	}
	mine, theirs := halfPipe()
	go t.Serve(port, theirs)
	return mine, nil
}

// Devices returns the device rules app's cgroup was given; nil when none.
func (t *Toy) Devices(app string) []specs.LinuxDeviceCgroup {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.devices[app]
}

// podCgroup and appCgroup implement System: cgroups that count and apply
// nothing; killing an app's kills its processes.
func (t *Toy) podCgroup() cgroup          { return &toyCgroup{t: t} }
func (t *Toy) appCgroup(id string) cgroup { return &toyCgroup{t: t, app: id} }

type toyCgroup struct {
	t   *Toy
	app string
}

func (c *toyCgroup) Create() error               { return nil }
func (c *toyCgroup) Set(cgroups.Resources) error { return nil }
func (c *toyCgroup) SetDevices(rules []specs.LinuxDeviceCgroup) error {
	c.t.mu.Lock()
	defer c.t.mu.Unlock()
	if c.t.devices == nil {
		c.t.devices = map[string][]specs.LinuxDeviceCgroup{}
	}
	c.t.devices[c.app] = rules
	return nil
}
func (c *toyCgroup) Add(int) error             { return nil }
func (c *toyCgroup) OOMKills() (uint64, error) { return 0, nil }
func (c *toyCgroup) Delete() error             { return nil }

func (c *toyCgroup) Stats() (*cgroups.Stats, error) {
	c.t.mu.Lock()
	defer c.t.mu.Unlock()
	n := len(c.t.procs[c.app])
	if c.app == "" {
		n = 0
		for _, ps := range c.t.procs {
			n += len(ps)
		}
	}
	return &cgroups.Stats{Pids: uint64(n)}, nil
}

func (c *toyCgroup) Kill() error {
	c.t.mu.Lock()
	ps := slices.Clone(c.t.procs[c.app])
	c.t.mu.Unlock()
	for _, p := range ps {
		p.end(c.t, syscall.WaitStatus(syscall.SIGKILL))
	}
	return nil
}

// halfPipe returns the two ends of an in-memory stream whose ends can be
// half-closed (CloseWrite), as a TCP connection's.
func halfPipe() (net.Conn, net.Conn) {
	ar, bw := io.Pipe()
	br, aw := io.Pipe()
	return &pipeConn{r: ar, w: aw}, &pipeConn{r: br, w: bw}
}

type pipeConn struct {
	r *io.PipeReader
	w *io.PipeWriter
}

func (c *pipeConn) Read(p []byte) (int, error)       { return c.r.Read(p) }
func (c *pipeConn) Write(p []byte) (int, error)      { return c.w.Write(p) }
func (c *pipeConn) CloseWrite() error                { return c.w.Close() }
func (c *pipeConn) LocalAddr() net.Addr              { return pipeAddr{} }
func (c *pipeConn) RemoteAddr() net.Addr             { return pipeAddr{} }
func (c *pipeConn) SetDeadline(time.Time) error      { return nil }
func (c *pipeConn) SetReadDeadline(time.Time) error  { return nil }
func (c *pipeConn) SetWriteDeadline(time.Time) error { return nil }

func (c *pipeConn) Close() error {
	c.w.Close()
	return c.r.Close()
}

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "pipe" }

// adopt implements System: a toy runs no real processes to adopt.
func (t *Toy) adopt(pid int) (process, <-chan syscall.WaitStatus, error) {
	return nil, nil, errdefs.FailedPrecondition("a toy system cannot adopt process %d", pid)
}

// runRestorer implements System: a toy runs no real restorer.
func (t *Toy) runRestorer(context.Context, cgroup, []string, []*os.File) (*api.ExecResult, error) {
	return nil, errdefs.FailedPrecondition("a toy system runs no restorer")
}
