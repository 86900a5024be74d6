package supervisor_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/seccomp"
)

// describeExec prints what an exec'd command was given: its credentials,
// capability sets, no_new_privs and filter, signal mask and ignored
// signals, CPUs, umask and file limits, whether each namespace and its
// cgroups are its app's (the app is PID 1 of its PID namespace), its
// session, directory, environment and open descriptors.
const describeExec = `grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp|Seccomp_filters|SigBlk|SigIgn|Cpus_allowed_list):' /proc/self/status
echo "umask $(umask), files $(ulimit -n)/$(ulimit -Hn)"
for n in mnt uts pid ipc net cgroup; do
	if [ "$(readlink /proc/self/ns/$n)" = "$(readlink /proc/1/ns/$n)" ]; then echo "$n: the app's"; else echo "$n: other"; fi
done
if [ "$(cat /proc/self/cgroup)" = "$(cat /proc/1/cgroup)" ]; then echo "cgroups: the app's"; else echo "cgroups: other"; fi
read -r pid _ _ _ _ sid _ </proc/self/stat
[ "$pid" = "$sid" ] && echo "session leader"
pwd
env | sort
ls /proc/self/fd
`

// directLog is what the agent logs (at debug) when it starts an exec's
// command from its own thread.
const directLog = "exec started from the agent's thread"

// TestExecPathsAgree: a command started straight from the agent gets what
// one started through `agent exec-init` gets. The agents hold their
// capabilities in their inheritable set too, as under systemd-nspawn,
// where a root command would otherwise gain them all through execve.
func TestExecPathsAgree(t *testing.T) {
	t.Setenv(inheritableEnv, "1")
	direct, viaInit := startAgent(t), startAgentAs(t, false, "--exec-init")
	defaultProfile := seccomp.RuntimeDefault(broker.DefaultCapabilities...)
	for _, tc := range []struct {
		name string
		spec api.AppSpec
	}{
		{"root", api.AppSpec{Capabilities: broker.DefaultCapabilities}},
		{"user", api.AppSpec{UID: 1000, GID: 1000, AdditionalGIDs: []uint32{2000, 3000}, NoNewPrivs: true, Cwd: "/tmp",
			Capabilities: broker.DefaultCapabilities, Env: []string{"A=1", "PATH=/bin"}}},
		{"runtime-default", api.AppSpec{Capabilities: broker.DefaultCapabilities, Seccomp: defaultProfile, SeccompProfile: "runtime/default"}},
		{"user-runtime-default", api.AppSpec{UID: 1000, GID: 1000, Seccomp: defaultProfile, SeccompProfile: "runtime/default", NoNewPrivs: true}},
		{"sysadmin", api.AppSpec{Capabilities: append([]string{"CAP_SYS_ADMIN"}, broker.DefaultCapabilities...), Hostname: "own"}},
		{"privileged", api.AppSpec{Privileged: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out [2]string
			for i, ta := range []*testAgent{direct, viaInit} {
				spec := tc.spec
				spec.ID = fmt.Sprintf("%s-%d", tc.name, i)
				spec.Rootfs = makeRootfs(t)
				spec.Args = []string{"sleep", "1000"}
				spec.PIDNamespace = api.PIDNamespaceContainer
				ta.run(&spec)
				res := ta.exec(spec.ID, "sh", "-c", describeExec)
				if res.ExitCode != 0 {
					t.Fatalf("agent %d: exec: %+v (stderr %s)", i, res, res.Stderr)
				}
				out[i] = string(res.Stdout)
				// Only the app's process is left in its cgroup: the
				// thread that forked the command moved out of it.
				for k, dir := range ta.cg.Child("app-" + spec.ID).Paths {
					if k == cgroups.Unified {
						continue
					}
					b, err := os.ReadFile(filepath.Join(dir, "tasks"))
					if err != nil {
						t.Fatal(err)
					}
					if tasks := strings.Fields(string(b)); len(tasks) != 1 {
						t.Errorf("agent %d: %s tasks after the exec: %v, want the app's alone", i, k, tasks)
					}
				}
			}
			if out[0] != out[1] {
				t.Errorf("started directly:\n%s\nthrough exec-init:\n%s", out[0], out[1])
			}
			for _, want := range []string{"mnt: the app's", "uts: the app's", "pid: the app's", "cgroups: the app's", "session leader"} {
				if !strings.Contains(out[0], want) {
					t.Errorf("%q missing:\n%s", want, out[0])
				}
			}
			if !strings.Contains(out[0], "CapInh:\t0000000000000000") {
				t.Errorf("a non-empty inheritable set:\n%s", out[0])
			}
			if tc.spec.Seccomp != nil && !strings.Contains(out[0], "Seccomp:\t2") {
				t.Errorf("no filter:\n%s", out[0])
			}
		})
	}
	if !strings.Contains(direct.logs.String(), directLog) {
		t.Errorf("the first agent started no command directly")
	}
	if strings.Contains(viaInit.logs.String(), directLog) {
		t.Errorf("the agent with --exec-init started a command directly")
	}
}

// TestExecFilterGate: an app whose filter would stop a call of the direct
// path (here the child's setuid, by killing the process: had the filter
// been on one of the agent's threads, a call of the agent could as well
// have been stopped) has its execs started through exec-init, which
// installs it after the credentials (no_new_privs).
func TestExecFilterGate(t *testing.T) {
	ta := startAgent(t)
	p, err := seccomp.Parse([]byte(`{"defaultAction": "SCMP_ACT_ALLOW",
		"syscalls": [{"names": ["setuid"], "action": "SCMP_ACT_KILL_PROCESS"},
			{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}`))
	if err != nil {
		t.Fatal(err)
	}
	spec := api.AppSpec{ID: "gate", Rootfs: makeRootfs(t), Args: []string{"sleep", "1000"}, NoNewPrivs: true,
		Capabilities: broker.DefaultCapabilities, Seccomp: p, SeccompProfile: "localhost/gate.json"}
	ta.run(&spec)
	res := ta.exec("gate", "mkdir", "/tmp/x")
	if res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "Operation not permitted") {
		t.Errorf("exec mkdir under the filter: %+v", res)
	}
	if res := ta.exec("gate", "true"); res.ExitCode != 0 {
		t.Errorf("exec true: %+v", res)
	}
	if strings.Contains(ta.logs.String(), directLog) {
		t.Errorf("an exec under a filter that kills on setuid was started directly")
	}
}
