package kvm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"

	"github.com/stagelet/stagelet/stage1/host"

	"github.com/stagelet/stagelet/agent/transport"
	"github.com/stagelet/stagelet/errdefs"
)

// qmp is a connection to qemu's machine protocol (QMP): JSON commands, one
// per line, each answered by a "return" or an "error" object; asynchronous
// "event" objects in between are skipped. It is used to save a template
// VM and restore pods' VMs from it.
type qmp struct {
	conn net.Conn
	r    *bufio.Reader
}

// dialQMP connects to the QMP socket at path once qemu created it (while
// alive reports qemu running), reads the greeting and leaves capabilities
// negotiation mode.
func dialQMP(ctx context.Context, path string, alive func() bool) (*qmp, error) {
	delay := time.Millisecond
	for {
		conn, err := transport.DialUnix(ctx, path)
		if err == nil {
			q := &qmp{conn: conn, r: bufio.NewReader(conn)}
			if err := q.greet(ctx); err != nil {
				conn.Close()
				return nil, err
			}
			return q, nil
		}
		if !alive() {
			return nil, fmt.Errorf("qmp %s: qemu exited: %w", path, errdefs.ErrUnavailable)
		}
		select {
		case <-ctx.Done():
			return nil, errdefs.New(errdefs.ErrDeadlineExceeded, "qmp %s: %w", path, err)
		case <-time.After(delay): // polling for qemu to create its socket
		}
		if delay < 20*time.Millisecond {
			delay *= 2
		}
	}
}

func processAlive(p *host.Process) func() bool { return p.Alive }

func (q *qmp) greet(ctx context.Context) error {
	q.deadline(ctx)
	var hello struct {
		QMP json.RawMessage `json:"QMP"`
	}
	line, err := q.r.ReadBytes('\n')
	if err != nil {
		return fmt.Errorf("qmp greeting: %w", err)
	}
	if err := json.Unmarshal(line, &hello); err != nil || hello.QMP == nil {
		return fmt.Errorf("qmp greeting: not QMP: %.80q", line)
	}
	_, err = q.run(ctx, "qmp_capabilities", nil)
	return err
}

func (q *qmp) deadline(ctx context.Context) {
	d, ok := ctx.Deadline()
	if !ok {
		d = time.Time{}
	}
	q.conn.SetDeadline(d)
}

// run sends command with args (nil: none) and returns its "return" value.
func (q *qmp) run(ctx context.Context, command string, args any) (json.RawMessage, error) {
	q.deadline(ctx)
	req := map[string]any{"execute": command}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if _, err := q.conn.Write(append(b, '\n')); err != nil {
		return nil, fmt.Errorf("qmp %s: %w", command, err)
	}
	for {
		line, err := q.r.ReadBytes('\n')
		if err != nil {
			return nil, fmt.Errorf("qmp %s: %w", command, err)
		}
		var resp struct {
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Class string `json:"class"`
				Desc  string `json:"desc"`
			} `json:"error"`
		}
		if err := json.Unmarshal(line, &resp); err != nil {
			return nil, fmt.Errorf("qmp %s: %w", command, err)
		}
		switch {
		case resp.Error != nil:
			return nil, fmt.Errorf("qmp %s: %s: %s", command, resp.Error.Class, resp.Error.Desc)
		case resp.Return != nil:
			return resp.Return, nil
		}
		// an event
	}
}

// status is the VM's run state (query-status): "running", "paused",
// "inmigrate", "postmigrate", ...
func (q *qmp) status(ctx context.Context) (string, error) {
	r, err := q.run(ctx, "query-status", nil)
	if err != nil {
		return "", err
	}
	var st struct {
		Status string `json:"status"`
	}
	if err := json.Unmarshal(r, &st); err != nil {
		return "", fmt.Errorf("qmp query-status: %w", err)
	}
	return st.Status, nil
}

// migrationStatus is query-migrate's status ("active", "completed",
// "failed", ...) and error description.
func (q *qmp) migrationStatus(ctx context.Context) (string, string, error) {
	r, err := q.run(ctx, "query-migrate", nil)
	if err != nil {
		return "", "", err
	}
	var st struct {
		Status string `json:"status"`
		Desc   string `json:"error-desc"`
	}
	if err := json.Unmarshal(r, &st); err != nil {
		return "", "", fmt.Errorf("qmp query-migrate: %w", err)
	}
	return st.Status, st.Desc, nil
}

// ignoreShared turns on the x-ignore-shared migration capability: RAM in a
// named shared file is not part of the migration stream, the destination
// maps the same file instead (both sides must set it).
func (q *qmp) ignoreShared(ctx context.Context) error {
	_, err := q.run(ctx, "migrate-set-capabilities", map[string]any{
		"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": true}},
	})
	return err
}

func (q *qmp) Close() error { return q.conn.Close() }
