package testutil

import "strings"

// LogField is the value of key=value in a line of the daemon's log
// (log/slog's text format, an unquoted value); "" when absent.
func LogField(line, key string) string {
	for _, f := range strings.Fields(line) {
		if v, ok := strings.CutPrefix(f, key+"="); ok {
			return v
		}
	}
	return ""
}
