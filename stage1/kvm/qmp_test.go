package kvm

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestQMP: the client reads the greeting, leaves negotiation mode, skips
// events between a command and its answer, and turns an error answer into
// an error naming the command.
func TestQMP(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "qmp.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	got := make(chan []string, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		var cmds []string
		defer func() { got <- cmds }()
		c.Write([]byte(`{"QMP": {"version": {}, "capabilities": []}}` + "\n"))
		r := bufio.NewReader(c)
		for {
			line, err := r.ReadBytes('\n')
			if err != nil {
				return
			}
			var req struct {
				Execute string `json:"execute"`
			}
			json.Unmarshal(line, &req)
			cmds = append(cmds, req.Execute)
			switch req.Execute {
			case "query-status":
				c.Write([]byte(`{"event": "RESUME", "data": {}}` + "\n" + `{"return": {"status": "paused", "running": false}}` + "\n"))
			case "cont":
				c.Write([]byte(`{"error": {"class": "GenericError", "desc": "not now"}}` + "\n"))
			default:
				c.Write([]byte(`{"return": {}}` + "\n"))
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	q, err := dialQMP(ctx, sock, func() bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	if st, err := q.status(ctx); err != nil || st != "paused" {
		t.Errorf("status = %q, %v; want paused (the event before it skipped)", st, err)
	}
	if _, err := q.run(ctx, "cont", nil); err == nil || !strings.Contains(err.Error(), "qmp cont: GenericError: not now") {
		t.Errorf("cont: %v, want the error answer", err)
	}
	q.Close()
	if cmds := <-got; strings.Join(cmds, " ") != "qmp_capabilities query-status cont" {
		t.Errorf("commands sent: %q", cmds)
	}
}

// TestQMPQemuGone: dialing gives up, saying so, when qemu exited before
// making its socket (rather than waiting for the context to end).
func TestQMPQemuGone(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	_, err := dialQMP(ctx, filepath.Join(t.TempDir(), "none.sock"), func() bool { return false })
	if err == nil || !strings.Contains(err.Error(), "qemu exited") {
		t.Errorf("dial without qemu: %v, want qemu exited", err)
	}
}
