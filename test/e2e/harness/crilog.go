package harness

import (
	"bytes"
	"fmt"
	"strings"
	"time"
)

// LogLine is one line of a CRI container log file:
// "<RFC3339Nano time> <stdout|stderr> <F|P> <content>".
type LogLine struct {
	Time    time.Time
	Stream  string // "stdout" or "stderr"
	Partial bool   // tag P: the content continues on the stream's next line
	Content string
}

// ParseCRILog parses a CRI log file. Every line must be well formed; an
// incomplete last line (no newline yet) is ignored, since the writer may be
// in the middle of it.
func ParseCRILog(data []byte) ([]LogLine, error) {
	var out []LogLine
	for n := 1; len(data) > 0; n++ {
		i := bytes.IndexByte(data, '\n')
		if i < 0 {
			break
		}
		line := string(data[:i])
		data = data[i+1:]
		ts, rest, ok1 := strings.Cut(line, " ")
		stream, rest, ok2 := strings.Cut(rest, " ")
		tag, content, ok3 := strings.Cut(rest, " ")
		if !ok3 && ok2 && (rest == "F" || rest == "P") {
			// An empty line may be written without the separator.
			tag, content, ok3 = rest, "", true
		}
		if !ok1 || !ok2 || !ok3 {
			return out, fmt.Errorf("line %d: want \"TIME STREAM TAG CONTENT\", got %q", n, line)
		}
		t, err := time.Parse(time.RFC3339Nano, ts)
		if err != nil {
			return out, fmt.Errorf("line %d: time: %v", n, err)
		}
		if stream != "stdout" && stream != "stderr" {
			return out, fmt.Errorf("line %d: stream %q is neither stdout nor stderr", n, stream)
		}
		// The tag may carry more ':'-separated fields in future; the first
		// is F or P.
		first, _, _ := strings.Cut(tag, ":")
		if first != "F" && first != "P" {
			return out, fmt.Errorf("line %d: tag %q is neither F nor P", n, tag)
		}
		out = append(out, LogLine{Time: t, Stream: stream, Partial: first == "P", Content: content})
	}
	return out, nil
}

// JoinPartial reassembles the full lines of one stream: partial lines are
// joined to the full line that ends them.
func JoinPartial(lines []LogLine, stream string) []string {
	var out []string
	var cur strings.Builder
	for _, l := range lines {
		if l.Stream != stream {
			continue
		}
		cur.WriteString(l.Content)
		if !l.Partial {
			out = append(out, cur.String())
			cur.Reset()
		}
	}
	if cur.Len() > 0 {
		out = append(out, cur.String())
	}
	return out
}
