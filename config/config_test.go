package config

import (
	"strings"
	"testing"
	"time"
)

func TestDefaultIsValid(t *testing.T) {
	c := Default()
	if c.Policy != nil || c.PodCgroupParent() != "stagelet" || c.CgroupDriver != CgroupDriverCgroupfs || c.Version != 1 {
		t.Fatalf("unexpected default: %+v", c)
	}
}

func TestParse(t *testing.T) {
	tests := []struct {
		name, yaml, wantErr string
		check               func(*testing.T, *Config)
	}{
		{name: "empty keeps defaults", yaml: "", check: func(t *testing.T, c *Config) {
			if c.PodCgroupParent() != "stagelet" {
				t.Errorf("cgroup parent = %q", c.PodCgroupParent())
			}
		}},
		{name: "systemd driver defaults to stagelet.slice", yaml: "cgroup_driver: systemd\n", check: func(t *testing.T, c *Config) {
			if c.PodCgroupParent() != "stagelet.slice" {
				t.Errorf("cgroup parent = %q", c.PodCgroupParent())
			}
		}},
		{name: "systemd driver with a slice", yaml: "cgroup_driver: systemd\ncgroup_parent: pods.slice\n", check: func(t *testing.T, c *Config) {
			if c.PodCgroupParent() != "pods.slice" {
				t.Errorf("cgroup parent = %q", c.PodCgroupParent())
			}
		}},
		{name: "systemd driver with a path", yaml: "cgroup_driver: systemd\ncgroup_parent: /stagelet\n", wantErr: "must be a slice"},
		{name: "unknown driver", yaml: "cgroup_driver: cgroupv2\n", wantErr: "want cgroupfs or systemd"},
		{name: "inline policy", yaml: "policy:\n  version: 1\n  default_stage1: fly\n", check: func(t *testing.T, c *Config) {
			p, err := c.LoadPolicy()
			if err != nil || p.DefaultStage1 != "fly" || p.Source != "test.yaml" {
				t.Errorf("policy = %+v, %v", p, err)
			}
		}},
		{name: "policy problems name the line", yaml: "version: 1\npolicy:\n  version: 1\n  default_stage1: fly\n  rulez: []\n", wantErr: "line 5"},
		{name: "policy and policy_file", yaml: "policy: {version: 1, default_stage1: fly}\npolicy_file: p.yaml\n", wantErr: "not both"},
		{name: "registries", yaml: "version: 1\nregistries:\n  registry.k8s.io:\n    mirrors: [\"http://127.0.0.1:5055\"]\n  127.0.0.1:5055:\n    insecure: true\n",
			check: func(t *testing.T, c *Config) {
				if got := c.Registries["registry.k8s.io"].Mirrors; len(got) != 1 || got[0] != "http://127.0.0.1:5055" {
					t.Errorf("mirrors = %v", got)
				}
				if !c.Registries["127.0.0.1:5055"].Insecure {
					t.Errorf("insecure not set")
				}
			}},
		{name: "unknown key names line", yaml: "version: 1\ncgroup_parrent: x\n", wantErr: "line 2: field cgroup_parrent not found"},
		{name: "wrong type", yaml: "version: one\n", wantErr: "line 1"},
		{name: "bad version", yaml: "version: 7\n", wantErr: "version: 7 is not supported"},
		{name: "bad mirror", yaml: "registries:\n  a.io:\n    mirrors: [\"ftp://x\"]\n", wantErr: "scheme \"ftp\""},
		{name: "dotdot cgroup", yaml: "cgroup_parent: ../x\n", wantErr: "cgroup_parent"},
		{name: "q35", yaml: "kvm: {machine: q35}\n", check: func(t *testing.T, c *Config) {
			if c.KVM.Machine != "q35" || len(c.CDI.SpecDirs) != 2 {
				t.Errorf("kvm.machine %q, cdi.spec_dirs %v", c.KVM.Machine, c.CDI.SpecDirs)
			}
		}},
		{name: "unknown machine", yaml: "kvm: {machine: pc}\n", wantErr: "kvm.machine"},
		{name: "boot timeout", yaml: "kvm: {boot_timeout: 3m}\n", check: func(t *testing.T, c *Config) {
			if got := c.KVM.BootTimeoutDuration(); got != 3*time.Minute {
				t.Errorf("kvm.boot_timeout = %v, want 3m", got)
			}
		}},
		{name: "bad boot timeout", yaml: "kvm: {boot_timeout: soon}\n", wantErr: "kvm.boot_timeout"},
		{name: "nri timeouts", yaml: "nri: {request_timeout: 1s, registration_timeout: 3s}\n", check: func(t *testing.T, c *Config) {
			if reg, req := c.NRI.Timeouts(); reg != 3*time.Second || req != time.Second || c.NRI.Disable {
				t.Errorf("nri: %+v", c.NRI)
			}
		}},
		{name: "bad nri timeout", yaml: "nri: {request_timeout: -1s}\n", wantErr: "nri.request_timeout"},
		{name: "negative boot timeout", yaml: "kvm: {boot_timeout: -1s}\n", wantErr: "kvm.boot_timeout"},
		{name: "relative CDI dir", yaml: "cdi: {spec_dirs: [etc/cdi]}\n", wantErr: "cdi.spec_dirs"},
		{name: "relative signature policy", yaml: "images: {signature_policy: policy.json}\n", wantErr: "images.signature_policy: \"policy.json\" is not absolute"},
		{name: "live moves off by default", yaml: "", check: func(t *testing.T, c *Config) {
			if c.Checkpoint.LiveAddress != "" {
				t.Errorf("checkpoint.live_address = %q, want off", c.Checkpoint.LiveAddress)
			}
		}},
		{name: "live move address", yaml: "checkpoint: {live_address: \"10.0.0.5:7443\"}\n", check: func(t *testing.T, c *Config) {
			if c.Checkpoint.LiveAddress != "10.0.0.5:7443" {
				t.Errorf("checkpoint.live_address = %q", c.Checkpoint.LiveAddress)
			}
		}},
		{name: "live move address must be an IP", yaml: "checkpoint: {live_address: node1}\n", wantErr: "checkpoint.live_address: \"node1\""},
		{name: "live move address must be reachable", yaml: "checkpoint: {live_address: 0.0.0.0}\n", wantErr: "checkpoint.live_address: \"0.0.0.0\""},
		{name: "relative signature policy dir", yaml: "images: {signature_policy_dir: p.d}\n", wantErr: "images.signature_policy_dir"},
		{name: "streaming defaults to loopback, any port", yaml: "", check: func(t *testing.T, c *Config) {
			if got := c.StreamingAddr(); got != "127.0.0.1:0" {
				t.Errorf("streaming address = %q", got)
			}
		}},
		{name: "streaming on IPv6", yaml: "streaming: {address: \"::1\", port: 10010}\n", check: func(t *testing.T, c *Config) {
			if got := c.StreamingAddr(); got != "[::1]:10010" {
				t.Errorf("streaming address = %q", got)
			}
		}},
		{name: "streaming address must be an IP", yaml: "streaming: {address: localhost}\n", wantErr: "streaming.address: \"localhost\": want an IP address"},
		{name: "streaming address must be set", yaml: "streaming: {address: \"\"}\n", wantErr: "streaming.address"},
		{name: "streaming port range", yaml: "streaming: {port: 70000}\n", wantErr: "streaming.port: 70000"},
		{name: "streaming negative port", yaml: "streaming: {port: -1}\n", wantErr: "streaming.port: -1"},
		{name: "streaming unknown key", yaml: "streaming:\n  adress: 127.0.0.1\n", wantErr: "line 2: field adress not found"},
		{name: "metrics off by default", yaml: "", check: func(t *testing.T, c *Config) {
			if c.Metrics.Address != "" {
				t.Errorf("metrics.address = %q, want off", c.Metrics.Address)
			}
		}},
		{name: "metrics on loopback", yaml: "metrics: {address: \"127.0.0.1:9477\"}\n", check: func(t *testing.T, c *Config) {
			if c.Metrics.Address != "127.0.0.1:9477" {
				t.Errorf("metrics.address = %q", c.Metrics.Address)
			}
		}},
		{name: "metrics on IPv6, any port", yaml: "metrics: {address: \"[::1]:0\"}\n", check: func(*testing.T, *Config) {}},
		{name: "metrics on every address", yaml: "metrics: {address: \":9477\"}\n", check: func(*testing.T, *Config) {}},
		{name: "metrics address without port", yaml: "metrics: {address: 127.0.0.1}\n", wantErr: "metrics.address: \"127.0.0.1\": want host:port"},
		{name: "metrics port range", yaml: "metrics: {address: \"127.0.0.1:70000\"}\n", wantErr: "metrics.address: \"127.0.0.1:70000\": port"},
		{name: "metrics port name", yaml: "metrics: {address: \"127.0.0.1:http\"}\n", wantErr: "metrics.address"},
		{name: "tracing endpoint without port", yaml: "tracing: {endpoint: collector}\n", wantErr: "tracing.endpoint: \"collector\": want host:port"},
		{name: "tracing sampling above a million", yaml: "tracing: {endpoint: \"127.0.0.1:4317\", sampling_rate_per_million: 1000001}\n", wantErr: "tracing.sampling_rate_per_million: 1000001"},
		{name: "tracing sampling negative", yaml: "tracing: {sampling_rate_per_million: -1}\n", wantErr: "tracing.sampling_rate_per_million: -1"},
		{name: "metrics unknown key", yaml: "metrics:\n  port: 9477\n", wantErr: "line 2: field port not found"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Parse("test.yaml", []byte(tc.yaml))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.HasPrefix(err.Error(), "test.yaml: ") {
					t.Fatalf("err = %v, want it to name test.yaml and contain %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, c)
		})
	}
}

func TestSignaturePolicyDir(t *testing.T) {
	for _, tc := range []struct{ file, dir, want string }{
		{"", "", ""},
		{"/etc/stagelet/signature-policy.json", "", "/etc/stagelet/signature-policy.d"},
		{"/etc/stagelet/signature-policy.json", "/srv/ns", "/srv/ns"},
		{"", "/srv/ns", "/srv/ns"},
	} {
		if got := (Images{SignaturePolicy: tc.file, SignaturePolicyDir: tc.dir}).PolicyDir(); got != tc.want {
			t.Errorf("PolicyDir of %q, %q: %q, want %q", tc.file, tc.dir, got, tc.want)
		}
	}
}
