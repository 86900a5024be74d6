package main

import (
	"testing"
	"time"
)

func TestUptimeSpan(t *testing.T) {
	for _, tc := range []struct {
		out  string
		want time.Duration
		err  bool
	}{
		{"12.34 13.59\n", 1250 * time.Millisecond, false},
		{"100.00 100.00", 0, false},
		{"12.34", 0, true},
		{"x 1.0", 0, true},
	} {
		got, err := uptimeSpan(tc.out)
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("uptimeSpan(%q) = %v, %v; want %v, error %v", tc.out, got, err, tc.want, tc.err)
		}
	}
}
