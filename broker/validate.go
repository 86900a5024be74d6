package broker

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"unicode"

	"github.com/stagelet/stagelet/errdefs"
)

// Limits of what a pod or container may ask for, checked before anything
// is created, so that input no kernel or agent accepts is refused as
// InvalidArgument naming the field instead of failing later.
const (
	// maxHostname is the kernel's HOST_NAME_MAX.
	maxHostname = 64
	// maxName bounds metadata names, namespaces and UIDs: a Kubernetes
	// object name is at most 253 characters (a DNS subdomain).
	maxName = 253
	// MinMemoryLimit is the smallest memory limit a container may have: a
	// container's setup (the agent's init, then the command) runs inside
	// the limit, and below this it is killed before the command starts.
	// CRI-O refuses below the same figure.
	MinMemoryLimit = 12 << 20
	// The CFS bandwidth bounds the kernel accepts, in microseconds.
	minCPUQuota  = 1000
	minCPUPeriod = 1000
	maxCPUPeriod = 1000000
)

// checkNoNUL refuses a NUL byte in any string of v (a config struct),
// naming the field by its path from root (config.envs[2].value). No
// string with a NUL can reach a path, an argument or the environment of a
// process, so such a config can only fail later.
func checkNoNUL(root string, v any) error {
	return walkStrings(root, reflect.ValueOf(v), func(field, s string) error {
		if strings.IndexByte(s, 0) >= 0 {
			return errdefs.InvalidArgument("%s: contains a NUL byte", field)
		}
		return nil
	})
}

// walkStrings calls fn with every string reachable from v and its path.
func walkStrings(path string, v reflect.Value, fn func(field, s string) error) error {
	switch v.Kind() {
	case reflect.String:
		return fn(path, v.String())
	case reflect.Pointer, reflect.Interface:
		if v.IsNil() {
			return nil
		}
		return walkStrings(path, v.Elem(), fn)
	case reflect.Struct:
		t := v.Type()
		for i := range t.NumField() {
			f := t.Field(i)
			if !f.IsExported() {
				continue
			}
			if err := walkStrings(path+"."+fieldName(f), v.Field(i), fn); err != nil {
				return err
			}
		}
	case reflect.Slice, reflect.Array:
		if v.Type().Elem().Kind() == reflect.Uint8 {
			return nil // bytes, not text
		}
		for i := range v.Len() {
			if err := walkStrings(fmt.Sprintf("%s[%d]", path, i), v.Index(i), fn); err != nil {
				return err
			}
		}
	case reflect.Map:
		iter := v.MapRange()
		for iter.Next() {
			k := iter.Key()
			if err := walkStrings(path+" key", k, fn); err != nil {
				return err
			}
			if err := walkStrings(fmt.Sprintf("%s[%q]", path, fmt.Sprint(k.Interface())), iter.Value(), fn); err != nil {
				return err
			}
		}
	}
	return nil
}

// fieldName is a struct field's name as the CRI spells it: its JSON name
// in snake case.
func fieldName(f reflect.StructField) string {
	name := f.Name
	if tag, _, _ := strings.Cut(f.Tag.Get("json"), ","); tag != "" && tag != "-" {
		name = tag
	}
	var b strings.Builder
	for i, r := range name {
		if unicode.IsUpper(r) {
			if i > 0 && !unicode.IsUpper(rune(name[i-1])) {
				b.WriteByte('_')
			}
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}

// CheckCommand refuses an exec command no process can be given: empty, or
// holding a NUL byte (field is the request's, "cmd").
func CheckCommand(field string, cmd []string) error {
	if len(cmd) == 0 || cmd[0] == "" {
		return errdefs.InvalidArgument("%s: must not be empty", field)
	}
	return checkNoNUL(field, cmd)
}

// checkResources refuses limits the kernel would not take, naming the
// field beneath field (config.linux.resources, say).
func checkResources(field string, r *Resources) error {
	if r == nil {
		return nil
	}
	switch q := r.CPUQuota; {
	case q < 0 && q != -1:
		return errdefs.InvalidArgument("%s.cpu_quota: %d is negative (-1 means no limit)", field, q)
	case q > 0 && q < minCPUQuota:
		return errdefs.InvalidArgument("%s.cpu_quota: %dµs is below the kernel's minimum of %dµs", field, q, minCPUQuota)
	}
	if p := r.CPUPeriod; p != 0 && (p < minCPUPeriod || p > maxCPUPeriod) {
		return errdefs.InvalidArgument("%s.cpu_period: %dµs is outside the kernel's range %d–%dµs", field, p, minCPUPeriod, maxCPUPeriod)
	}
	if r.CPUShares < 0 {
		return errdefs.InvalidArgument("%s.cpu_shares: %d is negative", field, r.CPUShares)
	}
	switch m := r.MemoryLimit; {
	case m < 0:
		return errdefs.InvalidArgument("%s.memory_limit_in_bytes: %d is negative", field, m)
	case m > 0 && m < MinMemoryLimit:
		return errdefs.InvalidArgument("%s.memory_limit_in_bytes: %d bytes is below the minimum of %d (12 MiB)", field, m, MinMemoryLimit)
	}
	if a := r.OOMScoreAdj; a < -1000 || a > 1000 {
		return errdefs.InvalidArgument("%s.oom_score_adj: %d is outside -1000–1000", field, a)
	}
	for _, f := range []struct{ name, v string }{{"cpuset_cpus", r.CpusetCpus}, {"cpuset_mems", r.CpusetMems}} {
		if err := checkCPUList(f.v); err != nil {
			return errdefs.InvalidArgument("%s.%s: %q: %w", field, f.name, f.v, err)
		}
	}
	return nil
}

// maxCPUListID bounds a CPU or memory node number in a cpuset list (the
// kernel's own limit, NR_CPUS, is at most 8192).
const maxCPUListID = 8192

// checkCPUList checks a cpuset list as the kernel reads it: numbers and
// ascending ranges separated by commas ("0-3,6"); empty means none given.
func checkCPUList(s string) error {
	if s == "" {
		return nil
	}
	for _, part := range strings.Split(s, ",") {
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil || a < 0 || a >= maxCPUListID || lo != strconv.Itoa(a) {
			return fmt.Errorf("%q is not a CPU number", lo)
		}
		if !isRange {
			continue
		}
		z, err := strconv.Atoi(hi)
		if err != nil || z < 0 || z >= maxCPUListID || hi != strconv.Itoa(z) {
			return fmt.Errorf("%q is not a CPU number", hi)
		}
		if z < a {
			return fmt.Errorf("range %s is descending", part)
		}
	}
	return nil
}

// checkPodInput refuses pod input no kernel or agent takes: NUL bytes,
// names and a hostname beyond their limits, impossible pod limits.
func checkPodInput(c *PodConfig) error {
	if err := checkNoNUL("config", c); err != nil {
		return err
	}
	for _, f := range []struct{ name, v string }{
		{"config.metadata.name", c.Metadata.Name},
		{"config.metadata.namespace", c.Metadata.Namespace},
		{"config.metadata.uid", c.Metadata.UID},
	} {
		if len(f.v) > maxName {
			return errdefs.InvalidArgument("%s: %d characters, more than %d", f.name, len(f.v), maxName)
		}
	}
	if len(c.Hostname) > maxHostname {
		return errdefs.InvalidArgument("config.hostname: %d characters, more than the kernel's %d", len(c.Hostname), maxHostname)
	}
	if c.Resources != nil && (c.Resources.CpusetCpus != "" || c.Resources.CpusetMems != "") {
		return errdefs.InvalidArgument("config.linux.resources.cpuset_cpus, cpuset_mems: a cpuset is a container's, not a pod's")
	}
	if o := c.Overhead; o != nil && (o.MemoryLimit < 0 || o.CPUQuota < -1 || o.CPUShares < 0) {
		return errdefs.InvalidArgument("config.linux.overhead: %+v: negative", *o)
	}
	return checkResources("config.linux.resources", c.Resources)
}

// checkContainerInput is checkPodInput for a container.
func checkContainerInput(c *ContainerConfig) error {
	if err := checkNoNUL("config", c); err != nil {
		return err
	}
	if len(c.Metadata.Name) > maxName {
		return errdefs.InvalidArgument("config.metadata.name: %d characters, more than %d", len(c.Metadata.Name), maxName)
	}
	return checkResources("config.linux.resources", &c.Resources)
}
