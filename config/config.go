// Package config loads and validates the node operator's YAML configuration
// and holds the embedded default. Loading is strict: unknown keys and wrong
// types are errors naming the file and line.
package config

import (
	"bytes"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"path"
	"strings"

	"gopkg.in/yaml.v3"
)

// CurrentVersion is the config format version this build reads.
const CurrentVersion = 1

//go:embed default.yaml
var defaultYAML []byte

// DefaultYAML returns the embedded default configuration text.
func DefaultYAML() []byte { return bytes.Clone(defaultYAML) }

// Registry configures one registry host.
type Registry struct {
	// Mirrors are tried in order; when any is listed the host itself is
	// not contacted. "http://" marks a mirror as plain HTTP.
	Mirrors []string `yaml:"mirrors"`
	// Insecure allows plain HTTP to this host.
	Insecure bool `yaml:"insecure"`
}

// Config is the node configuration.
type Config struct {
	Version int `yaml:"version"`
	// Socket, StateDir and RunDir default to the serve flags' defaults;
	// flags given on the command line win.
	Socket   string `yaml:"socket"`
	StateDir string `yaml:"state_dir"`
	RunDir   string `yaml:"run_dir"`
	// CgroupParent: absolute, or relative to the daemon's own cgroup.
	CgroupParent  string              `yaml:"cgroup_parent"`
	DefaultStage1 string              `yaml:"default_stage1"`
	Registries    map[string]Registry `yaml:"registries"`

	// Source names where the config came from ("embedded default" or a path).
	Source string `yaml:"-"`
}

// Default returns the embedded default configuration.
func Default() *Config {
	c, err := Parse("embedded default", defaultYAML)
	if err != nil {
		panic("config: embedded default is invalid: " + err.Error())
	}
	return c
}

// Load reads and validates the file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(path, data)
}

// Parse decodes and validates data; name is used in error messages.
// Keys absent from data keep the embedded defaults' values.
func Parse(name string, data []byte) (*Config, error) {
	c := &Config{}
	if name != "embedded default" {
		c = Default()
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(c); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: %s", name, strings.TrimPrefix(err.Error(), "yaml: "))
	}
	c.Source = name
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return c, nil
}

// Validate checks what can be checked without touching the host.
func (c *Config) Validate() error {
	var errs []error
	if c.Version != CurrentVersion {
		errs = append(errs, fmt.Errorf("version: %d is not supported (want %d)", c.Version, CurrentVersion))
	}
	if c.DefaultStage1 == "" {
		errs = append(errs, fmt.Errorf("default_stage1: must be set"))
	}
	if c.CgroupParent == "" {
		errs = append(errs, fmt.Errorf("cgroup_parent: must be set"))
	} else if path.Clean(c.CgroupParent) != strings.TrimSuffix(c.CgroupParent, "/") || strings.Contains(c.CgroupParent, "..") {
		errs = append(errs, fmt.Errorf("cgroup_parent: %q must be a clean path without ..", c.CgroupParent))
	}
	for host, r := range c.Registries {
		if host == "" || strings.ContainsAny(host, "/ ") {
			errs = append(errs, fmt.Errorf("registries: %q is not a registry host", host))
		}
		for _, m := range r.Mirrors {
			if err := checkMirror(m); err != nil {
				errs = append(errs, fmt.Errorf("registries: %s: mirror %q: %v", host, m, err))
			}
		}
	}
	return errors.Join(errs...)
}

func checkMirror(m string) error {
	if !strings.Contains(m, "://") {
		m = "https://" + m
	}
	u, err := url.Parse(m)
	if err != nil {
		return err
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("scheme %q: want http or https", u.Scheme)
	}
	if u.Host == "" {
		return fmt.Errorf("no host")
	}
	return nil
}
