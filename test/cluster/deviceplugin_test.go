package cluster

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// examplePlugin is a device plugin (the kubelet's deviceplugin v1beta1
// API) advertising a few devices of resource example.com/dev, each backed
// by one of the node's character devices. Allocate answers with device
// specs, or, once cdi is set, with the devices' CDI names.
type examplePlugin struct {
	pluginapi.UnimplementedDevicePluginServer
	// devices maps a device ID to the node path backing it.
	devices map[string]string

	mu        sync.Mutex
	cdi       bool
	allocated []string // the IDs Allocate gave out
}

const (
	exampleResource = "example.com/dev"
	exampleSocket   = "example.sock"
)

func (p *examplePlugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *examplePlugin) ListAndWatch(_ *pluginapi.Empty, s pluginapi.DevicePlugin_ListAndWatchServer) error {
	var devs []*pluginapi.Device
	for id := range p.devices {
		devs = append(devs, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
	}
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: devs}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

func (p *examplePlugin) Allocate(_ context.Context, r *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	resp := &pluginapi.AllocateResponse{}
	for _, cr := range r.ContainerRequests {
		car := &pluginapi.ContainerAllocateResponse{}
		for i, id := range cr.DevicesIds {
			host, ok := p.devices[id]
			if !ok {
				return nil, fmt.Errorf("no device %q", id)
			}
			p.allocated = append(p.allocated, id)
			if p.cdi {
				car.CdiDevices = append(car.CdiDevices, &pluginapi.CDIDevice{Name: exampleResource + "=" + id})
				continue
			}
			car.Devices = append(car.Devices, &pluginapi.DeviceSpec{HostPath: host, ContainerPath: fmt.Sprintf("/dev/example%d", i), Permissions: "rw"})
		}
		resp.ContainerResponses = append(resp.ContainerResponses, car)
	}
	return resp, nil
}

// cdiSpec is the CDI spec of the plugin's devices, for the node's
// /etc/cdi: each device's node at /dev/example0, as the specs path.
func (p *examplePlugin) cdiSpec() string {
	var devs []string
	for id, host := range p.devices {
		devs = append(devs, fmt.Sprintf(`{"name": %q, "containerEdits": {"deviceNodes": [{"path": "/dev/example0", "hostPath": %q, "permissions": "rw"}], "env": ["EXAMPLE_DEVICE=%s"]}}`, id, host, id))
	}
	return fmt.Sprintf(`{"cdiVersion": "0.7.0", "kind": %q, "devices": [%s]}`, exampleResource, strings.Join(devs, ", "))
}

// startDevicePlugin serves p beside node n's kubelet (its device-plugins
// directory is a directory of the test's, bound into the node) and
// registers it with the kubelet.
func (c *cluster) startDevicePlugin(t *testing.T, n *node, p *examplePlugin) {
	t.Helper()
	dir := filepath.Join(n.dir, "var-lib-kubelet", "device-plugins")
	sock := filepath.Join(dir, exampleSocket)
	os.Remove(sock)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go srv.Serve(l)
	t.Cleanup(func() {
		srv.Stop()
		os.Remove(sock)
	})
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: exampleSocket, ResourceName: exampleResource,
	}); err != nil {
		t.Fatalf("register the device plugin with %s's kubelet: %v", n.name, err)
	}
}

// devicePod is a pod asking for one example.com/dev on a given node.
const devicePod = `
apiVersion: v1
kind: Pod
metadata: {name: {{.Name}}}
spec:
  nodeName: {{.Node}}
  containers:
  - name: app
    image: {{.Busybox}}
    command: [sh, -c, "exec sleep 3600"]
    resources:
      limits: {example.com/dev: 1}
`

// testDevicePlugin: a real kubelet hands a device plugin's device to a pod
// through stagelet, first as a device spec (CRI devices), then as a CDI
// name (CRI CDI_devices) that the node's CDI spec resolves.
func (c *cluster) testDevicePlugin(t *testing.T) {
	n := c.nodes[0]
	// The node's character devices: numbers the pods can check.
	p := &examplePlugin{devices: map[string]string{"zero": "/dev/zero", "full": "/dev/full", "null": "/dev/null"}}
	numbers := map[string]string{"zero": "1:5", "full": "1:7", "null": "1:3"}
	c.startDevicePlugin(t, n, p)
	c.wait(t, 2*time.Minute, "the node offers example.com/dev", func() (bool, error) {
		out, err := c.kubectlErr("get", "node", n.name, "-o", `jsonpath={.status.allocatable.example\.com/dev}`)
		return strings.TrimSpace(out) == "3", err
	})
	check := func(name string, cdi bool) {
		p.mu.Lock()
		p.cdi = cdi
		before := len(p.allocated)
		p.mu.Unlock()
		c.apply(t, devicePod, "Name", name, "Node", n.name)
		c.wait(t, 3*time.Minute, name+" running", func() (bool, error) {
			pod, err := c.pod(name)
			return err == nil && pod.Status.Phase == "Running", err
		})
		p.mu.Lock()
		got := p.allocated[before:]
		p.mu.Unlock()
		if len(got) != 1 {
			t.Fatalf("%s: the plugin allocated %v, want one device", name, got)
		}
		id := got[0]
		stat := strings.TrimSpace(c.kubectl(t, "exec", name, "--", "stat", "-c", "%t:%T", "/dev/example0"))
		if stat != numbers[id] {
			t.Errorf("%s: /dev/example0 is %s, want device %s's %s", name, stat, id, numbers[id])
		}
		c.kubectl(t, "exec", name, "--", "head", "-c", "1", "/dev/example0")
		if cdi {
			if env := strings.TrimSpace(c.kubectl(t, "exec", name, "--", "sh", "-c", "echo $EXAMPLE_DEVICE")); env != id {
				t.Errorf("%s: EXAMPLE_DEVICE=%q from the CDI spec, want %s", name, env, id)
			}
		}
	}
	check("device-spec", false)
	spec := p.cdiSpec()
	c.nodeExec(t, n, "sh", "-c", "mkdir -p /etc/cdi && cat > /etc/cdi/example.json <<'EOF'\n"+spec+"\nEOF")
	check("device-cdi", true)
}
