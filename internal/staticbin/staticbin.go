// Package staticbin tells whether an executable is statically linked: the
// stagelet binary runs as the agent inside pods whose root holds nothing
// but that binary (an nspawn container's stage1 tree, a VM's initramfs),
// where no dynamic loader or C library exists.
package staticbin

import (
	"debug/elf"
	"fmt"
	"strings"
)

// Check returns nil when the ELF executable at path needs no program
// interpreter (no PT_INTERP program header: a static executable, static
// PIE included), and an error naming the interpreter otherwise. The
// program headers are what the kernel reads to start the binary, so this
// is the same test execve makes, independent of how the binary was built.
func Check(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		interp := make([]byte, p.Filesz)
		if _, err := p.ReadAt(interp, 0); err != nil {
			return fmt.Errorf("%s is dynamically linked (its interpreter cannot be read: %v)", path, err)
		}
		return fmt.Errorf("%s is dynamically linked (interpreter %s)", path, strings.TrimRight(string(interp), "\x00"))
	}
	return nil
}
