package harness

import (
	"slices"
	"testing"
	"time"
)

func TestParseCRILog(t *testing.T) {
	in := "2024-01-02T03:04:05.123456789Z stdout F hello world\n" +
		"2024-01-02T03:04:05.2Z stderr P part one \n" +
		"2024-01-02T03:04:05.3+01:00 stdout F \n" +
		"2024-01-02T03:04:05.4Z stderr F and two\n" +
		"2024-01-02T03:04:05.5Z stdout F\n" +
		"2024-01-02T03:04:05.6Z stdout F incomplete, no newl"
	lines, err := ParseCRILog([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	if len(lines) != 5 {
		t.Fatalf("got %d lines, want 5 (the incomplete last line is left out): %+v", len(lines), lines)
	}
	want0 := LogLine{Time: time.Date(2024, 1, 2, 3, 4, 5, 123456789, time.UTC), Stream: "stdout", Content: "hello world"}
	if !lines[0].Time.Equal(want0.Time) || lines[0].Stream != want0.Stream || lines[0].Partial || lines[0].Content != want0.Content {
		t.Errorf("line 0 = %+v, want %+v", lines[0], want0)
	}
	if !lines[1].Partial || lines[1].Content != "part one " {
		t.Errorf("line 1 = %+v", lines[1])
	}
	if got := JoinPartial(lines, "stderr"); !slices.Equal(got, []string{"part one and two"}) {
		t.Errorf("stderr joined = %q", got)
	}
	if got := JoinPartial(lines, "stdout"); !slices.Equal(got, []string{"hello world", "", ""}) {
		t.Errorf("stdout joined = %q", got)
	}
}

func TestParseCRILogRejectsMalformed(t *testing.T) {
	for _, in := range []string{
		"not-a-time stdout F x\n",
		"2024-01-02T03:04:05Z stdin F x\n",
		"2024-01-02T03:04:05Z stdout X x\n",
		"2024-01-02T03:04:05Z stdout\n",
		"plain text\n",
	} {
		if _, err := ParseCRILog([]byte(in)); err == nil {
			t.Errorf("ParseCRILog(%q) accepted a malformed line", in)
		}
	}
}
