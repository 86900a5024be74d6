// Command counter is what the cluster test (make test-cluster) moves from
// one node to another: it counts in memory, ten times a second, and
// serves its state as JSON on :8080. A token drawn at its start, kept in
// memory only, tells a restored process from a new one; its PID, its
// parent's name and MOVE_MARK from its environment tell the process tree
// and environment it runs with.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"log"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

type state struct {
	Count     int64  `json:"count"`
	Token     string `json:"token"`
	PID       int    `json:"pid"`
	PPID      int    `json:"ppid"`
	Parent    string `json:"parent"`
	MoveMark  string `json:"moveMark"`
	Hostname  string `json:"hostname"`
	StartedAt string `json:"startedAt"`
}

func main() {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		log.Fatal(err)
	}
	token, started := hex.EncodeToString(b), time.Now().UTC().Format(time.RFC3339Nano)
	var n atomic.Int64
	go func() {
		for range time.Tick(100 * time.Millisecond) {
			n.Add(1)
		}
	}()
	http.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		ppid := os.Getppid()
		parent, _ := os.ReadFile("/proc/" + strconv.Itoa(ppid) + "/comm")
		host, _ := os.Hostname()
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(state{
			Count: n.Load(), Token: token, PID: os.Getpid(), PPID: ppid,
			Parent: strings.TrimSpace(string(parent)), MoveMark: os.Getenv("MOVE_MARK"),
			Hostname: host, StartedAt: started,
		})
	})
	// Plain TCP: criu 4.1 cannot checkpoint the Multipath TCP sockets Go
	// listens on by default.
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	l, err := lc.Listen(context.Background(), "tcp", ":8080")
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(http.Serve(l, nil))
}
