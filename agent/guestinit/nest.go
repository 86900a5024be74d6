package guestinit

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/network"
)

// A pod with a user namespace of its own (hostUsers: false) has its agent
// run inside that namespace, as systemd-nspawn runs an nspawn pod's: the
// VM's init starts `stagelet agent` in new user, mount, PID and IPC
// namespaces with the pod's mapping, as PID 1 of the pod's PID namespace, in a cgroup
// delegated to the pod's root, and passes every stream the host opens from
// then on to it. The apps and every exec are that agent's children, so
// they are in the user namespace from birth: a process cannot join one
// once it has threads, as every Go process has.
//
// The boundary this adds to the VM's: the pod's root is not the guest's
// root, so an app that breaks out of its container is an unprivileged user
// of the guest kernel, which is itself behind the VM.

// nestDir holds the pod agent's socket and state: the guest's tmpfs,
// owned by the pod's root.
const nestDir = "/run/stagelet-pod"

// nestCgroup is the pod agent's cgroup beneath the VM's init's, in every
// hierarchy, delegated to the pod's root.
const nestCgroup = "userns"

// nested is the pod's agent in its user namespace.
type nested struct {
	socket   string
	pid      int
	done     chan struct{} // closed when it exited
	starting *tailBuffer   // the end of its log while starting
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = t.b[len(t.b)-t.max:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.b))
}

// startNested starts the pod's agent in a user namespace mapping 0..size-1
// to host.., and waits until it serves.
func startNested(cfg *guest.Config, log *slog.Logger) (*nested, error) {
	uid := int(cfg.UserNSHost)
	state := filepath.Join(nestDir, "state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		return nil, err
	}
	for _, d := range []string{nestDir, state} {
		if err := os.Chown(d, uid, uid); err != nil {
			return nil, err
		}
	}
	// The pod's root is not the guest's, and the network namespace is
	// the guest's: without this it could not bind a port below 1024, as a
	// pod's root can (the broker sets the same on an nspawn pod's),
	// unless the pod set it.
	if _, set := cfg.Sysctls[network.UnprivilegedPortStart]; !set {
		if err := network.SetSysctls(map[string]string{network.UnprivilegedPortStart: "0"}); err != nil {
			return nil, fmt.Errorf("unprivileged ports: %w", err)
		}
	}
	self, err := cgroups.Self()
	if err != nil {
		return nil, fmt.Errorf("the pod agent's cgroup: %w", err)
	}
	cg := self.Child(nestCgroup)
	if err := cg.Create(); err != nil {
		return nil, err
	}
	if err := cg.Chown(uid, uid); err != nil {
		return nil, err
	}
	n := &nested{socket: filepath.Join(nestDir, "agent.sock"), done: make(chan struct{})}
	args := []string{"agent", "--socket", n.socket, "--state-dir", state, "--log-level", cfg.LogLevel.String()}
	cmd := exec.Command("/proc/self/exe", args...)
	// Its log goes to the console; what it says while starting also to
	// the error, should it fail.
	n.starting = &tailBuffer{max: 1024}
	cmd.Stdout, cmd.Stderr = os.Stderr, io.MultiWriter(os.Stderr, n.starting)
	idmap := []syscall.SysProcIDMap{{ContainerID: 0, HostID: uid, Size: int(cfg.UserNSSize)}}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// An IPC namespace of the pod's root, so that the pod's IPC
		// sysctls, which its agent applies, are its own to set.
		Cloneflags:  syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS | syscall.CLONE_NEWPID | syscall.CLONE_NEWIPC,
		UidMappings: idmap,
		GidMappings: idmap,
		// The maps are written before it runs; setgroups stays allowed,
		// as apps set their supplementary groups.
		GidMappingsEnableSetgroups: true,
		// The pod's root: the guest's root, which the mapping leaves
		// out, would keep no capability in the namespace past exec.
		Credential: &syscall.Credential{Uid: 0, Gid: 0},
	}
	if err := cg.Start(cmd); err != nil {
		return nil, fmt.Errorf("start the pod agent in its user namespace: %w", err)
	}
	n.pid = cmd.Process.Pid
	// The VM's init reaps every child (its supervisor's reaper): the
	// pod agent's exit is watched through a pidfd instead of Wait.
	pidfd, err := unix.PidfdOpen(n.pid, 0)
	if err != nil {
		cmd.Process.Kill()
		return nil, fmt.Errorf("watch the pod agent: %w", err)
	}
	go func() {
		defer unix.Close(pidfd)
		fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		for {
			if _, err := unix.Poll(fds, -1); err == nil || !errors.Is(err, unix.EINTR) {
				break
			}
		}
		close(n.done)
	}()
	if err := n.waitServing(30 * time.Second); err != nil {
		cmd.Process.Kill()
		return nil, err
	}
	log.Info("pod agent serving in its user namespace", "pid", n.pid, "uidmap", fmt.Sprintf("0:%d:%d", uid, cfg.UserNSSize))
	return n, nil
}

// waitServing waits until the pod agent accepts connections on its socket.
func (n *nested) waitServing(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for delay := time.Millisecond; ; delay = min(2*delay, 50*time.Millisecond) {
		c, err := net.Dial("unix", n.socket)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-n.done:
			return fmt.Errorf("the pod agent exited while starting: %s", n.starting)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the pod agent did not serve within %s: %w", timeout, err)
		}
		time.Sleep(delay) // polling a socket the agent creates
	}
}

// proxy joins the host's stream c to a new connection to the pod agent,
// byte for byte both ways, and closes both when either side is done.
func (n *nested) proxy(c net.Conn, log *slog.Logger) {
	defer c.Close()
	a, err := net.Dial("unix", n.socket)
	if err != nil {
		log.Warn("a host stream for the pod agent", "err", err)
		return
	}
	defer a.Close()
	done := make(chan struct{}, 2)
	go func() {
		io.Copy(a, c)
		done <- struct{}{}
	}()
	go func() {
		io.Copy(c, a)
		done <- struct{}{}
	}()
	<-done
}

// routingListener hands the supervisor of the VM's init the streams the
// host opens until a pod agent is set, and that agent every one after.
type routingListener struct {
	net.Listener
	log    *slog.Logger
	nested atomic.Pointer[nested]
}

func (l *routingListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		n := l.nested.Load()
		if n == nil {
			return c, nil
		}
		go n.proxy(c, l.log)
	}
}

// nest starts the pod's agent in its user namespace (cfg.UserNSSize > 0)
// and routes the listener's streams to it from then on; when it exits,
// the VM's init stops serving (and powers off). Without a mapping it does
// nothing.
func (l *routingListener) nest(cfg *guest.Config, stop func()) error {
	if cfg.UserNSSize == 0 {
		return nil
	}
	if l.nested.Load() != nil {
		return errors.New("the pod agent already runs")
	}
	n, err := startNested(cfg, l.log)
	if err != nil {
		return err
	}
	l.nested.Store(n)
	go func() {
		<-n.done
		l.log.Info("pod agent exited: shutting down")
		stop()
	}()
	return nil
}
