package client

import (
	"errors"
	"io"
	"math"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// Nothing an agent answers is believed unchecked: the agent runs where
// the pod's guest (a VM's kernel, a compromised pod) controls it. Every
// answer is checked here, where it is decoded, before the daemon acts on
// it, logs it, or hands it to the kubelet. What is out of bounds either
// refuses the answer (the call fails with ErrUnavailable wrapping
// ErrUntrusted: a required part is missing, an app other than the one
// asked about, a state, PID or figure no honest agent sends) or is
// replaced by a value the daemon can stand behind (a text cut and
// cleaned, an exit code out of range, a time in the future). Either is
// told to the client's Refused, by field and reason.
const (
	// MaxResponse bounds one answer's JSON document, in bytes, but
	// OpExec's (MaxExecResponse): a pod's apps and up to
	// tracing.MaxImportSpans spans fit in it many times over.
	MaxResponse = 1 << 20
	// MaxExecResponse bounds an OpExec answer, whose output
	// (api.ExecOutputLimit bytes at most) is base64 in JSON.
	MaxExecResponse = MaxResponse + api.ExecOutputLimit/3*4 + 4
	// MaxEvent bounds one event of an OpEvents stream, in bytes (with
	// what the decoder read ahead of it).
	MaxEvent = 64 << 10
	// EventRate and EventBurst bound the events taken of one stream: a
	// burst of EventBurst (what an agent holds for a subscriber), then
	// EventRate a second. Beyond them the client reads no faster; an
	// agent that cannot send drops the subscriber, which subscribes
	// again to a fresh snapshot.
	EventRate  = 100
	EventBurst = api.EventBuffer
	// MaxApps bounds the apps of one answer (OpList, OpEvents).
	MaxApps = 1024
	// MaxAppID bounds an app's ID; it is a token of letters, digits,
	// '_', '.' and '-'.
	MaxAppID = 128
	// MaxPID is the kernel's largest PID (PID_MAX_LIMIT); a PID is
	// 1..MaxPID.
	MaxPID = 1 << 22
	// MaxFD bounds a file descriptor number (the kernel's nr_open
	// ceiling).
	MaxFD = 1 << 20
	// MaxExitCode: an exit code is 0..255 (128+N for a signal N); one
	// outside is replaced by 255, what the daemon records when the
	// truth about an exit is lost.
	MaxExitCode = 255
	// MaxReason bounds an exit reason, a token of letters and digits
	// ("OOMKilled"); another one is replaced by api.ReasonError.
	MaxReason = 64
	// MaxMessage bounds an app's message, as the kubelet bounds a
	// termination message; MaxError an error's text (a restorer's
	// failure carries its output). Longer ones keep their start and
	// their end, control characters (newlines too) become spaces, bytes
	// that are not UTF-8 become U+FFFD: one line, for logs and the
	// kubelet.
	MaxMessage = 4096
	MaxError   = 8192
	// MaxKernel bounds Info.Kernel (uname's release, 64 bytes).
	MaxKernel = 64
	// MaxClockAhead is how far past the client's clock a time an agent
	// sends may be (a VM's clock may lead a little); a later one, or
	// one before the Unix epoch, is replaced by the time the answer
	// arrived.
	MaxClockAhead = 10 * time.Minute
	// MaxMemoryBytes bounds a memory figure of Stats (1 PiB); every
	// other figure is at most math.MaxInt64 (a negative number sent as
	// unsigned is above it), Pids at most MaxPID, MemoryMajorPageFault
	// at most MemoryPageFaults. Stats beyond are refused whole.
	MaxMemoryBytes = 1 << 50
)

// ErrUntrusted is wrapped by the error of a call whose answer was
// refused (its class is ErrUnavailable).
var ErrUntrusted = errors.New("the agent's answer was refused")

// Fields of the protocol (and reasons) the client tells Refused of.
const (
	FieldSpans    = "spans" // the reasons are tracing.Drop*
	FieldResponse = "response"
	FieldError    = "error"
	FieldInfo     = "info"
	FieldApp      = "app"
	FieldApps     = "apps"
	FieldAppID    = "app.id"
	FieldState    = "app.state"
	FieldPID      = "app.pid"
	FieldExitCode = "app.exitCode"
	FieldReason   = "app.reason"
	FieldMessage  = "app.message"
	FieldAppTime  = "app.time"
	FieldExec     = "exec"
	FieldStats    = "stats"
	FieldRestore  = "restore"
	FieldEvent    = "event"
	FieldEvents   = "events"
	FieldSession  = "session"

	ReasonMissing  = "missing"  // a part the operation answers with is not there
	ReasonMismatch = "mismatch" // about another app than the one asked about
	ReasonInvalid  = "invalid"  // a value the protocol does not have
	ReasonRange    = "range"    // a number out of its range
	ReasonTime     = "time"     // a time out of range
	ReasonLength   = "length"   // a text, list or output too long
	ReasonControl  = "control"  // a text with control characters or bytes that are not UTF-8
	ReasonSize     = "size"     // a document larger than its bound
	ReasonRate     = "rate"     // events faster than EventRate
)

// Refused is told what a client did not take as an agent sent it: a
// field of the protocol (Field*), why (Reason*, or tracing.Drop* for
// FieldSpans) and how many (spans; 1 otherwise). It must return at once.
type Refused func(field, reason string, n int)

// Option configures a Client.
type Option func(*Client)

// OnRefusal makes the client tell f what it refuses of its agent's
// answers.
func OnRefusal(f Refused) Option { return func(c *Client) { c.onRefusal = f } }

func (c *Client) refused(field, reason string, n int) {
	if c.onRefusal != nil && n > 0 {
		c.onRefusal(field, reason, n)
	}
}

// refuse is the error of an answer that cannot be taken, told to Refused.
func (c *Client) refuse(op, field, reason, what string) error {
	c.refused(field, reason, 1)
	return errdefs.New(errdefs.ErrUnavailable, "agent: %s: %w: %s: %s", op, ErrUntrusted, field, what)
}

// errTooLarge is what a capReader fails with past its bound.
var errTooLarge = errors.New("larger than its bound")

// capReader reads from r until left bytes were read, then fails with
// errTooLarge.
type capReader struct {
	r    io.Reader
	left int64
}

func (c *capReader) Read(p []byte) (int, error) {
	if c.left <= 0 {
		return 0, errTooLarge
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	return n, err
}

// maxResponse is the bound of op's answer.
func maxResponse(op string) int64 {
	if op == api.OpExec {
		return MaxExecResponse
	}
	return MaxResponse
}

// vetResponse checks the answer to req, received at now, in place: its
// error's text, and the parts req.Op answers with (when it succeeded).
func (c *Client) vetResponse(req *api.Request, resp *api.Response, now time.Time) error {
	resp.Error = c.text(FieldError, resp.Error, MaxError)
	if resp.Code != api.CodeOK {
		return nil
	}
	op := req.Op
	switch op {
	case api.OpInfo:
		if resp.Info == nil {
			return c.refuse(op, FieldInfo, ReasonMissing, "no info")
		}
		return c.vetInfo(op, resp.Info, now)
	case api.OpCreate, api.OpStart, api.OpStop, api.OpStatus, api.OpUpdate, api.OpAdopt:
		if resp.App == nil {
			return c.refuse(op, FieldApp, ReasonMissing, "no app status")
		}
		if resp.App.ID != req.ID {
			return c.refuse(op, FieldAppID, ReasonMismatch, "the status of another app")
		}
		return c.vetApp(op, resp.App, now)
	case api.OpList, api.OpEvents:
		return c.vetApps(op, resp.Apps, now)
	case api.OpExec:
		if resp.Exec == nil {
			return c.refuse(op, FieldExec, ReasonMissing, "no result")
		}
		c.vetExec(resp.Exec)
	case api.OpStats:
		if resp.Stats == nil {
			return c.refuse(op, FieldStats, ReasonMissing, "no figures")
		}
		return c.vetStats(op, resp.Stats, now)
	case api.OpRestore:
		r := resp.Restore
		if r == nil {
			return c.refuse(op, FieldRestore, ReasonMissing, "no pipes")
		}
		if r.PID < 1 || r.PID > MaxPID || r.Stdout < 0 || r.Stdout > MaxFD || r.Stderr < 0 || r.Stderr > MaxFD {
			return c.refuse(op, FieldRestore, ReasonRange, "a PID or descriptor out of range")
		}
	case api.OpTermination:
		c.vetTermination(resp)
	}
	return nil
}

// vetInfo checks an agent's Info. Its Version is taken as it is: it
// decides nothing.
func (c *Client) vetInfo(op string, info *api.Info, now time.Time) error {
	if info.PID < 1 || info.PID > MaxPID {
		return c.refuse(op, FieldInfo, ReasonRange, "a PID out of range")
	}
	info.Kernel = c.text(FieldInfo, info.Kernel, MaxKernel)
	info.Features = c.features(info.Features)
	info.StartedAt = c.time(FieldInfo, info.StartedAt, now)
	return nil
}

// vetApps checks a list of apps: at most MaxApps, each ID once.
func (c *Client) vetApps(op string, apps []*api.AppStatus, now time.Time) error {
	if len(apps) > MaxApps {
		return c.refuse(op, FieldApps, ReasonLength, "too many apps")
	}
	seen := make(map[string]bool, len(apps))
	for _, a := range apps {
		if a == nil {
			return c.refuse(op, FieldApps, ReasonInvalid, "a null app")
		}
		if seen[a.ID] {
			return c.refuse(op, FieldAppID, ReasonInvalid, "an app twice")
		}
		seen[a.ID] = true
		if err := c.vetApp(op, a, now); err != nil {
			return err
		}
	}
	return nil
}

// vetApp checks one app's status: its ID, state and PID refuse it; its
// exit code, reason, message and times are made ones the daemon can
// record.
func (c *Client) vetApp(op string, st *api.AppStatus, now time.Time) error {
	if !isAppID(st.ID) {
		return c.refuse(op, FieldAppID, ReasonInvalid, "not an app ID")
	}
	switch st.State {
	case api.StateCreated, api.StateRunning, api.StateExited:
	default:
		return c.refuse(op, FieldState, ReasonInvalid, "no such state")
	}
	if st.PID < 0 || st.PID > MaxPID || (st.State == api.StateRunning && st.PID == 0) {
		return c.refuse(op, FieldPID, ReasonRange, "a PID out of range")
	}
	st.ExitCode = c.exitCode(FieldExitCode, st.ExitCode)
	if st.Reason != "" && !isReason(st.Reason) {
		c.refused(FieldReason, ReasonInvalid, 1)
		st.Reason = api.ReasonError
	}
	st.Message = c.text(FieldMessage, st.Message, MaxMessage)
	st.CreatedAt = c.time(FieldAppTime, st.CreatedAt, now)
	st.StartedAt = c.time(FieldAppTime, st.StartedAt, now)
	st.FinishedAt = c.time(FieldAppTime, st.FinishedAt, now)
	if st.State == api.StateExited && st.FinishedAt.IsZero() {
		c.refused(FieldAppTime, ReasonMissing, 1)
		st.FinishedAt = now
	}
	if !st.FinishedAt.IsZero() && st.FinishedAt.Before(st.StartedAt) {
		c.refused(FieldAppTime, ReasonTime, 1)
		st.FinishedAt = st.StartedAt
	}
	return nil
}

// vetExec cuts an exec's output to api.ExecOutputLimit together (stdout
// first, as the agent keeps what comes first) and its exit code to range.
func (c *Client) vetExec(r *api.ExecResult) {
	if len(r.Stdout)+len(r.Stderr) > api.ExecOutputLimit {
		c.refused(FieldExec, ReasonLength, 1)
		r.Stdout = r.Stdout[:min(len(r.Stdout), api.ExecOutputLimit)]
		r.Stderr = r.Stderr[:api.ExecOutputLimit-len(r.Stdout)]
	}
	r.ExitCode = c.exitCode(FieldExec, r.ExitCode)
}

// vetStats refuses figures out of range; a time out of range is the
// answer's.
func (c *Client) vetStats(op string, s *api.Stats, now time.Time) error {
	for _, v := range []uint64{s.CPUUsageNanos, s.MemoryPageFaults, s.MemoryMajorPageFault, s.WritableBytes, s.WritableInodes} {
		if v > math.MaxInt64 {
			return c.refuse(op, FieldStats, ReasonRange, "a figure out of range")
		}
	}
	for _, v := range []uint64{s.MemoryUsageBytes, s.MemoryWorkingSet, s.MemoryRSSBytes} {
		if v > MaxMemoryBytes {
			return c.refuse(op, FieldStats, ReasonRange, "a memory figure out of range")
		}
	}
	if s.Pids > MaxPID || s.MemoryMajorPageFault > s.MemoryPageFaults {
		return c.refuse(op, FieldStats, ReasonRange, "a figure out of range")
	}
	if s.Timestamp.IsZero() {
		s.Timestamp = now
	}
	s.Timestamp = c.time(FieldStats, s.Timestamp, now)
	return nil
}

// vetEvent checks an event of an OpEvents stream; false: it is dropped
// (told to Refused).
func (c *Client) vetEvent(ev *api.Event, now time.Time) bool {
	switch ev.Type {
	case api.EventCreated, api.EventStarted, api.EventExited, api.EventRemoved:
	default:
		c.refused(FieldEvent, ReasonInvalid, 1)
		return false
	}
	if ev.App == nil {
		c.refused(FieldEvent, ReasonMissing, 1)
		return false
	}
	if c.vetApp(api.OpEvents, ev.App, now) != nil {
		return false
	}
	ev.Time = c.time(FieldEvent, ev.Time, now)
	return true
}

// vetSessionEnd checks how a session ended.
func (c *Client) vetSessionEnd(end *api.SessionEnd) {
	end.ExitCode = c.exitCode(FieldSession, end.ExitCode)
	end.Error = c.text(FieldSession, end.Error, MaxError)
}

// exitCode is code when it is one, MaxExitCode otherwise.
func (c *Client) exitCode(field string, code int32) int32 {
	if code < 0 || code > MaxExitCode {
		c.refused(field, ReasonRange, 1)
		return MaxExitCode
	}
	return code
}

// time is t when it is zero or lies between the Unix epoch and
// MaxClockAhead after now; now otherwise.
func (c *Client) time(field string, t, now time.Time) time.Time {
	if t.IsZero() || (t.Unix() > 0 && !t.After(now.Add(MaxClockAhead))) {
		return t
	}
	c.refused(field, ReasonTime, 1)
	return now
}

// text is s as one line of at most max bytes: bytes that are not UTF-8
// become U+FFFD, control characters spaces, and a longer one keeps its
// start and its end (where an error's cause is), cut at characters'
// boundaries.
func (c *Client) text(field, s string, max int) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || unicode.IsControl(r) {
			clean = false
			break
		}
	}
	if !clean {
		c.refused(field, ReasonControl, 1)
		s = strings.Map(func(r rune) rune {
			if unicode.IsControl(r) {
				return ' '
			}
			return r
		}, strings.ToValidUTF8(s, "\uFFFD"))
	}
	if len(s) > max {
		c.refused(field, ReasonLength, 1)
		const elided = " … "
		head := (max - len(elided)) / 2
		for head > 0 && !utf8.RuneStart(s[head]) {
			head--
		}
		tail := len(s) - (max - len(elided) - head)
		for tail < len(s) && !utf8.RuneStart(s[tail]) {
			tail++
		}
		s = s[:head] + elided + s[tail:]
	}
	return s
}

// isAppID tells whether id is an app's ID: 1..MaxAppID letters, digits,
// '_', '.', '-', not starting with '.' or '-'.
func isAppID(id string) bool {
	if id == "" || len(id) > MaxAppID || id[0] == '.' || id[0] == '-' {
		return false
	}
	for i := 0; i < len(id); i++ {
		b := id[i]
		if !isAlnum(b) && b != '_' && b != '.' && b != '-' {
			return false
		}
	}
	return true
}

// isReason tells whether r is an exit reason: a letter, then letters and
// digits, at most MaxReason.
func isReason(r string) bool {
	if r == "" || len(r) > MaxReason || !isAlnum(r[0]) || (r[0] >= '0' && r[0] <= '9') {
		return false
	}
	for i := 0; i < len(r); i++ {
		if !isAlnum(r[i]) {
			return false
		}
	}
	return true
}

func isAlnum(b byte) bool {
	return (b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') || (b >= '0' && b <= '9')
}

// eventBudget is a token bucket of EventBurst events refilled at
// EventRate a second.
type eventBudget struct {
	tokens float64
	last   time.Time
}

func newEventBudget(now time.Time) *eventBudget {
	return &eventBudget{tokens: EventBurst, last: now}
}

// take takes one event's token at now and returns how long to wait for
// it first: 0 when there was one.
func (b *eventBudget) take(now time.Time) time.Duration {
	if now.After(b.last) {
		b.tokens = min(EventBurst, b.tokens+now.Sub(b.last).Seconds()*EventRate)
		b.last = now
	}
	b.tokens--
	if b.tokens >= 0 {
		return 0
	}
	return time.Duration(-b.tokens / EventRate * float64(time.Second))
}
