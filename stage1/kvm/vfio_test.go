package kvm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1/host"
)

// fakeQMP serves QMP on path: the greeting, then a return for every
// command but the device_add of a device named in fail; it records the
// commands it was sent.
type fakeQMP struct {
	mu   sync.Mutex
	cmds []string // "execute arguments-json"
	fail string
}

func (f *fakeQMP) serve(t *testing.T, path string) {
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.Write([]byte(`{"QMP": {"version": {}, "capabilities": []}}` + "\n"))
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadBytes('\n')
					if err != nil {
						return
					}
					var req struct {
						Execute   string          `json:"execute"`
						Arguments json.RawMessage `json:"arguments"`
					}
					json.Unmarshal(line, &req)
					f.mu.Lock()
					f.cmds = append(f.cmds, req.Execute+" "+string(req.Arguments))
					fail := f.fail != "" && req.Execute == "device_add" && strings.Contains(string(req.Arguments), f.fail)
					f.mu.Unlock()
					if fail {
						c.Write([]byte(`{"error": {"class": "GenericError", "desc": "vfio 0000:02:00.0: group 7 is not viable"}}` + "\n"))
						continue
					}
					c.Write([]byte(`{"return": {}}` + "\n"))
				}
			}()
		}
	}()
}

func (f *fakeQMP) commands() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.cmds)
}

func vfioPod(t *testing.T, machine string) (*Pod, *fakeQMP) {
	dir := t.TempDir()
	st := &state{VM: vmInfo{Machine: machine}}
	st.Record(host.Resource{Kind: host.KindDir, Role: roleDir, Path: dir})
	f := &fakeQMP{}
	f.serve(t, filepath.Join(dir, qmpSocketName))
	return &Pod{id: "p", st: st, log: slog.New(slog.DiscardHandler), vfio: &vfioPlugs{}, share: &podShare{}}, f
}

func TestVFIOPassThrough(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, f := vfioPod(t, "q35")
	const ctr = "0123456789abcdef"
	if err := p.plugPCI(ctx, ctr, []string{"0000:01:00.0", "0000:01:00.1"}); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"qmp_capabilities ",
		`device_add {"driver":"vfio-pci","host":"0000:01:00.0","id":"vfio-0123456789ab-0"}`,
		`device_add {"driver":"vfio-pci","host":"0000:01:00.1","id":"vfio-0123456789ab-1"}`,
	}
	if got := f.commands(); !slices.Equal(got, want) {
		t.Errorf("QMP commands:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	p.unplugPCI(t.Context(), ctr)
	got := f.commands()[len(want):]
	if !slices.Equal(got, []string{"qmp_capabilities ", `device_del {"id":"vfio-0123456789ab-0"}`, `device_del {"id":"vfio-0123456789ab-1"}`}) {
		t.Errorf("unplug: %v", got)
	}

	// A device qemu refuses: FailedPrecondition with qemu's reason, and
	// the ones plugged before it are unplugged.
	p, f = vfioPod(t, "q35")
	f.fail = "0000:02:00.0"
	err := p.plugPCI(ctx, "c2", []string{"0000:02:00.1", "0000:02:00.0"})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "not viable") {
		t.Errorf("a device qemu refuses: %v", err)
	}
	if got := f.commands(); got[len(got)-1] != `device_del {"id":"vfio-c2-0"}` {
		t.Errorf("the device plugged before the refusal is not unplugged: %v", got)
	}

	// A microvm has no PCI bus.
	p, f = vfioPod(t, "microvm")
	err = p.plugPCI(ctx, "c3", []string{"0000:01:00.0"})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "kvm.machine: q35") {
		t.Errorf("a microvm: %v, want FailedPrecondition naming the option", err)
	}
	if got := f.commands(); len(got) != 0 {
		t.Errorf("a microvm's QMP was sent %v", got)
	}
}
