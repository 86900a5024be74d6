package testregistry

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// JREHome is where Debian's openjdk-17-jre-headless keeps the runtime, on the
// host and in the image PushJRE pushes; its java is JREHome + "/bin/java".
const JREHome = "/usr/lib/jvm/java-17-openjdk-amd64"

// jreSkip is what PushJRE skips with when the host has no JRE.
const jreSkip = "no OpenJDK 17 JRE on this host (apt-get install openjdk-17-jre-headless)"

// jreExcluded are the paths below JREHome that the image leaves out: docs
// and headers, the JDK's jmods and javac-only files, and what Debian ships in
// openjdk-17-jre rather than -headless (the X11/GTK libraries, whose
// dependencies would more than double the library set).
var jreExcluded = map[string]bool{
	"docs":                   true,
	"include":                true,
	"jmods":                  true,
	"legal":                  true,
	"man":                    true,
	"lib/ct.sym":             true,
	"lib/src.zip":            true,
	"lib/libatk-wrapper.so":  true,
	"lib/libawt_xawt.so":     true,
	"lib/libjawt.so":         true,
	"lib/libsplashscreen.so": true,
}

// jreBins are the launchers of openjdk-17-jre-headless the image keeps from
// JREHome/bin (a host with the JDK has some twenty more).
var jreBins = map[string]bool{"java": true, "keytool": true, "rmiregistry": true}

// jreLoader is the dynamic loader of every amd64 binary.
const jreLoader = "/lib64/ld-linux-x86-64.so.2"

var (
	jreOnce sync.Once
	jreImg  v1.Image
	jreErr  error
)

// PushJRE pushes an image holding the host's OpenJDK 17 runtime (Debian's
// openjdk-17-jre-headless) and busybox, and returns its reference. It skips
// the test, saying why, when the host has no such JRE.
//
// The image is BusyboxImage plus one layer holding JREHome (bin/java,
// keytool and rmiregistry, conf/, lib/ without the X11 libraries, no docs,
// headers, jmods or src.zip), every file outside JREHome its symlinks lead
// to (/etc/java-17-openjdk/..., /etc/ssl/certs/java/cacerts), every shared
// library ldd finds for its ELF files, and the dynamic loader, each at its
// host path with the symlinks on the way (merged /usr: lib -> usr/lib). It
// is self-contained: java runs with the image as the whole root filesystem.
// Config: PATH with JREHome/bin first, then DefaultPath's; Cmd
// ["java", "-version"]. It is built once per process, deterministically.
func (r *Registry) PushJRE(t testing.TB, repo, tag string) string {
	t.Helper()
	return r.Push(t, repo, tag, jreImage(t))
}

// jreImage returns the image PushJRE pushes, building it on first use.
func jreImage(t testing.TB) v1.Image {
	t.Helper()
	if _, err := os.Stat(JREHome + "/bin/java"); err != nil {
		t.Skip(jreSkip)
	}
	base := BusyboxImage(t)
	jreOnce.Do(func() { jreImg, jreErr = buildJRE(base) })
	if jreErr != nil {
		t.Fatalf("testregistry: build JRE image: %v", jreErr)
	}
	return jreImg
}

// buildJRE builds the JRE image on top of base (the busybox image).
func buildJRE(base v1.Image) (v1.Image, error) {
	layer, err := jreLayer()
	if err != nil {
		return nil, err
	}
	cf, err := base.ConfigFile()
	if err != nil {
		return nil, err
	}
	c := *cf.Config.DeepCopy()
	c.Env = []string{"PATH=" + JREHome + "/bin:" + strings.TrimPrefix(DefaultPath, "PATH=")}
	c.Cmd = []string{"java", "-version"}
	img, err := mutate.Config(base, c)
	if err != nil {
		return nil, err
	}
	return mutate.AppendLayers(img, layer)
}

// jreLayer builds the JRE layer. The tar is gzipped once, at BestSpeed (as
// tarball layers are), and the layer serves those bytes, so pushing it again
// costs no compression.
func jreLayer() (v1.Layer, error) {
	b := &rootBuilder{seen: map[string]bool{}}
	var elfs []string
	err := filepath.WalkDir(JREHome, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel := strings.TrimPrefix(strings.TrimPrefix(p, JREHome), "/")
		if jreExcluded[rel] || (filepath.Dir(rel) == "bin" && !jreBins[d.Name()]) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		isELF, err := b.add(p, 0)
		if isELF {
			elfs = append(elfs, p)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	libs, err := lddLibs(elfs)
	if err != nil {
		return nil, err
	}
	for _, l := range append(libs, jreLoader) {
		if _, err := b.add(l, 0); err != nil {
			return nil, err
		}
	}
	sort.Slice(b.entries, func(i, j int) bool { return b.entries[i].hdr.Name < b.entries[j].hdr.Name })
	raw, err := tarBytes(b.entries)
	if err != nil {
		return nil, err
	}
	b.entries = nil
	var gz bytes.Buffer
	gz.Grow(len(raw) / 2)
	zw, err := gzip.NewWriterLevel(&gz, gzip.BestSpeed)
	if err != nil {
		return nil, err
	}
	if _, err := zw.Write(raw); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	l := &gzLayer{gz: gz.Bytes()}
	if l.diffID, _, err = v1.SHA256(bytes.NewReader(raw)); err != nil {
		return nil, err
	}
	if l.digest, _, err = v1.SHA256(bytes.NewReader(l.gz)); err != nil {
		return nil, err
	}
	return partial.CompressedToLayer(l)
}

// gzLayer is a layer held gzipped in memory, with both hashes computed once
// (tarball.LayerFromOpener would gunzip it again to find its diff ID).
type gzLayer struct {
	gz             []byte
	digest, diffID v1.Hash
}

func (l *gzLayer) Digest() (v1.Hash, error) { return l.digest, nil }
func (l *gzLayer) DiffID() (v1.Hash, error) { return l.diffID, nil }
func (l *gzLayer) Size() (int64, error)     { return int64(len(l.gz)), nil }
func (l *gzLayer) MediaType() (types.MediaType, error) {
	return types.DockerLayer, nil
}
func (l *gzLayer) Compressed() (io.ReadCloser, error) {
	return io.NopCloser(bytes.NewReader(l.gz)), nil
}

// lddLibs runs ldd over files and returns the libraries it resolves, sorted
// and without repeats. Libraries ldd does not find (libjvm.so, which the
// JRE's own libraries need and which the launcher loads from lib/server) are
// left out.
func lddLibs(files []string) ([]string, error) {
	if len(files) == 0 {
		return nil, errors.New("no ELF files in " + JREHome)
	}
	out, err := exec.Command("ldd", files...).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd: %w", err)
	}
	set := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) >= 3 && f[1] == "=>" && strings.HasPrefix(f[2], "/"):
			set[f[2]] = true
		case len(f) >= 1 && strings.HasPrefix(f[0], "/") && !strings.HasSuffix(f[0], ":"):
			set[f[0]] = true // the loader: "/lib64/ld-linux-x86-64.so.2 (0x...)"
		}
	}
	libs := make([]string, 0, len(set))
	for l := range set {
		libs = append(libs, l)
	}
	sort.Strings(libs)
	return libs, nil
}

// rootBuilder collects the tar entries that carry host paths into an image at
// the same paths, each once, owned by 0:0.
type rootBuilder struct {
	seen    map[string]bool
	entries []tarEntry
}

// add carries the host path p: every directory on the way, every symlink on
// the way and what it leads to (resolved as the kernel would, so a target
// outside the tree comes too), and p itself. Dangling symlinks are carried as
// they are. It reports whether p is (or leads to) an ELF file.
func (b *rootBuilder) add(p string, depth int) (isELF bool, err error) {
	if depth > 40 {
		return false, fmt.Errorf("%s: too many levels of symbolic links", p)
	}
	parts := strings.Split(strings.TrimPrefix(filepath.Clean(p), "/"), "/")
	cur := "/"
	for i, part := range parts {
		next := filepath.Join(cur, part)
		fi, err := os.Lstat(next)
		if err != nil {
			if depth > 0 && errors.Is(err, fs.ErrNotExist) {
				return false, nil // a dangling symlink, already carried
			}
			return false, err
		}
		name := strings.TrimPrefix(next, "/")
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(next)
			if err != nil {
				return false, err
			}
			b.emit(tarEntry{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0o777}})
			if !filepath.IsAbs(target) {
				target = filepath.Join(cur, target)
			}
			return b.add(filepath.Join(append([]string{target}, parts[i+1:]...)...), depth+1)
		case fi.IsDir():
			b.emit(tarEntry{hdr: tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: int64(fi.Mode().Perm())}})
			cur = next
		case fi.Mode().IsRegular() && i == len(parts)-1:
			if b.seen[name] {
				return false, nil
			}
			data, err := os.ReadFile(next)
			if err != nil {
				return false, err
			}
			b.emit(tarEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: int64(fi.Mode().Perm())}, data: data})
			return bytes.HasPrefix(data, []byte("\x7fELF")), nil
		default:
			return false, fmt.Errorf("%s: cannot carry %v", next, fi.Mode().Type())
		}
	}
	return false, nil
}

func (b *rootBuilder) emit(e tarEntry) {
	n := strings.TrimSuffix(e.hdr.Name, "/")
	if b.seen[n] {
		return
	}
	b.seen[n] = true
	b.entries = append(b.entries, e)
}
