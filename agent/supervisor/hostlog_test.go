package supervisor

import (
	"strings"
	"testing"
	"time"
)

// takeAll takes what reader gen is sent from sent on, without waiting.
func takeAll(t *testing.T, b *logBuffer, gen uint64, sent int64, limit int) string {
	t.Helper()
	p, done, replaced, _ := b.take(gen, sent, limit)
	if done || replaced {
		t.Fatalf("take: done %v, replaced %v", done, replaced)
	}
	return string(p)
}

func TestLogBufferWholeLinesAndAcks(t *testing.T) {
	b := newLogBuffer(1 << 10)
	for _, l := range []string{"one\n", "two\n", "three\n"} {
		if err := b.write([]byte(l)); err != nil {
			t.Fatal(err)
		}
	}
	gen, from := b.attach()
	if from != 0 {
		t.Fatalf("first reader starts at %d", from)
	}
	// A limit inside a line sends the lines before it only.
	if got := takeAll(t, b, gen, from, 10); got != "one\ntwo\n" {
		t.Fatalf("take = %q", got)
	}
	if got := takeAll(t, b, gen, 8, 100); got != "three\n" {
		t.Fatalf("take after 8 bytes = %q", got)
	}
	// Nothing more: a channel closed by the next write.
	_, _, _, wait := b.take(gen, 14, 100)
	if wait == nil {
		t.Fatal("nothing to take, and nothing to wait on")
	}
	b.ack(gen, 4)
	if err := b.write([]byte("four\n")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-wait:
	default:
		t.Fatal("a write did not wake the reader")
	}
	// A new reader replaces the first, from the first byte not
	// acknowledged.
	gen2, from := b.attach()
	if from != 4 {
		t.Fatalf("second reader starts at %d, want 4", from)
	}
	if _, _, replaced, _ := b.take(gen, 14, 100); !replaced {
		t.Fatal("the first reader was not told it was replaced")
	}
	b.ack(gen, 4) // the old reader's ack is ignored
	if got := takeAll(t, b, gen2, from, 100); got != "two\nthree\nfour\n" {
		t.Fatalf("second reader takes %q", got)
	}
	b.ack(gen2, 10)
	b.end()
	if _, done, _, _ := b.take(gen2, 19, 100); done {
		t.Fatal("done before everything was acknowledged")
	}
	b.ack(gen2, 5)
	if _, done, _, _ := b.take(gen2, 19, 100); !done {
		t.Fatal("not done once everything was acknowledged")
	}
	if err := b.write([]byte("late\n")); err == nil {
		t.Error("a write after the end was taken")
	}
}

// TestLogBufferBackPressure: a writer waits while the buffer is full and
// goes on once a reader's acknowledgement makes room; nothing is dropped.
func TestLogBufferBackPressure(t *testing.T) {
	line := strings.Repeat("x", 9) + "\n"
	b := newLogBuffer(3 * len(line))
	for range 3 {
		if err := b.write([]byte(line)); err != nil {
			t.Fatal(err)
		}
	}
	wrote := make(chan error, 1)
	go func() { wrote <- b.write([]byte("y\n")) }()
	gen, from := b.attach()
	if got := takeAll(t, b, gen, from, 100); got != strings.Repeat(line, 3) {
		t.Fatalf("take = %q", got)
	}
	select {
	case err := <-wrote:
		t.Fatalf("a write into a full buffer returned (%v)", err)
	default:
	}
	b.ack(gen, uint64(len(line)))
	select {
	case err := <-wrote:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the writer did not go on once there was room")
	}
	// It waited for the room: the buffer never held more than its size.
	if n := len(b.data); n > b.max {
		t.Fatalf("the buffer holds %d bytes, more than its %d", n, b.max)
	}
	if got := takeAll(t, b, gen, from+int64(3*len(line)), 100); got != "y\n" {
		t.Fatalf("take = %q", got)
	}
}

// TestLogBufferDiscard: a removed app's blocked writer returns and its
// reader is done.
func TestLogBufferDiscard(t *testing.T) {
	b := newLogBuffer(4)
	if err := b.write([]byte("abc\n")); err != nil {
		t.Fatal(err)
	}
	gen, _ := b.attach()
	wrote := make(chan error, 1)
	go func() { wrote <- b.write([]byte("def\n")) }()
	b.discard()
	select {
	case err := <-wrote:
		if err == nil {
			t.Error("a discarded buffer took a write")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the blocked writer did not return")
	}
	if _, done, _, _ := b.take(gen, 0, 100); !done {
		t.Error("the reader of a discarded buffer is not done")
	}
}

// TestCRILogToBuffer: an app's lines for the host are formatted as the
// file's are.
func TestCRILogToBuffer(t *testing.T) {
	b := newLogBuffer(1 << 20)
	l := bufferedCRILog(b)
	l.now = fixedClock()
	long := strings.Repeat("a", maxLogLine+1)
	if err := l.copyStream(streamStderr, strings.NewReader("hi\r\n"+long+"\ntail")); err != nil {
		t.Fatal(err)
	}
	if err := l.reopen(); err != nil {
		t.Errorf("reopen: %v", err)
	}
	l.close()
	gen, _ := b.attach()
	got := takeAll(t, b, gen, 0, 1<<20)
	want := ts + " stderr F hi\n" + ts + " stderr P " + long[:maxLogLine] + "\n" + ts + " stderr F a\n" + ts + " stderr P tail\n"
	if got != want {
		t.Errorf("buffer holds %.200q, want %.200q", got, want)
	}
	b.ack(gen, uint64(len(got)))
	if _, done, _, _ := b.take(gen, int64(len(got)), 100); !done {
		t.Error("closing the log did not end the buffer")
	}
}

// TestLogBufferDelivered: an app's exit waits until the daemon
// acknowledged its last lines.
func TestLogBufferDelivered(t *testing.T) {
	b := newLogBuffer(1 << 10)
	if err := b.write([]byte("last\n")); err != nil {
		t.Fatal(err)
	}
	b.end()
	done := make(chan struct{})
	go func() { b.delivered(); close(done) }()
	gen, _ := b.attach()
	if got := takeAll(t, b, gen, 0, 100); got != "last\n" {
		t.Fatalf("take = %q", got)
	}
	select {
	case <-done:
		t.Fatal("delivered before the acknowledgement")
	default:
	}
	b.ack(gen, 5)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("not delivered after the acknowledgement")
	}
}
