package network

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/stagelet/stagelet/errdefs"
)

// fakePlugins makes a plugin dir with executables of the given names.
func fakePlugins(t *testing.T, names ...string) string {
	dir := t.TempDir()
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("#!/bin/sh\nexit 1\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestStatus(t *testing.T) {
	base := t.TempDir()
	cfg := Config{
		ConfDir:    filepath.Join(base, "net.d"),
		PluginDirs: []string{fakePlugins(t, "bridge", "host-local", "portmap")},
		RunDir:     filepath.Join(base, "run"),
		CacheDir:   filepath.Join(base, "cache"),
	}
	m, err := New(cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	expectNotReady := func(want string) {
		t.Helper()
		ready, reason := m.Status()
		if ready || !strings.Contains(reason, want) {
			t.Fatalf("Status = %v %q, want not ready mentioning %q", ready, reason, want)
		}
	}
	expectNotReady("no CNI network config in " + cfg.ConfDir) // dir missing
	if err := os.MkdirAll(cfg.ConfDir, 0o755); err != nil {
		t.Fatal(err)
	}
	expectNotReady("no CNI network config in " + cfg.ConfDir) // dir empty

	write := func(name, body string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(cfg.ConfDir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("00-broken.conflist", "{not json")
	write("05-missing.conflist", `{"cniVersion":"1.0.0","name":"calico","plugins":[{"type":"calico"}]}`)
	write("README", "not a config")
	expectNotReady("00-broken.conflist")
	expectNotReady(`plugin "calico" not found`)

	data, err := DefaultConflist("10.213.7.0/24")
	if err != nil {
		t.Fatal(err)
	}
	write("10-stagelet.conflist", string(data))
	if ready, reason := m.Status(); !ready {
		t.Fatalf("not ready after a valid conflist was added: %s", reason)
	}
	if m.NetworkName() != "stagelet" {
		t.Errorf("network %q", m.NetworkName())
	}

	// An earlier file takes over; a single-plugin .conf is a network too.
	write("01-single.conf", `{"cniVersion":"1.0.0","name":"single","type":"bridge","bridge":"x"}`)
	if ready, _ := m.Status(); !ready || m.NetworkName() != "single" {
		t.Fatalf("ready %v network %q, want single", ready, m.NetworkName())
	}
	// Removing every usable file makes it not ready again.
	os.Remove(filepath.Join(cfg.ConfDir, "01-single.conf"))
	os.Remove(filepath.Join(cfg.ConfDir, "10-stagelet.conflist"))
	expectNotReady("no valid CNI network config")
}

func TestStatusNoticesRewrite(t *testing.T) {
	base := t.TempDir()
	cfg := Config{ConfDir: base, PluginDirs: []string{fakePlugins(t, "bridge", "other")}, RunDir: filepath.Join(base, "run"), CacheDir: filepath.Join(base, "cache")}
	m, err := New(cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(base, "10.conflist")
	os.WriteFile(f, []byte(`{"cniVersion":"1.0.0","name":"one","plugins":[{"type":"bridge"}]}`), 0o644)
	if ready, _ := m.Status(); !ready || m.NetworkName() != "one" {
		t.Fatalf("network %q", m.NetworkName())
	}
	os.WriteFile(f, []byte(`{"cniVersion":"1.0.0","name":"two-two","plugins":[{"type":"other"}]}`), 0o644)
	future := time.Now().Add(time.Hour)
	os.Chtimes(f, future, future)
	if m.NetworkName() != "two-two" {
		t.Fatalf("rewrite not noticed: network %q", m.NetworkName())
	}
}

// A Status without change reads nothing of ConfDir; one after a change
// sees it at once, even a rewrite that keeps the file's size and times,
// and after the directory was removed and made again.
func TestStatusWatchesConfDir(t *testing.T) {
	defer func(f func(string, []string) *netConf) { load = f }(load)
	loads := 0
	load = func(dir string, plugins []string) *netConf { loads++; return loadNetwork(dir, plugins) }
	base := t.TempDir()
	conf := filepath.Join(base, "net.d")
	os.Mkdir(conf, 0o755)
	cfg := Config{ConfDir: conf, PluginDirs: []string{fakePlugins(t, "bridge", "other")}, RunDir: filepath.Join(base, "run"), CacheDir: filepath.Join(base, "cache")}
	m, err := New(cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	f := filepath.Join(conf, "10.conflist")
	write := func(name string) {
		t.Helper()
		body := `{"cniVersion":"1.0.0","name":"` + name + `","plugins":[{"type":"bridge"}]}`
		if err := os.WriteFile(f, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("aaa")
	if ready, _ := m.Status(); !ready || m.NetworkName() != "aaa" {
		t.Fatalf("network %q", m.NetworkName())
	}
	before := loads
	for range 100 {
		if ready, _ := m.Status(); !ready {
			t.Fatal("not ready")
		}
	}
	if loads != before {
		t.Errorf("100 calls without change loaded ConfDir %d times", loads-before)
	}
	fi, _ := os.Stat(f)
	write("bbb")
	os.Chtimes(f, fi.ModTime(), fi.ModTime())
	if m.NetworkName() != "bbb" {
		t.Errorf("a rewrite of the same size and time not noticed: network %q", m.NetworkName())
	}
	os.RemoveAll(conf)
	if ready, _ := m.Status(); ready {
		t.Error("ready with ConfDir gone")
	}
	os.Mkdir(conf, 0o755)
	write("ccc")
	if ready, _ := m.Status(); !ready || m.NetworkName() != "ccc" {
		t.Errorf("after ConfDir came back: network %q", m.NetworkName())
	}
	before = loads
	m.Status()
	if loads != before {
		t.Error("the new watch did not take over")
	}
}

func TestNewInvalid(t *testing.T) {
	if _, err := New(Config{ConfDir: "rel"}, nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("relative conf dir: %v", err)
	}
	if _, err := New(Config{ConfDir: "/x", RunDir: t.TempDir(), CacheDir: t.TempDir(), PluginDirs: []string{"bin"}}, nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("relative plugin dir: %v", err)
	}
}

func TestInstallDefaultConflist(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "net.d")
	wrote, err := InstallDefaultConflist(dir, "")
	if err != nil || !wrote {
		t.Fatalf("InstallDefaultConflist = %v, %v", wrote, err)
	}
	list, err := libcni.ConfListFromFile(filepath.Join(dir, DefaultConflistFile))
	if err != nil {
		t.Fatal(err)
	}
	if list.Name != "stagelet" || len(list.Plugins) != 2 || list.Plugins[0].Network.Type != "bridge" || list.Plugins[1].Network.Type != "portmap" {
		t.Fatalf("unexpected list %s", list.Bytes)
	}
	if !list.Plugins[1].Network.Capabilities["portMappings"] {
		t.Error("portmap lacks the portMappings capability")
	}
	for _, want := range []string{`"stagelet0"`, `"10.88.0.0/16"`, `"host-local"`, `"hairpinMode": true`, `"ipMasq": true`, `"isGateway": true`} {
		if !strings.Contains(string(list.Bytes), want) {
			t.Errorf("conflist lacks %s:\n%s", want, list.Bytes)
		}
	}
	if wrote, err := InstallDefaultConflist(dir, "10.99.0.0/16"); err != nil || wrote {
		t.Fatalf("second InstallDefaultConflist = %v, %v; want false", wrote, err)
	}

	d2 := t.TempDir()
	if _, err := InstallDefaultConflist(d2, "10.99.1.0/24"); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(d2, DefaultConflistFile))
	if !strings.Contains(string(b), `"10.99.1.0/24"`) {
		t.Errorf("subnet not used:\n%s", b)
	}
	for _, bad := range []string{"10.0.0.1", "nonsense", "10.0.0.0/31"} {
		if _, err := InstallDefaultConflist(t.TempDir(), bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("subnet %q: %v", bad, err)
		}
	}
	if b, err := DefaultConflist("fd00:213::/64"); err != nil || !strings.Contains(string(b), `"::/0"`) {
		t.Errorf("IPv6 subnet: %v\n%s", err, b)
	}
}
