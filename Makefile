GO      ?= go
BIN     := bin/stagelet
# The release this tree leads to, with git's description as build
# metadata: the kubelet parses a runtime's version (major.minor at least)
# and shows "Unknown" for one it cannot parse.
RELEASE := 0.1.0
VERSION := $(RELEASE)+$(shell git describe --always --dirty 2>/dev/null || echo dev)
# -s -w: no symbol table or DWARF (panics still name functions). The
# binary is every kvm guest's initramfs too: 30% smaller, it boots faster
# under TCG and fits a 128 MiB VM.
LDFLAGS := -s -w -X main.version=$(VERSION)

.PHONY: all build guest deb run deps test-deps test unit e2e conformance bench fuzz race lint clean systemd-testbed test-systemd test-node test-node-selinux node-e2e test-cluster

all: build guest

# One static binary: the daemon, the pod agent and the operator tools.
# Without the NRI library's WebAssembly runtime (nri_no_wasm): 2.6 MB less
# in every pod and VM, and no WASM plugins (executables only).
BUILDTAGS := nri_no_wasm
build:
	CGO_ENABLED=0 $(GO) build -trimpath -tags $(BUILDTAGS) -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/stagelet

# What running and building need (make run installs no more).
deps:
	./scripts/install-deps.sh

# What only the tests use besides: containerd and runc (the reference the
# side-by-side test compares with), OpenJDK 17's runtime (the JVM test
# image) and cosign (the signature tests).
test-deps: deps
	./scripts/install-test-deps.sh

# The kvm stage1's guest: a kernel built from Debian's kernel source with
# guest/kernel.config (cached in /var/cache/stagelet-guest-kernel, built
# again only when its inputs change) and an initramfs whose /init is the
# stagelet binary just built. The daemon finds it beside its binary
# (bin/guest).
GUEST_DIR ?= bin/guest
guest: deps build
	./guest/build.sh $(BIN) $(GUEST_DIR)

# The Debian package, bin/stagelet_<DEB_VERSION>_amd64.deb (DEB_DIR),
# built with dpkg-deb (scripts/deb.sh): the binary, the service, a
# commented /etc/stagelet/config.yaml, the kvm guest and the SELinux
# module's source. DEB_VERSION is a pre-release of RELEASE that grows with
# the commits ("~" sorts before the release itself); a package built from
# a tree with changes says so.
DEB_VERSION ?= $(RELEASE)~git$(shell git rev-list --count HEAD 2>/dev/null || echo 0).g$(shell git rev-parse --short HEAD 2>/dev/null || echo 0)$(shell git diff --quiet HEAD 2>/dev/null || echo .dirty)
DEB_DIR     ?= bin
deb: deps build
	./scripts/deb.sh $(BIN) $(DEB_VERSION) $(DEB_DIR)

# Runs the CRI daemon with the embedded default configuration (root),
# after installing a default pod network if the node has none.
POD_SUBNET ?= 10.88.0.0/16
run: deps build guest
	./$(BIN) cni init --subnet $(POD_SUBNET)
	./$(BIN) serve

# The whole suite: vet, unit tests, and as root the backend and end-to-end
# tests (they skip, saying why, without root); and the scripts' own tests
# (scripts/*_test.py).
SCRIPT_TESTS = python3 -B -m unittest discover -s scripts -p '*_test.py'
test: test-deps lint guest
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) test -count=1 -timeout 40m ./...
	$(SCRIPT_TESTS)

unit:
	$(GO) test -count=1 -short ./...
	$(SCRIPT_TESTS)

e2e: test-deps guest
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) test -count=1 -timeout 30m -v ./test/e2e/...

# The CRI conformance suite (critest, from the kit in ../shared/conformance)
# against the binary just built, once per stage1: nspawn (the node
# default), fly and kvm. It fails when a spec fails that
# test/conformance/expected-failures.txt does not list, or passes that it
# lists (unless marked may-pass); without the kit it says so and passes.
# REGISTRY is the kit's registry address: give each concurrent run its own.
CONFORMANCE_KIT ?= ../shared/conformance
REGISTRY        ?= 127.0.0.1:5055
conformance: deps build guest
	KIT=$(CONFORMANCE_KIT) REGISTRY=$(REGISTRY) GUEST=$(GUEST_DIR) POD_SUBNET=$(POD_SUBNET) ./scripts/conformance.sh $(BIN)

# The kubelet's node conformance suite ([NodeConformance] of
# test/e2e_node, Kubernetes v1.34.12) with the kit in ../shared/nodee2e,
# once per stage1 in STAGE1S: the suite starts etcd, the API server and a
# real kubelet on this host against the binary just built. It fails when a
# spec fails that test/node-e2e/expected-failures.txt does not list, or
# passes that it lists (unless marked may-pass); without the kit it says so
# and passes. The kit's Kubernetes binaries are built once (15-40 minutes
# cold) and cached in /var/cache. SERIAL=1 runs the
# [Serial] specs instead. POLICY=default runs each stage1 as the default
# of the embedded default policy, instead of a policy that puts every pod
# on it. One run per host at a time (fixed ports).
STAGE1S ?= nspawn fly kvm
POLICY ?=
NODEE2E_KIT ?= ../shared/nodee2e
node-e2e: deps build guest
	KIT=$(NODEE2E_KIT) STAGE1S="$(STAGE1S)" POLICY="$(POLICY)" GUEST=$(GUEST_DIR) ./scripts/node-e2e.sh $(BIN)

# stagelet as one node of many: a Kubernetes cluster on this machine, the
# control plane on the host and two nodes booted with systemd-nspawn from a
# Debian 12 tree, each running stagelet and a kubelet as systemd services,
# kube-proxy, the pod network and CoreDNS as pods (test/cluster). The
# Kubernetes binaries, coredns and the tree are built once and cached in
# /var/cache (scripts/cluster-build.sh).
test-cluster: test-deps build guest
	./scripts/test-cluster.sh $(BIN) $(GUEST_DIR)

# The Debian tree (debootstrap, a few minutes the first time) that the
# systemd launcher's tests boot with systemd-nspawn -b; they skip without
# it. TESTBED overrides where it goes.
TESTBED ?= $(or $(STAGELET_TEST_SYSTEMD_ROOT),/var/tmp/stagelet-systemd-testbed)
systemd-testbed: deps
	./scripts/systemd-testbed.sh $(TESTBED)

# The systemd launcher against a booted systemd (root).
test-systemd: systemd-testbed
	STAGELET_TEST_SYSTEMD_ROOT=$(TESTBED) $(GO) test -count=1 -v -run 'Systemd' ./stage1/host/ ./stage1/fly/

# stagelet on a node as Kubernetes nodes run it: a Debian 12 VM with
# systemd as PID 1 and pure cgroup v2, booted under qemu, running the
# service of contrib/systemd/stagelet.service under both cgroup drivers,
# then critest (scripts/test-node.sh; the image is cached after the first
# build).
test-node: test-deps build guest
	GUEST=$(GUEST_DIR) ./scripts/test-node.sh $(BIN)

# The same VM's SELinux variant: Debian's reference policy enforcing, with
# contrib/selinux's module; TestSELinux (test/node) on nspawn and fly,
# then critest, with no SELinux denial while it runs.
test-node-selinux: test-deps build guest
	NODE_VARIANT=selinux GUEST=$(GUEST_DIR) ./scripts/test-node.sh $(BIN)

# Speed and memory figures: Go benchmarks and the end-to-end bench command,
# with containerd and runc beside it where they are installed
# (scripts/bench-containerd.sh: apt-get install containerd runc), each
# run's medians beside containerd's and the previous figures
# (test/bench/), and saved in $(BENCH_OUT); the status-path calls of
# stagelet and containerd side by side at 50 and 100 pods, in the same
# rounds (--beside). The last run starts kvm pods
# with a 64 MiB limit in cgroups the kubelet's size, without RuntimeClass
# overhead (their qemu in the overhead cgroup). On fly, pod start with
# NRI on (the default config, no plugin) and with one no-op plugin is
# set against NRI off (targets: 1.02x and 1.1x; single runs on a busy
# machine vary more than that). Last, a 256 MiB kvm pod's move beside
# CRIU's container move on nspawn, in the same run.
BENCH_OUT ?= $(CURDIR)/bin/bench
bench: test-deps build guest
	$(GO) test -run '^$$' -bench . -benchtime 20x ./image/ ./agent/supervisor/ ./network/ ./stage1/nspawn/
	$(GO) test -run '^$$' -bench . -benchtime 2000x ./nri/
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) test -run '^$$' -bench . -benchtime 10x ./stage1/kvm/
	mkdir -p $(BENCH_OUT)
	./scripts/bench-containerd.sh -n 10 -save $(BENCH_OUT)/containerd.tsv -against previous=$(CURDIR)/test/bench/containerd.tsv
	$(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 fly -nri off -save $(BENCH_OUT)/fly-nri-off.tsv
	$(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 fly -save $(BENCH_OUT)/fly.tsv -against nri-off=$(BENCH_OUT)/fly-nri-off.tsv
	$(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 fly -nri noop -against nri-off=$(BENCH_OUT)/fly-nri-off.tsv
	$(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 fly -signature-policy -against nopolicy=$(BENCH_OUT)/fly.tsv
	$(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 fly -podnet -save $(BENCH_OUT)/fly-podnet.tsv \
		-against containerd=$(BENCH_OUT)/containerd.tsv -against previous=test/bench/fly-podnet.tsv
	$(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 nspawn -podnet -n 10 -save $(BENCH_OUT)/nspawn-podnet.tsv \
		-against containerd=$(BENCH_OUT)/containerd.tsv -against previous=test/bench/nspawn-podnet.tsv
	$(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 nspawn -scale 10,50,100
	./scripts/bench-containerd.sh --beside -bin $(BIN) -stage1 fly -scale 50,100 -calls 500
	./scripts/bench-containerd.sh --beside -bin $(BIN) -stage1 nspawn -scale 50,100 -calls 500
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 kvm -podnet -n 10 -save $(BENCH_OUT)/kvm-podnet.tsv \
		-against nspawn=$(BENCH_OUT)/nspawn-podnet.tsv -against previous=test/bench/kvm-podnet.tsv
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 kvm -podnet -n 10 -notemplate
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 kvm -podnet -n 10 -memory-limit 64
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 kvm -podnet -n 10 -no-image-disks
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 kvm -podnet -fileio -n 3
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) run ./cmd/stagelet-bench -bin $(BIN) -stage1 kvm -podnet -fileio -n 3 -no-image-disks
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) $(GO) run ./cmd/stagelet-bench -bin $(BIN) -move -podnet -n 3 -save $(BENCH_OUT)/move.tsv

# The data race detector on the packages where goroutines meet: the
# broker, the CRI server, policy, the stage1s and the agent. The race
# runtime needs cgo (gcc); the binaries the tests build stay static.
RACE_PKGS = ./broker/... ./cri/... ./policy/... ./stage1/... ./agent/...
race: test-deps guest
	STAGELET_GUEST_ASSETS=$(abspath $(GUEST_DIR)) CGO_ENABLED=1 $(GO) test -race -count=1 -timeout 20m $(RACE_PKGS)

# Each fuzz target briefly; the corpora in the packages' testdata/fuzz
# also run as plain tests in `make test`. Root: the layer unpacker is
# fuzzed with the privileges it runs with. Budgets are counts of runs
# (about five seconds each here), not durations: go 1.26's coordinator can
# report its own -fuzztime deadline as a failure of the target
# (golang/go#75804). FUZZTIME=30s (or 1000x) overrides every target's
# budget. Minimising a new input is kept short: at go's default of 60s a
# slow target spends its whole budget minimising the first input it finds.
FUZZTIME ?=
FUZZMINIMIZETIME ?= 1s
FUZZ_TARGETS = ./policy/:FuzzParse:50000x ./policy/:FuzzDecide:100000x ./config/:FuzzParse:12000x \
	./cri/:FuzzRequestConversion:20000x ./image/:FuzzUnpackLayer:1500x
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; rest=$${t#*:}; name=$${rest%%:*}; budget=$(if $(FUZZTIME),$(FUZZTIME),$${rest#*:}); \
		echo "fuzz $$pkg $$name for $$budget"; \
		$(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime $$budget -fuzzminimizetime $(FUZZMINIMIZETIME) "$$pkg"; \
	done

# gofmt, go.mod and go.sum as `go mod tidy` leaves them, vet,
# staticcheck (pinned; fetched through the module proxy the first time)
# and stagelet-lint (no dropped error of fsync, syncfs, rename, mount or
# unmount outside tests).
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) mod tidy -diff
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	$(GO) run ./cmd/stagelet-lint -test=false ./...

clean:
	rm -rf bin
