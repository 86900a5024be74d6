package broker

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/lsm"
)

func TestResolveSecurity(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "deny-mkdir.json")
	os.WriteFile(good, []byte(`{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_ERRNO"}]}`), 0o644)
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(`{"defaultAction": "SCMP_ACT_SOMETIMES"}`), 0o644)

	defer func(e func() bool, l func(string) bool) { appArmorEnabled, appArmorLoaded = e, l }(appArmorEnabled, appArmorLoaded)
	appArmorLoaded = func(name string) bool { return name == lsm.DefaultAppArmorName || name == "mine" }

	tests := []struct {
		name     string
		sec      Security
		caps     []string
		appArmor bool
		guest    bool
		err      error
		seccomp  string // SeccompProfile; "" for none
		app      string
	}{
		{name: "nothing asked: unconfined", sec: Security{}},
		{name: "unconfined", sec: Security{Seccomp: SecurityProfile{Type: ProfileUnconfined}}},
		{name: "runtime default", sec: Security{Seccomp: SecurityProfile{Type: ProfileRuntimeDefault}}, seccomp: "runtime/default"},
		{name: "privileged: no filter", sec: Security{Privileged: true, Seccomp: SecurityProfile{Type: ProfileRuntimeDefault}}},
		{name: "localhost", sec: Security{Seccomp: SecurityProfile{Type: ProfileLocalhost, LocalhostRef: good}}, seccomp: "localhost/" + good},
		{name: "localhost relative", sec: Security{Seccomp: SecurityProfile{Type: ProfileLocalhost, LocalhostRef: "deny-mkdir.json"}}, err: errdefs.ErrInvalidArgument},
		{name: "localhost missing", sec: Security{Seccomp: SecurityProfile{Type: ProfileLocalhost, LocalhostRef: filepath.Join(dir, "nope.json")}}, err: errdefs.ErrInvalidArgument},
		{name: "localhost invalid", sec: Security{Seccomp: SecurityProfile{Type: ProfileLocalhost, LocalhostRef: bad}}, err: errdefs.ErrInvalidArgument},
		{name: "unknown seccomp type", sec: Security{Seccomp: SecurityProfile{Type: "Sometimes"}}, err: errdefs.ErrInvalidArgument},
		{name: "apparmor unconfined without apparmor", sec: Security{AppArmor: SecurityProfile{Type: ProfileUnconfined}}},
		{name: "apparmor default without apparmor", sec: Security{AppArmor: SecurityProfile{Type: ProfileRuntimeDefault}}, err: errdefs.ErrFailedPrecondition},
		{name: "apparmor localhost without apparmor", sec: Security{AppArmor: SecurityProfile{Type: ProfileLocalhost, LocalhostRef: "mine"}}, err: errdefs.ErrFailedPrecondition},
		{name: "apparmor default", sec: Security{AppArmor: SecurityProfile{Type: ProfileRuntimeDefault}}, appArmor: true, app: lsm.DefaultAppArmorName},
		{name: "apparmor localhost", sec: Security{AppArmor: SecurityProfile{Type: ProfileLocalhost, LocalhostRef: "localhost/mine"}}, appArmor: true, app: "mine"},
		{name: "apparmor not loaded", sec: Security{AppArmor: SecurityProfile{Type: ProfileLocalhost, LocalhostRef: "other"}}, appArmor: true, err: errdefs.ErrInvalidArgument},
		{name: "apparmor unspecified", sec: Security{}, appArmor: true, app: lsm.DefaultAppArmorName},
		{name: "apparmor unspecified privileged", sec: Security{Privileged: true}, appArmor: true},
		{name: "apparmor unspecified disabled", sec: Security{}},
		{name: "apparmor unspecified in a VM", sec: Security{}, appArmor: true, guest: true},
		{name: "apparmor unconfined", sec: Security{AppArmor: SecurityProfile{Type: ProfileUnconfined}}, appArmor: true},
		{name: "apparmor privileged default", sec: Security{Privileged: true, AppArmor: SecurityProfile{Type: ProfileRuntimeDefault}}, appArmor: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			appArmorEnabled = func() bool { return tc.appArmor }
			got, err := resolveSecurity(&tc.sec, tc.caps, lsm.Labels{}, tc.guest)
			if tc.err != nil {
				if !errors.Is(err, tc.err) {
					t.Fatalf("got %v, want class %v", err, tc.err)
				}
				t.Log(err)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.seccompProfile != tc.seccomp || (got.seccomp != nil) != (tc.seccomp != "") {
				t.Errorf("seccomp %q (%v), want %q", got.seccompProfile, got.seccomp != nil, tc.seccomp)
			}
			if got.appArmor != tc.app {
				t.Errorf("apparmor %q, want %q", got.appArmor, tc.app)
			}
		})
	}
}

func TestAppArmorMessage(t *testing.T) {
	defer func(e func() bool) { appArmorEnabled = e }(appArmorEnabled)
	appArmorEnabled = func() bool { return false }
	_, err := resolveSecurity(&Security{AppArmor: SecurityProfile{Type: ProfileLocalhost, LocalhostRef: "k8s-nginx"}}, nil, lsm.Labels{}, false)
	want := "AppArmor profile localhost/k8s-nginx requested, but AppArmor is not enabled on this node"
	if err == nil || err.Error() != want {
		t.Errorf("got %v, want %q", err, want)
	}
}

func TestSELinuxLabels(t *testing.T) {
	if lsm.SELinuxEnabled() {
		t.Skip("SELinux is enabled: the policy decides the labels")
	}
	for _, tc := range []struct {
		opts          *SELinuxOptions
		priv          bool
		process, moun string
	}{
		{nil, false, "", ""},
		{&SELinuxOptions{}, false, lsm.DefaultSELinuxProcessLabel, lsm.DefaultSELinuxMountLabel},
		{&SELinuxOptions{Level: "s0:c1,c2"}, false, "system_u:system_r:container_t:s0:c1,c2", "system_u:object_r:container_file_t:s0:c1,c2"},
		{&SELinuxOptions{User: "u", Role: "r", Type: "spc_t", Level: "s0"}, false, "u:r:spc_t:s0", "u:object_r:container_file_t:s0"},
		{&SELinuxOptions{Level: "s0:c1"}, true, "", ""},
	} {
		got, err := resolveSecurity(&Security{SELinux: tc.opts, Privileged: tc.priv}, nil, lsm.Labels{}, false)
		if err != nil {
			t.Fatal(err)
		}
		if got.seLinuxProcess != tc.process || got.seLinuxMount != tc.moun {
			t.Errorf("%+v: got %q %q, want %q %q", tc.opts, got.seLinuxProcess, got.seLinuxMount, tc.process, tc.moun)
		}
	}
	if _, err := resolveSecurity(&Security{SELinux: &SELinuxOptions{Type: "a:b"}}, nil, lsm.Labels{}, false); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("type with ':': %v", err)
	}
}

// TestGuestContainerSELinux: a VM's container has its pod's labels,
// whatever it asks for or however privileged (its qemu, at the pod's
// level, serves its files); bad options are still refused.
func TestGuestContainerSELinux(t *testing.T) {
	pod := lsm.Labels{Process: "system_u:system_r:container_t:s0:c1,c2", Mount: "system_u:object_r:container_file_t:s0:c1,c2"}
	for _, sec := range []Security{
		{},
		{SELinux: &SELinuxOptions{Level: "s0:c7,c8"}},
		{SELinux: &SELinuxOptions{Type: "spc_t"}, Privileged: true},
		{Privileged: true},
	} {
		got, err := resolveSecurity(&sec, nil, pod, true)
		if err != nil {
			t.Fatal(err)
		}
		if got.seLinuxProcess != pod.Process || got.seLinuxMount != pod.Mount {
			t.Errorf("%+v in a VM: got %q %q, want the pod's", sec, got.seLinuxProcess, got.seLinuxMount)
		}
	}
	if _, err := resolveSecurity(&Security{SELinux: &SELinuxOptions{Type: "a:b"}}, nil, pod, true); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("type with ':' in a VM: %v", err)
	}
}

// The container record carries what was resolved, for the agent and for
// status.
func TestContainerSecurityRecorded(t *testing.T) {
	b := newEnv(t).broker(t)
	ctx := context.Background()
	pid, _ := b.RunPod(ctx, podCfg("sec"))
	c := ctrCfg("c")
	c.Security.Seccomp = SecurityProfile{Type: ProfileRuntimeDefault}
	c.Security.SELinux = &SELinuxOptions{Level: "s0:c7,c8"}
	id, err := b.CreateContainer(ctx, pid, c)
	if err != nil {
		t.Fatal(err)
	}
	rec, _ := b.ContainerStatus(ctx, id)
	if rec.App.Seccomp == nil || rec.App.SeccompProfile != "runtime/default" {
		t.Errorf("seccomp not recorded: %q", rec.App.SeccompProfile)
	}
	if rec.App.SELinuxProcessLabel == "" || rec.App.SELinuxMountLabel == "" {
		t.Errorf("SELinux labels not recorded: %q %q", rec.App.SELinuxProcessLabel, rec.App.SELinuxMountLabel)
	}
	if rec.Config.Security.Seccomp.Type != ProfileRuntimeDefault {
		t.Errorf("config not recorded: %+v", rec.Config.Security)
	}
	c2 := ctrCfg("c2")
	c2.Security.Seccomp = SecurityProfile{Type: ProfileLocalhost, LocalhostRef: "relative.json"}
	if _, err := b.CreateContainer(ctx, pid, c2); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("relative localhost profile: %v", err)
	}
}

// A pod's SELinux labels are computed once, at RunPodSandbox, recorded
// with it (so a restarted daemon has them), shown in its verbose status,
// and its containers run at its level unless they give their own. Where
// SELinux is disabled only a pod that gives options has labels.
func TestPodSELinuxLabels(t *testing.T) {
	if lsm.SELinuxEnabled() {
		t.Skip("SELinux is enabled: the policy decides the labels")
	}
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	cfg := podCfg("mcs")
	cfg.SELinux = &SELinuxOptions{Level: "s0:c10,c20"}
	pid, err := b.RunPod(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	want := lsm.Labels{Process: "system_u:system_r:container_t:s0:c10,c20", Mount: "system_u:object_r:container_file_t:s0:c10,c20"}
	st, err := b.PodStatus(ctx, pid, true)
	if err != nil {
		t.Fatal(err)
	}
	if st.Record.SELinux != want || st.Info["selinuxProcessLabel"] != want.Process || st.Info["selinuxMountLabel"] != want.Mount {
		t.Errorf("pod labels %+v, info %q %q", st.Record.SELinux, st.Info["selinuxProcessLabel"], st.Info["selinuxMountLabel"])
	}
	// Not for the backend: nothing applies them where SELinux is off (an
	// nspawn pod given them failed to start).
	if spec := b.podSpec(&st.Record); spec.SELinuxProcessLabel != "" || spec.SELinuxMountLabel != "" {
		t.Errorf("the backend is given labels %q %q where SELinux is off", spec.SELinuxProcessLabel, spec.SELinuxMountLabel)
	}
	plain, err := b.CreateContainer(ctx, pid, ctrCfg("plain"))
	if err != nil {
		t.Fatal(err)
	}
	typed := ctrCfg("typed")
	typed.Security.SELinux = &SELinuxOptions{Type: "spc_t"}
	tid, err := b.CreateContainer(ctx, pid, typed)
	if err != nil {
		t.Fatal(err)
	}
	for id, wantP := range map[string]string{plain: want.Process, tid: "system_u:system_r:spc_t:s0:c10,c20"} {
		rec, _ := b.ContainerStatus(ctx, id)
		if rec.App.SELinuxProcessLabel != wantP || rec.App.SELinuxMountLabel != want.Mount {
			t.Errorf("container %s: %q %q, want %q %q", id, rec.App.SELinuxProcessLabel, rec.App.SELinuxMountLabel, wantP, want.Mount)
		}
	}

	bad := podCfg("bad")
	bad.SELinux = &SELinuxOptions{Type: "a b"}
	if _, err := b.RunPod(ctx, bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a type with a blank: %v", err)
	}
	none, err := b.RunPod(ctx, podCfg("none"))
	if err != nil {
		t.Fatal(err)
	}
	if st, _ := b.PodStatus(ctx, none, true); st.Record.SELinux != (lsm.Labels{}) || st.Info["selinuxProcessLabel"] != "" {
		t.Errorf("a pod without options got %+v", st.Record.SELinux)
	}

	b.Close()
	b2 := e.broker(t)
	if st, err := b2.PodStatus(ctx, pid, false); err != nil || st.Record.SELinux != want {
		t.Errorf("after a restart: %+v %v", st, err)
	}
}

// levels counts the SELinux levels a broker's pods took and gave back.
// The first allocation says it started and waits until proceed closes.
type levels struct {
	mu               sync.Mutex
	taken, given     int
	started, proceed chan struct{}
}

func (l *levels) install(b *Broker) {
	b.podLabels = func(*PodConfig) (lsm.Labels, error) {
		l.mu.Lock()
		l.taken++
		started, proceed := l.started, l.proceed
		l.started = nil // the first one only
		l.mu.Unlock()
		if started != nil {
			started <- struct{}{}
			<-proceed
		}
		return lsm.Labels{Process: "p", Mount: "m"}, nil
	}
	b.releaseLabels = func(lsm.Labels) {
		l.mu.Lock()
		l.given++
		l.mu.Unlock()
	}
}

func (l *levels) counts() (taken, given int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.taken, l.given
}

// A pod's SELinux level is allocated without the broker's lock: List and
// Status answer while an allocation waits on selinuxfs. Every level taken
// is given back on each way a RunPod can fail or lose its name, and at
// the pod's removal.
func TestSELinuxAllocationOutsideTheLock(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	started, proceed := make(chan struct{}), make(chan struct{})
	l := &levels{started: started, proceed: proceed}
	l.install(b)
	ctx := context.Background()

	type result struct {
		id  string
		err error
	}
	first := make(chan result, 1)
	go func() {
		id, err := b.RunPod(ctx, podCfg("held"))
		first <- result{id, err}
	}()
	<-started // the allocation is under way, and waits
	listed := make(chan int, 1)
	go func() { listed <- len(b.ListPods(PodFilter{})) }()
	select {
	case n := <-listed:
		if n != 0 {
			t.Errorf("listed %d pods while the first one's level is allocated", n)
		}
	case <-time.After(10 * time.Second):
		close(proceed)
		t.Fatal("ListPods waited on a pod's SELinux allocation")
	}
	// A second call of the same pod allocates too (the name is not
	// reserved yet), reserves it first, and the first call's level is
	// given back when it finds the name taken: both answer one pod.
	second, err := b.RunPod(ctx, podCfg("held"))
	if err != nil {
		t.Fatal(err)
	}
	close(proceed)
	r := <-first
	if r.err != nil || r.id != second {
		t.Fatalf("first call: %q, %v; want the second's pod %q", r.id, r.err, second)
	}
	if taken, given := l.counts(); taken != 2 || given != 1 {
		t.Errorf("levels taken %d, given back %d; want 2 and 1 (the loser's)", taken, given)
	}

	// A retry with the pod reserved, another configuration under its
	// name, and a refusal by the policy take no level.
	if _, err := b.RunPod(ctx, podCfg("held")); err != nil {
		t.Fatal(err)
	}
	other := podCfg("held")
	other.Labels = map[string]string{"changed": "yes"}
	_, err = b.RunPod(ctx, other)
	wantClass(t, err, errdefs.ErrAlreadyExists)
	refused := podCfg("refused")
	refused.Metadata.Namespace, refused.Privileged = "locked", true
	_, err = b.RunPod(ctx, refused)
	wantClass(t, err, errdefs.ErrPermissionDenied)
	if taken, given := l.counts(); taken != 2 || given != 1 {
		t.Errorf("levels taken %d, given back %d after retries and refusals; want 2 and 1", taken, given)
	}

	// A failed start gives its level back; so does a removal.
	e.be.FailStart(true)
	_, err = b.RunPod(ctx, podCfg("fails"))
	if err == nil {
		t.Fatal("the start did not fail")
	}
	e.be.FailStart(false)
	if err := b.StopPod(ctx, second); err != nil {
		t.Fatal(err)
	}
	if err := b.RemovePod(ctx, second); err != nil {
		t.Fatal(err)
	}
	if taken, given := l.counts(); taken != given {
		t.Errorf("levels taken %d, given back %d: each must be given back", taken, given)
	}
}
