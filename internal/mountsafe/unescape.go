package mountsafe

import (
	"strconv"
	"strings"
)

// Unescape undoes the kernel's octal escapes in a path of
// /proc/*/mountinfo (\040 for a space, \011 a tab, \134 a backslash); a
// backslash not followed by three octal digits stays as it is.
func Unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
