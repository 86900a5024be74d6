// Command podnet is the pod network of stagelet's cluster test (make
// test-cluster). A DaemonSet runs it on every node, in the node's network
// namespace (hostNetwork, on the fly stage1), as flannel's host-gw backend
// works: it installs the CNI plugins its image carries and a bridge
// configuration for its node's podCIDR (which the controller manager
// allocates), routes every other node's podCIDR through that node's
// InternalIP, and masquerades pod traffic that leaves the cluster network.
// Until it has written the configuration the node's runtime reports the
// network as not ready, so the node is NotReady and only host-network pods
// (this one among them) run there.
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
)

// routeProtocol marks the routes podnet adds, so it removes only its own.
const routeProtocol netlink.RouteProtocol = 0x70

const saDir = "/var/run/secrets/kubernetes.io/serviceaccount"

type options struct {
	apiserver   string
	node        string
	clusterCIDR *net.IPNet
	plugins     string
	cniBin      string
	cniConf     string
	bridge      string
	interval    time.Duration
}

func main() {
	var o options
	var cidr string
	flag.StringVar(&o.apiserver, "apiserver", "", "API server URL (default: the in-cluster service)")
	flag.StringVar(&o.node, "node", os.Getenv("NODE_NAME"), "this node's name")
	flag.StringVar(&cidr, "cluster-cidr", "10.244.0.0/16", "the pod network of the whole cluster")
	flag.StringVar(&o.plugins, "plugins", "/opt/podnet/plugins", "CNI plugins to install")
	flag.StringVar(&o.cniBin, "cni-bin-dir", "/host/opt/cni/bin", "where the node's runtime looks for CNI plugins")
	flag.StringVar(&o.cniConf, "cni-conf-dir", "/host/etc/cni/net.d", "the node's CNI configuration directory")
	flag.StringVar(&o.bridge, "bridge", "podnet0", "the pods' bridge on each node")
	flag.DurationVar(&o.interval, "interval", 5*time.Second, "how often the nodes are read")
	flag.Parse()
	var err error
	if _, o.clusterCIDR, err = net.ParseCIDR(cidr); err != nil {
		fatal("cluster CIDR", err)
	}
	if o.node == "" {
		fatal("node", errors.New("no node name: set -node or NODE_NAME"))
	}
	if o.apiserver == "" {
		o.apiserver = "https://" + net.JoinHostPort(os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"))
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := installPlugins(o.plugins, o.cniBin); err != nil {
		fatal("install plugins", err)
	}
	api, err := newClient(o.apiserver)
	if err != nil {
		fatal("API client", err)
	}
	for {
		if err := sync(ctx, api, &o); err != nil {
			slog.Warn("sync", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(o.interval):
		}
	}
}

func fatal(what string, err error) {
	slog.Error(what, "err", err)
	os.Exit(1)
}

// installPlugins copies every plugin of src into dst, each through a
// temporary file and a rename, so a runtime never runs a half-written one.
func installPlugins(src, dst string) error {
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	for _, e := range ents {
		data, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			return err
		}
		if err := writeAtomic(filepath.Join(dst, e.Name()), data, 0o755); err != nil {
			return err
		}
	}
	slog.Info("installed CNI plugins", "dir", dst, "count", len(ents))
	return nil
}

func writeAtomic(path string, data []byte, mode os.FileMode) error {
	tmp := path + ".podnet-tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

type client struct {
	base  string
	http  *http.Client
	token string
}

func newClient(base string) (*client, error) {
	token, err := os.ReadFile(filepath.Join(saDir, "token"))
	if err != nil {
		return nil, err
	}
	ca, err := os.ReadFile(filepath.Join(saDir, "ca.crt"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, errors.New("no certificate in " + filepath.Join(saDir, "ca.crt"))
	}
	return &client{
		base:  strings.TrimSuffix(base, "/"),
		token: strings.TrimSpace(string(token)),
		http: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
			TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
		}},
	}, nil
}

type nodeList struct {
	Items []struct {
		Metadata struct {
			Name string `json:"name"`
		} `json:"metadata"`
		Spec struct {
			PodCIDR string `json:"podCIDR"`
		} `json:"spec"`
		Status struct {
			Addresses []struct {
				Type    string `json:"type"`
				Address string `json:"address"`
			} `json:"addresses"`
		} `json:"status"`
	} `json:"items"`
}

func (c *client) nodes(ctx context.Context) (*nodeList, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/api/v1/nodes", nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return nil, fmt.Errorf("GET /api/v1/nodes: %s: %s", resp.Status, b)
	}
	var l nodeList
	return &l, json.NewDecoder(resp.Body).Decode(&l)
}

// sync makes the node's configuration, routes and masquerading match the
// cluster's nodes.
func sync(ctx context.Context, api *client, o *options) error {
	l, err := api.nodes(ctx)
	if err != nil {
		return err
	}
	want := map[string]net.IP{} // podCIDR → gateway, for the other nodes
	var own string
	for _, n := range l.Items {
		if n.Metadata.Name == o.node {
			own = n.Spec.PodCIDR
			continue
		}
		if n.Spec.PodCIDR == "" {
			continue
		}
		for _, a := range n.Status.Addresses {
			if a.Type == "InternalIP" {
				if ip := net.ParseIP(a.Address); ip != nil && ip.To4() != nil {
					want[n.Spec.PodCIDR] = ip
				}
			}
		}
	}
	if own == "" {
		return fmt.Errorf("node %s has no podCIDR yet", o.node)
	}
	if err := writeConfig(o, own); err != nil {
		return err
	}
	if err := syncRoutes(want); err != nil {
		return err
	}
	return masquerade(o.clusterCIDR.String())
}

// writeConfig writes the node's bridge configuration when it differs from
// what is there.
func writeConfig(o *options, podCIDR string) error {
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       "podnet",
		"plugins": []any{
			map[string]any{
				"type":        "bridge",
				"bridge":      o.bridge,
				"isGateway":   true,
				"ipMasq":      false,
				"hairpinMode": true,
				"ipam": map[string]any{
					"type":   "host-local",
					"ranges": [][]map[string]string{{{"subnet": podCIDR}}},
					"routes": []map[string]string{{"dst": "0.0.0.0/0"}},
				},
			},
			map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}},
		},
	}
	data, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return err
	}
	path := filepath.Join(o.cniConf, "10-podnet.conflist")
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, data) {
		return nil
	}
	if err := os.MkdirAll(o.cniConf, 0o755); err != nil {
		return err
	}
	if err := writeAtomic(path, data, 0o644); err != nil {
		return err
	}
	slog.Info("wrote the CNI configuration", "path", path, "podCIDR", podCIDR)
	return nil
}

// syncRoutes routes each other node's podCIDR through that node and
// removes the routes of nodes that are gone.
func syncRoutes(want map[string]net.IP) error {
	have, err := netlink.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Protocol: routeProtocol}, netlink.RT_FILTER_PROTOCOL)
	if err != nil {
		return err
	}
	for _, r := range have {
		if r.Dst == nil {
			continue
		}
		if gw, ok := want[r.Dst.String()]; ok && gw.Equal(r.Gw) {
			delete(want, r.Dst.String())
			continue
		}
		if err := netlink.RouteDel(&r); err != nil {
			return fmt.Errorf("remove route %s: %w", r.Dst, err)
		}
		slog.Info("removed route", "dst", r.Dst)
	}
	for cidr, gw := range want {
		_, dst, err := net.ParseCIDR(cidr)
		if err != nil {
			return err
		}
		if err := netlink.RouteReplace(&netlink.Route{Dst: dst, Gw: gw, Protocol: routeProtocol}); err != nil {
			return fmt.Errorf("route %s via %s: %w", cidr, gw, err)
		}
		slog.Info("added route", "dst", cidr, "via", gw)
	}
	return nil
}

// masquerade makes pod traffic that leaves the cluster network (to the
// nodes' own network, where the API server is) appear to come from the
// node, as flannel's ip-masq does.
func masquerade(clusterCIDR string) error {
	rule := []string{"POSTROUTING", "-s", clusterCIDR, "!", "-d", clusterCIDR,
		"-m", "comment", "--comment", "podnet: masquerade pod traffic leaving the cluster network", "-j", "MASQUERADE"}
	check := append([]string{"-w", "-t", "nat", "-C"}, rule...)
	if exec.Command("iptables", check...).Run() == nil {
		return nil
	}
	add := append([]string{"-w", "-t", "nat", "-A"}, rule...)
	if out, err := exec.Command("iptables", add...).CombinedOutput(); err != nil {
		return fmt.Errorf("iptables %s: %v: %s", strings.Join(add, " "), err, out)
	}
	slog.Info("masquerading pod traffic leaving the cluster network", "cidr", clusterCIDR)
	return nil
}
