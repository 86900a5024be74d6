package broker

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/devices"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

func TestContainerDevices(t *testing.T) {
	e := newEnv(t)
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	b := e.broker(t)
	ctx := context.Background()
	app := func(id string) (nodes []string, rules int, allowAll bool) {
		b.mu.Lock()
		defer b.mu.Unlock()
		a := b.ctrs[id].rec.App
		for _, n := range a.Devices {
			nodes = append(nodes, n.Path)
		}
		if len(a.DeviceCgroup) > 0 {
			allowAll = a.DeviceCgroup[0].Allow
		}
		return nodes, len(a.DeviceCgroup), allowAll
	}
	run := func(name, handler string, mutate func(*PodConfig)) string {
		cfg := podNet(name)
		cfg.RuntimeHandler = handler
		if mutate != nil {
			mutate(cfg)
		}
		id, err := b.RunPod(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	withDevice := func(name string) *ContainerConfig {
		c := ctrCfg(name)
		c.Devices = []devices.Request{{Host: "/dev/null", Container: "/dev/given", Permissions: "rw"}}
		return c
	}

	plain := run("plain", "fake", nil)
	id, err := b.CreateContainer(ctx, plain, withDevice("given"))
	if err != nil {
		t.Fatal(err)
	}
	nodes, rules, allowAll := app(id)
	if !slices.Equal(nodes, []string{"/dev/given"}) || allowAll || rules != len(devices.DefaultRules())+1 {
		t.Errorf("a container given /dev/null: nodes %v, %d rules (allow all: %v)", nodes, rules, allowAll)
	}
	if got := e.be.Pod(plain).DeviceRules(id); len(got) != rules {
		t.Errorf("the agent's cgroup got %d rules, want %d", len(got), rules)
	}
	id, err = b.CreateContainer(ctx, plain, ctrCfg("default"))
	if err != nil {
		t.Fatal(err)
	}
	if nodes, rules, allowAll := app(id); len(nodes) != 0 || allowAll || rules != len(devices.DefaultRules()) {
		t.Errorf("a default container: nodes %v, %d rules (allow all: %v)", nodes, rules, allowAll)
	}
	_, err = b.CreateContainer(ctx, plain, &ContainerConfig{Metadata: ContainerMetadata{Name: "bad"}, Image: fakeImage.RepoTags[0],
		Devices: []devices.Request{{Host: "/dev/null", Permissions: "rwx"}}})
	wantClass(t, err, errdefs.ErrInvalidArgument)

	// Privileged: every device; the host's nodes where the stage1 makes
	// privileged mean the host's, unless the handler says otherwise.
	hostDev = "/dev"
	priv := func(c *ContainerConfig) *ContainerConfig { c.Security.Privileged = true; return c }
	privPod := run("priv", "fake", func(c *PodConfig) { c.Privileged = true })
	id, err = b.CreateContainer(ctx, privPod, priv(withDevice("p")))
	if err != nil {
		t.Fatal(err)
	}
	nodes, rules, allowAll = app(id)
	if !allowAll || rules != 1 || !slices.Contains(nodes, "/dev/null") || !slices.Contains(nodes, "/dev/given") {
		t.Errorf("a privileged container: %d rules (allow all: %v), nodes %v", rules, allowAll, nodes)
	}
	noHost := run("nohost", "fake-nohost", func(c *PodConfig) { c.Privileged = true })
	id, err = b.CreateContainer(ctx, noHost, priv(withDevice("p")))
	if err != nil {
		t.Fatal(err)
	}
	if nodes, _, allowAll := app(id); !allowAll || !slices.Equal(nodes, []string{"/dev/given"}) {
		t.Errorf("privileged_without_host_devices: nodes %v (allow all: %v), want its own device only", nodes, allowAll)
	}

	// A privileged container in a VM gets the guest's nodes.
	vmPriv := run("vmpriv", "vm", func(c *PodConfig) { c.Privileged = true })
	id, err = b.CreateContainer(ctx, vmPriv, priv(ctrCfg("p")))
	if err != nil {
		t.Fatal(err)
	}
	b.mu.Lock()
	podDevices := b.ctrs[id].rec.App.PodDevices
	b.mu.Unlock()
	if !podDevices {
		t.Error("a privileged container in a VM does not get the guest's devices")
	}

	// A VM's kernel has no host device nodes; a user namespace makes none.
	vmPod := run("vm", "vm", nil)
	_, err = b.CreateContainer(ctx, vmPod, withDevice("v"))
	wantClass(t, err, errdefs.ErrInvalidArgument)
	// But a VFIO group, whose PCI devices the stage1 passes through.
	vfio := ctrCfg("vfio")
	vfio.Devices = []devices.Request{{Host: "/dev/vfio/4242", Container: "/dev/vfio/4242"}}
	_, err = b.CreateContainer(ctx, vmPod, vfio)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	if err == nil || !strings.Contains(err.Error(), "config.devices[0].host_path") || !strings.Contains(err.Error(), "VFIO group 4242") {
		t.Errorf("a VFIO group that does not exist: %v", err)
	}
	hostDev, hostSys = t.TempDir(), t.TempDir()
	t.Cleanup(func() { hostDev, hostSys = "/dev", "/sys" })
	if err := os.MkdirAll(filepath.Join(hostDev, "vfio"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(hostDev, "vfio/4242"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(hostSys, "kernel/iommu_groups/4242/devices/0000:03:00.0"), 0o755); err != nil {
		t.Fatal(err)
	}
	id, err = b.CreateContainer(ctx, vmPod, vfio)
	if err != nil {
		t.Fatal(err)
	}
	if nodes, rules, _ := app(id); len(nodes) != 0 || rules != 0 {
		t.Errorf("a VM's container given a VFIO group: nodes %v, %d rules; want none (the device is the guest's)", nodes, rules)
	}
	withCDI := ctrCfg("v")
	withCDI.CDIDevices = []string{"example.com/dev=a"}
	_, err = b.CreateContainer(ctx, vmPod, withCDI)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	withCDI.CDIDevices = nil
	withCDI.Annotations = map[string]string{"cdi.k8s.io/x": "example.com/dev=a"}
	_, err = b.CreateContainer(ctx, vmPod, withCDI)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	id, err = b.CreateContainer(ctx, vmPod, ctrCfg("v"))
	if err != nil {
		t.Fatal(err)
	}
	if _, rules, _ := app(id); rules != 0 {
		t.Errorf("a VM's container got %d device rules, want none (its guest's devices are its own)", rules)
	}
}

func TestContainerDevicesUserNS(t *testing.T) {
	e := newEnv(t)
	e.be.Caps.UserNamespaces = true
	b := e.broker(t)
	ctx := context.Background()
	m := &stage1.IDMapping{HostID: 1 << 20, Size: 1 << 16}
	cfg := podCfg("userns")
	cfg.UserNS = m
	pod, err := b.RunPod(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	c := ctrCfg("u")
	c.Security.UserNS = &stage1.IDMapping{HostID: m.HostID, Size: m.Size}
	c.Devices = []devices.Request{{Host: "/dev/null"}}
	_, err = b.CreateContainer(ctx, pod, c)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	c.Devices = nil
	id, err := b.CreateContainer(ctx, pod, c)
	if err != nil {
		t.Fatal(err)
	}
	if got := e.be.Pod(pod).DeviceRules(id); got != nil {
		t.Errorf("a user-namespaced pod's container got device rules %v: its agent cannot attach them", got)
	}
}
