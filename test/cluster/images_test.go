package cluster

import (
	"archive/tar"
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/testregistry"
)

func moduleRoot() string {
	root, err := harness.ModuleRoot()
	if err != nil {
		panic(err)
	}
	return root
}

// images the cluster pulls, by name, once startRegistry has pushed them.
type images struct {
	busybox, agnhost, kubeProxy, podnet, coredns, counter string
	// signed and unsigned are busybox with a file /image naming them,
	// for the signature policy test: images no other test pulls, which
	// it signs the first of.
	signed, unsigned string
}

var img images

// startRegistry serves the cluster's images on the bridge, built from
// files of this host: busybox-static, agnhost, kube-proxy and coredns as
// built by scripts/cluster-build.sh, podnet built now, and Debian's
// iptables with the libraries it loads.
func (c *cluster) startRegistry() {
	t := c.t
	r := testregistry.StartAddr(t, hostIP+":0")
	c.registry = r.Host
	busybox := testregistry.BusyboxImage(t)
	img.busybox = r.Push(t, "busybox", "test", busybox)

	agnhost, err := mutate.AppendLayers(busybox, testregistry.Layer(t, fileEntries(t, map[string]string{"agnhost": c.bin("agnhost")})...))
	if err != nil {
		t.Fatal(err)
	}
	img.agnhost = r.Push(t, "agnhost", "test", testregistry.WithConfig(agnhost, []string{"/agnhost"}, []string{"pause"}, ""))

	iptables := testregistry.Layer(t, iptablesEntries(t)...)
	kubeProxy := scratch(t, iptables, testregistry.Layer(t, fileEntries(t, map[string]string{
		"usr/local/bin/kube-proxy": c.bin("kube-proxy"),
	})...))
	img.kubeProxy = r.Push(t, "kube-proxy", "test", testregistry.WithConfig(kubeProxy, []string{"/usr/local/bin/kube-proxy"}, nil, ""))

	podnetBin := c.buildCommand("podnet")
	files := map[string]string{"usr/local/bin/podnet": podnetBin}
	for _, p := range []string{"bridge", "host-local", "loopback", "portmap"} {
		files["opt/podnet/plugins/"+p] = filepath.Join(c.env.tools, "cni", p)
	}
	podnet := scratch(t, iptables, testregistry.Layer(t, fileEntries(t, files)...))
	img.podnet = r.Push(t, "podnet", "test", testregistry.WithConfig(podnet, []string{"/usr/local/bin/podnet"}, nil, ""))

	coredns := scratch(t, testregistry.Layer(t, fileEntries(t, map[string]string{"coredns": filepath.Join(c.env.tools, "coredns")})...))
	img.coredns = r.Push(t, "coredns", "test", testregistry.WithConfig(coredns, []string{"/coredns"}, nil, ""))

	counter, err := mutate.AppendLayers(busybox, testregistry.Layer(t, fileEntries(t, map[string]string{"counter": c.buildCommand("counter")})...))
	if err != nil {
		t.Fatal(err)
	}
	img.counter = r.Push(t, "counter", "test", counter)

	img.signed = r.Push(t, "signed", "test", marked(t, busybox, "signed"))
	img.unsigned = r.Push(t, "unsigned", "test", marked(t, busybox, "unsigned"))
}

// marked is base with a file /image holding name: an image of a digest
// of its own.
func marked(t testing.TB, base v1.Image, name string) v1.Image {
	t.Helper()
	data := []byte(name + "\n")
	i, err := mutate.AppendLayers(base, testregistry.Layer(t, testregistry.Entry{
		Header: tar.Header{Typeflag: tar.TypeReg, Name: "image", Mode: 0o644, Size: int64(len(data))},
		Data:   data,
	}))
	if err != nil {
		t.Fatalf("image %s: %v", name, err)
	}
	return i
}

// buildCommand builds the static command test/cluster/NAME into the
// cluster's directory and returns its path.
func (c *cluster) buildCommand(name string) string {
	c.t.Helper()
	bin := filepath.Join(c.dir, name)
	build := exec.Command("go", "build", "-trimpath", "-o", bin, "./test/cluster/"+name)
	build.Dir = moduleRoot()
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		c.t.Fatalf("build %s: %v\n%s", name, err, out)
	}
	return bin
}

type fatalf interface {
	Helper()
	Fatalf(string, ...any)
}

// scratch is an image of the given layers alone.
func scratch(t fatalf, layers ...v1.Layer) v1.Image {
	t.Helper()
	i, err := mutate.ConfigFile(empty.Image, &v1.ConfigFile{
		Architecture: "amd64", OS: "linux",
		Config: v1.Config{Env: []string{testregistry.DefaultPath}},
		RootFS: v1.RootFS{Type: "layers"},
	})
	if err != nil {
		t.Fatalf("image: %v", err)
	}
	i, err = mutate.AppendLayers(i, layers...)
	if err != nil {
		t.Fatalf("image: %v", err)
	}
	return i
}

// fileEntries are tar entries for files of this host (image path → host
// path), with the directories above them.
func fileEntries(t fatalf, files map[string]string) []testregistry.Entry {
	t.Helper()
	var out []testregistry.Entry
	dirs := map[string]bool{}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, name := range names {
		for d := filepath.Dir(name); d != "." && !dirs[d]; d = filepath.Dir(d) {
			dirs[d] = true
		}
	}
	ds := make([]string, 0, len(dirs))
	for d := range dirs {
		ds = append(ds, d)
	}
	slices.Sort(ds)
	for _, d := range ds {
		out = append(out, testregistry.Entry{Header: tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755}})
	}
	for _, name := range names {
		data, err := os.ReadFile(files[name])
		if err != nil {
			t.Fatalf("image file %s: %v", files[name], err)
		}
		fi, err := os.Stat(files[name])
		if err != nil {
			t.Fatalf("image file %s: %v", files[name], err)
		}
		out = append(out, testregistry.Entry{
			Header: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: int64(fi.Mode().Perm()), Size: int64(len(data))},
			Data:   data,
		})
	}
	return out
}

// iptablesEntries is Debian's iptables (the nf_tables variant, as the
// nodes' own) with its commands, its extensions and every library they
// load, taken from this host.
func iptablesEntries(t fatalf) []testregistry.Entry {
	t.Helper()
	multi, err := filepath.EvalSymlinks("/usr/sbin/iptables")
	if err != nil {
		t.Fatalf("iptables: %v (install iptables)", err)
	}
	files := map[string]string{strings.TrimPrefix(multi, "/"): multi, "etc/protocols": "/etc/protocols"}
	exts, _ := filepath.Glob("/usr/lib/x86_64-linux-gnu/xtables/*.so")
	for _, e := range append([]string{multi}, exts...) {
		files[strings.TrimPrefix(e, "/")] = e
		for _, lib := range libraries(t, e) {
			files[strings.TrimPrefix(lib, "/")] = lib
		}
	}
	out := fileEntries(t, files)
	for _, cmd := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
		out = append(out, testregistry.Entry{Header: tar.Header{
			Typeflag: tar.TypeSymlink, Name: "usr/sbin/" + cmd, Linkname: filepath.Base(multi), Mode: 0o777}})
	}
	// Debian's lib64 and lib are links into /usr.
	out = append(out,
		testregistry.Entry{Header: tar.Header{Typeflag: tar.TypeSymlink, Name: "lib64", Linkname: "usr/lib64", Mode: 0o777}},
		testregistry.Entry{Header: tar.Header{Typeflag: tar.TypeSymlink, Name: "lib", Linkname: "usr/lib", Mode: 0o777}},
		testregistry.Entry{Header: tar.Header{Typeflag: tar.TypeDir, Name: "run/", Mode: 0o755}},
		testregistry.Entry{Header: tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777}},
	)
	return out
}

// usrPath is path in a merged-/usr tree, where /lib and /lib64 are links
// into /usr.
func usrPath(path string) string {
	if strings.HasPrefix(path, "/usr/") {
		return path
	}
	return "/usr" + path
}

// libraries are the shared libraries (and the loader) a binary loads,
// by their real paths in /usr, as ldd names them.
func libraries(t fatalf, bin string) []string {
	t.Helper()
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		return nil // a static binary
	}
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var path string
		for _, f := range strings.Fields(sc.Text()) {
			if strings.HasPrefix(f, "/") {
				path = f
				break
			}
		}
		if path == "" {
			continue
		}
		real, err := filepath.EvalSymlinks(path)
		if err != nil {
			t.Fatalf("library %s of %s: %v", path, bin, err)
		}
		libs = append(libs, usrPath(real))
		// Under the names the binary asks for too (the loader's
		// /lib64/ld-linux-x86-64.so.2, a library's soname).
		if asked := usrPath(path); asked != usrPath(real) {
			libs = append(libs, asked)
		}
		if base := filepath.Base(path); base != filepath.Base(real) {
			libs = append(libs, filepath.Join(filepath.Dir(usrPath(real)), base))
		}
	}
	return libs
}
