// Package bindopts reads the type and options of an OCI bind mount, as
// plugins and specs outside the CRI give them (NRI adjustments, CDI
// specs), into the flags the agent's mounts have. What the agent cannot
// make (another file system type, an option it has no flag for) is an
// error wrapping ErrUnsupported; the caller gives it its class.
package bindopts

import (
	"errors"
	"fmt"
)

// ErrUnsupported: the mount is not a bind mount, or has an option the
// agent cannot honour.
var ErrUnsupported = errors.New("unsupported")

// Flags are a bind mount's options as the agent makes them.
type Flags struct {
	Readonly bool
	// RecursiveReadonly: the mounts beneath the source are read-only too
	// ("rro"); it implies Readonly.
	RecursiveReadonly bool
	NoSuid            bool
	NoDev             bool
	NoExec            bool
	// Propagation is "" (private), "rslave" or "rshared".
	Propagation string
}

// Parse reads a mount of type typ ("bind", or "" or "none" with a "bind"
// or "rbind" option) with options, later options overriding earlier
// ones as mount(8) reads them.
func Parse(typ string, options []string) (Flags, error) {
	var f Flags
	bind := typ == "bind"
	switch typ {
	case "bind", "", "none":
	default:
		return f, fmt.Errorf("type %q: only bind mounts are made: %w", typ, ErrUnsupported)
	}
	for _, o := range options {
		switch o {
		case "bind", "rbind":
			bind = true
		case "ro":
			f.Readonly = true
		case "rro":
			f.Readonly, f.RecursiveReadonly = true, true
		case "rw":
			f.Readonly, f.RecursiveReadonly = false, false
		case "nosuid":
			f.NoSuid = true
		case "nodev":
			f.NoDev = true
		case "noexec":
			f.NoExec = true
		case "suid":
			f.NoSuid = false
		case "dev":
			f.NoDev = false
		case "exec":
			f.NoExec = false
		case "private", "rprivate":
			f.Propagation = ""
		case "slave", "rslave":
			f.Propagation = "rslave"
		case "shared", "rshared":
			f.Propagation = "rshared"
		default:
			return f, fmt.Errorf("option %q (bind mount options only): %w", o, ErrUnsupported)
		}
	}
	if !bind {
		return f, fmt.Errorf("type %q without a bind option: only bind mounts are made: %w", typ, ErrUnsupported)
	}
	return f, nil
}
