package kvm

import "testing"

// TestTelling: the line naming a failed boot's cause is picked from the
// console: qemu's own complaint first, then the kernel's.
func TestTelling(t *testing.T) {
	for out, want := range map[string]string{
		"booting\nqemu-system-x86_64: ../target/i386/kvm/kvm.c:2935: kvm_buf_set_msrs: Assertion `ret == cpu->kvm_msr_buf->nmsrs' failed.\n": "qemu-system-x86_64: ../target/i386/kvm/kvm.c:2935: kvm_buf_set_msrs: Assertion `ret == cpu->kvm_msr_buf->nmsrs' failed.",
		"[0.1] invalid opcode: 0000 [#1] SMP\n[0.1] RIP: 0010:xsave\nCode=81 31 d2\n":                                                        "[0.1] invalid opcode: 0000 [#1] SMP",
		"KVM internal error. Suberror: 1\nemulation failure\nEAX=0\n":                                                                        "KVM internal error. Suberror: 1",
		"line one\nline two\n": "line two",
	} {
		if got := telling(out); got != want {
			t.Errorf("telling(%q) = %q, want %q", out, got, want)
		}
	}
}
