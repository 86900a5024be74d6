package kvm

import "testing"

func TestFreeTarget(t *testing.T) {
	full := &diskRecord{}
	for i := range maxSCSITarget + 1 {
		full.Disks = append(full.Disks, PluggedDisk{Target: i})
	}
	for _, c := range []struct {
		name string
		r    *diskRecord
		want int
		ok   bool
	}{
		{"empty", &diskRecord{}, 0, true},
		{"round from next", &diskRecord{Next: 5}, 5, true},
		{"skips taken", &diskRecord{Next: 1, Disks: []PluggedDisk{{Target: 1}, {Target: 2}}}, 3, true},
		{"wraps", &diskRecord{Next: maxSCSITarget, Disks: []PluggedDisk{{Target: maxSCSITarget}}}, 0, true},
		{"full", full, 0, false},
	} {
		got, ok := freeTarget(c.r)
		if got != c.want || ok != c.ok {
			t.Errorf("%s: freeTarget = %d, %v; want %d, %v", c.name, got, ok, c.want, c.ok)
		}
	}
}

func TestDiskIDsAndSerial(t *testing.T) {
	node, dev := diskIDs(7)
	if node != "imgdisk7" || dev != "imgdisk7-dev" {
		t.Errorf("diskIDs(7) = %s, %s", node, dev)
	}
	if s := diskSerial("0123456789abcdef0123456789abcdef"); s != "0123456789abcdef0123" {
		t.Errorf("diskSerial = %s", s)
	}
}
