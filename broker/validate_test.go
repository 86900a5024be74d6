package broker

import (
	"errors"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
)

func validContainer() *ContainerConfig {
	return &ContainerConfig{Metadata: ContainerMetadata{Name: "c"}, Image: "busybox", Args: []string{"sleep", "1"},
		Env: []KeyValue{{Key: "A", Value: "1"}}, Resources: Resources{MemoryLimit: 64 << 20, CPUQuota: 50000, CPUPeriod: 100000}}
}

func validPod() *PodConfig {
	return &PodConfig{Metadata: PodMetadata{Name: "p", Namespace: "default", UID: "u"}, Hostname: strings.Repeat("h", 64)}
}

// TestBadInputRefused: input no kernel or agent takes is InvalidArgument
// at create, naming the field.
func TestBadInputRefused(t *testing.T) {
	if err := validateContainerConfig(validContainer()); err != nil {
		t.Fatalf("a valid container: %v", err)
	}
	if err := validatePodConfig(validPod()); err != nil {
		t.Fatalf("a valid pod: %v", err)
	}
	for _, tc := range []struct {
		field string
		edit  func(c *ContainerConfig)
	}{
		{"config.args[1]", func(c *ContainerConfig) { c.Args[1] = "1\x00" }},
		{"config.env[0].value", func(c *ContainerConfig) { c.Env[0].Value = "a\x00b" }},
		{"config.metadata.name", func(c *ContainerConfig) { c.Metadata.Name = "c\x00" }},
		{"config.mounts[0].host_path", func(c *ContainerConfig) { c.Mounts = []Mount{{ContainerPath: "/d", HostPath: "/tmp\x00"}} }},
		{`config.labels["k"]`, func(c *ContainerConfig) { c.Labels = map[string]string{"k": "\x00"} }},
		{"config.metadata.name", func(c *ContainerConfig) { c.Metadata.Name = strings.Repeat("n", 1<<20) }},
		{"config.linux.resources.memory_limit_in_bytes", func(c *ContainerConfig) { c.Resources.MemoryLimit = 1 }},
		{"config.linux.resources.cpu_quota", func(c *ContainerConfig) { c.Resources.CPUQuota = -5 }},
		{"config.linux.resources.cpu_quota", func(c *ContainerConfig) { c.Resources.CPUQuota = 10 }},
		{"config.linux.resources.cpu_period", func(c *ContainerConfig) { c.Resources.CPUPeriod = 10 << 20 }},
		{"config.linux.resources.oom_score_adj", func(c *ContainerConfig) { c.Resources.OOMScoreAdj = 1001 }},
	} {
		c := validContainer()
		tc.edit(c)
		err := validateContainerConfig(c)
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.HasPrefix(err.Error(), tc.field+":") {
			t.Errorf("container with a bad %s: %v", tc.field, err)
		}
	}
	for _, tc := range []struct {
		field string
		edit  func(c *PodConfig)
	}{
		{"config.hostname", func(c *PodConfig) { c.Hostname = strings.Repeat("h", 65) }},
		{"config.hostname", func(c *PodConfig) { c.Hostname = strings.Repeat("h", 1<<20) }},
		{"config.metadata.namespace", func(c *PodConfig) { c.Metadata.Namespace = "a\x00" }},
		{"config.dns.servers[0]", func(c *PodConfig) { c.DNS = &DNSConfig{Servers: []string{"1.1.1.1\x00"}} }},
		{"config.linux.resources.cpu_quota", func(c *PodConfig) { c.Resources = &Resources{CPUQuota: -2} }},
		{"config.linux.resources.memory_limit_in_bytes", func(c *PodConfig) { c.Resources = &Resources{MemoryLimit: 1} }},
	} {
		c := validPod()
		tc.edit(c)
		err := validatePodConfig(c)
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.HasPrefix(err.Error(), tc.field+":") {
			t.Errorf("pod with a bad %s: %v", tc.field, err)
		}
	}
}

func TestCheckCommand(t *testing.T) {
	if err := CheckCommand("cmd", []string{"sh", "-c", "true"}); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range [][]string{nil, {""}, {"sh", "-c", "echo\x00"}} {
		if err := CheckCommand("cmd", cmd); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.HasPrefix(err.Error(), "cmd") {
			t.Errorf("CheckCommand(%q) = %v", cmd, err)
		}
	}
}
