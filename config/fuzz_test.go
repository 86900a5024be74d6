package config

import (
	"testing"
)

// FuzzParse: the node config loader never panics; what it accepts
// validates again, and keeps a source name.
func FuzzParse(f *testing.F) {
	f.Add(defaultYAML)
	f.Add([]byte(""))
	f.Add([]byte("version: 1\ncgroup_driver: systemd\ncgroup_parent: kubepods.slice\n"))
	f.Add([]byte("version: 1\nkvm: {accelerator: tcg}\nstreaming: {address: 127.0.0.1, port: 0}\n"))
	f.Add([]byte("version: 1\npolicy: |\n  version: 1\n  default_stage1: nspawn\n"))
	f.Add([]byte("version: 2\nunknown: 1\n"))
	f.Add([]byte("version: 1\nregistry: {mirrors: {docker.io: [\"http://127.0.0.1:5000\"]}}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse("fuzz.yaml", data)
		if err != nil {
			if c != nil {
				t.Fatalf("Parse returned a config with error %v", err)
			}
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("an accepted config does not validate: %v", err)
		}
		if c.Source != "fuzz.yaml" {
			t.Fatalf("source %q", c.Source)
		}
	})
}
