package guest

import (
	"maps"
	"strings"
	"testing"
)

func TestCmdline(t *testing.T) {
	in := "console=ttyS0 stagelet.port=p0 stagelet.fs=fs stagelet.hostname=h stagelet.mac=02:00:00:00:00:01 " +
		"stagelet.ip=10.1.0.5/16 stagelet.ip=fd00::5/64 stagelet.route=0.0.0.0/0,10.1.0.1 stagelet.route=10.2.0.0/16, " +
		"stagelet.mtu=1400 stagelet.loglevel=debug -- agent guest stagelet.port=ignored"
	c, err := ParseCmdline(in)
	if err != nil {
		t.Fatal(err)
	}
	if c.Port != "p0" || c.FSTag != "fs" || c.Hostname != "h" || c.MAC.String() != "02:00:00:00:00:01" ||
		len(c.IPs) != 2 || len(c.Routes) != 2 || c.Routes[1].Gw.IsValid() || c.MTU != 1400 || c.Probe {
		t.Fatalf("parsed %+v", c)
	}
	again, err := ParseCmdline(joinWords(c.Cmdline()))
	if err != nil || again.Port != c.Port || again.Routes[0] != c.Routes[0] || again.IPs[1] != c.IPs[1] || again.LogLevel != c.LogLevel {
		t.Errorf("round trip: %+v, %v", again, err)
	}
	if _, err := ParseCmdline("stagelet.ip=nonsense"); err == nil {
		t.Error("bad ip accepted")
	}
	tpl, err := ParseCmdline(joinWords((&Config{Port: "p", Template: true, FSTag: "fs", FSType: FSVirtio9P}).Cmdline()))
	if err != nil || !tpl.Template || tpl.FSType != FSVirtio9P {
		t.Errorf("template and fstype round trip: %+v, %v", tpl, err)
	}
	if _, err := ParseCmdline("stagelet.fstype=ext4"); err == nil {
		t.Error("unknown fstype accepted")
	}
	if d, _ := ParseCmdline(""); d.Port != DefaultPort {
		t.Errorf("default port %q", d.Port)
	}
}

func joinWords(w []string) string {
	s := ""
	for _, x := range w {
		s += x + " "
	}
	return s
}

func TestCmdlineUserNS(t *testing.T) {
	c, err := ParseCmdline(joinWords((&Config{UserNSHost: 65536, UserNSSize: 65536}).Cmdline()))
	if err != nil || c.UserNSHost != 65536 || c.UserNSSize != 65536 {
		t.Fatalf("round trip: %+v, %v", c, err)
	}
	if c, _ := ParseCmdline("stagelet.port=p"); c.UserNSSize != 0 {
		t.Errorf("no userns parameter gives a mapping: %+v", c)
	}
	for _, bad := range []string{"stagelet.userns=65536", "stagelet.userns=0:65536", "stagelet.userns=1:0", "stagelet.userns=4294967295:2", "stagelet.userns=x:1"} {
		if _, err := ParseCmdline(bad); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

func TestCmdlineSysctls(t *testing.T) {
	in := map[string]string{"net.ipv4.ip_local_port_range": "20000 21000", "net.core.somaxconn": "1024"}
	words := (&Config{Sysctls: in}).Cmdline()
	for _, w := range words {
		if strings.ContainsAny(w, " \t") {
			t.Errorf("parameter %q holds a space", w)
		}
	}
	c, err := ParseCmdline(joinWords(words))
	if err != nil || !maps.Equal(c.Sysctls, in) {
		t.Fatalf("round trip: %v, %v; want %v", c.Sysctls, err, in)
	}
	for _, bad := range []string{"stagelet.sysctl=kernel.shmmax=1", "stagelet.sysctl=net.x", "stagelet.sysctl=netx=1", "stagelet.sysctl=net.x=%zz"} {
		if _, err := ParseCmdline(bad); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}
