package network

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/containernetworking/cni/libcni"

	"github.com/stagelet/stagelet/errdefs"
)

// Defaults of the configuration InstallDefaultConflist writes.
const (
	DefaultNetworkName = "stagelet"
	DefaultBridge      = "stagelet0"
	DefaultSubnet      = "10.88.0.0/16"
	// DefaultConflistFile is the file InstallDefaultConflist writes in the
	// conf dir.
	DefaultConflistFile = "10-stagelet.conflist"
)

// DefaultConflist returns the node's default CNI configuration: network
// "stagelet", a bridge "stagelet0" that is the pods' gateway and masquerades
// their traffic (hairpin on, so a pod reaches itself through its own host
// port), host-local addresses from subnet (DefaultSubnet when empty) and
// portmap for hostPorts. Loopback needs no plugin: Setup brings lo up.
// Errors: ErrInvalidArgument when subnet is not a CIDR prefix.
func DefaultConflist(subnet string) ([]byte, error) {
	if subnet == "" {
		subnet = DefaultSubnet
	}
	pfx, err := netip.ParsePrefix(subnet)
	if err != nil {
		return nil, errdefs.InvalidArgument("CNI subnet %q: %w", subnet, err)
	}
	pfx = pfx.Masked()
	if (pfx.Addr().Is4() && pfx.Bits() > 30) || (pfx.Addr().Is6() && pfx.Bits() > 126) {
		return nil, errdefs.InvalidArgument("CNI subnet %q is too small for pods", subnet)
	}
	defRoute := "0.0.0.0/0"
	if pfx.Addr().Is6() {
		defRoute = "::/0"
	}
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       DefaultNetworkName,
		"plugins": []any{
			map[string]any{
				"type":        "bridge",
				"bridge":      DefaultBridge,
				"isGateway":   true,
				"ipMasq":      true,
				"hairpinMode": true,
				"ipam": map[string]any{
					"type":   "host-local",
					"ranges": [][]map[string]string{{{"subnet": pfx.String()}}},
					"routes": []map[string]string{{"dst": defRoute}},
				},
			},
			map[string]any{
				"type":         "portmap",
				"capabilities": map[string]bool{"portMappings": true},
			},
		},
	}
	return json.MarshalIndent(conf, "", "  ")
}

// InstallDefaultConflist writes DefaultConflist(subnet) to
// dir/DefaultConflistFile when dir holds no CNI configuration file
// (*.conf, *.conflist, *.json), creating dir if needed, and reports whether
// it wrote. An existing configuration, valid or not, is left alone.
// Errors: ErrInvalidArgument for a bad subnet; others are system errors.
func InstallDefaultConflist(dir, subnet string) (written bool, err error) {
	data, err := DefaultConflist(subnet)
	if err != nil {
		return false, err
	}
	files, err := libcni.ConfFiles(dir, confExtensions)
	if err != nil {
		return false, fmt.Errorf("CNI config dir %s: %w", dir, err)
	}
	if len(files) > 0 {
		return false, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return false, fmt.Errorf("CNI config dir %s: %w", dir, err)
	}
	if err := writeFileAtomic(filepath.Join(dir, DefaultConflistFile), append(data, '\n')); err != nil {
		return false, err
	}
	return true, nil
}
