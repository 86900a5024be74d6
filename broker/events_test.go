package broker

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"
)

// TestStatusAndListsAskNoAgent: once the pods run, status and list calls
// answer from the records: not one call reaches an agent.
func TestStatusAndListsAskNoAgent(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	var pods, ctrs []string
	for i := range 5 {
		pid, err := b.RunPod(ctx, podCfg(fmt.Sprint("p", i)))
		if err != nil {
			t.Fatal(err)
		}
		cid, err := b.CreateContainer(ctx, pid, ctrCfg("c"))
		if err != nil {
			t.Fatal(err)
		}
		if err := b.StartContainer(ctx, cid); err != nil {
			t.Fatal(err)
		}
		pods, ctrs = append(pods, pid), append(ctrs, cid)
	}
	calls := func() (n int) {
		for _, pid := range pods {
			n += e.be.Pod(pid).Calls("")
		}
		return n
	}
	// Following begins with one Info per pod; wait until it is done.
	waitFor(t, "every pod is followed", func() bool {
		for _, pid := range pods {
			if e.be.Pod(pid).Subscribers() != 1 {
				return false
			}
		}
		return true
	})
	before := calls()
	for range 10 {
		if got := b.ListContainers(ctx, ContainerFilter{}); len(got) != len(ctrs) {
			t.Fatalf("ListContainers: %d containers", len(got))
		}
		if got := b.ListContainers(ctx, ContainerFilter{State: ContainerRunning}); len(got) != len(ctrs) {
			t.Fatalf("running containers: %d", len(got))
		}
		if got := b.ListPods(PodFilter{}); len(got) != len(pods) {
			t.Fatalf("ListPods: %d pods", len(got))
		}
		for i := range pods {
			if st, err := b.PodStatus(ctx, pods[i], true); err != nil || !st.Ready || st.Info["agent.kernel"] != "toy" {
				t.Fatalf("PodStatus: %+v %v", st, err)
			}
			if _, err := b.ContainerStatus(ctx, ctrs[i]); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := calls() - before; n != 0 {
		t.Errorf("status and list calls made %d agent calls, want 0", n)
	}
}

// collect reads a subscription's events until n arrived.
func collect(t *testing.T, s *Subscription, n int) []ContainerEvent {
	t.Helper()
	var out []ContainerEvent
	for len(out) < n {
		select {
		case ev := <-s.C:
			out = append(out, ev)
		case <-time.After(10 * time.Second):
			t.Fatalf("got %d events, want %d: %+v", len(out), n, out)
		}
	}
	return out
}

// TestContainerEvents: every subscriber sees a pod's and its containers'
// lifecycle in order, each event with the pod's status and its
// containers' records right after the change; an exit the agent reports
// on its own is one of them.
func TestContainerEvents(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	s1, s2 := b.Subscribe(), b.Subscribe()
	defer s1.Close()
	defer s2.Close()
	pid, err := b.RunPod(ctx, podCfg("ev"))
	if err != nil {
		t.Fatal(err)
	}
	cid, _ := b.CreateContainer(ctx, pid, ctrCfg("c"))
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	e.be.Pod(pid).Exit(cid, 4)
	waitContainer(t, b, cid, func(r *ContainerRecord) bool { return r.State == ContainerExited })
	if err := b.RemoveContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	if err := b.StopPod(ctx, pid); err != nil {
		t.Fatal(err)
	}
	if err := b.RemovePod(ctx, pid); err != nil {
		t.Fatal(err)
	}
	want := []struct{ typ, id string }{
		{EventCreated, pid}, {EventStarted, pid},
		{EventCreated, cid}, {EventStarted, cid}, {EventStopped, cid}, {EventDeleted, cid},
		{EventStopped, pid}, {EventDeleted, pid},
	}
	for n, s := range []*Subscription{s1, s2} {
		evs := collect(t, s, len(want))
		for i, w := range want {
			ev := evs[i]
			if ev.Type != w.typ || ev.ContainerID != w.id || ev.Pod.Record.ID != pid || ev.At.IsZero() {
				t.Fatalf("subscriber %d, event %d: %s %s (pod %s), want %s %s", n, i, ev.Type, ev.ContainerID, ev.Pod.Record.ID, w.typ, w.id)
			}
		}
		// The container's exit, with its code, in the event's records.
		stopped := evs[4]
		i := slices.IndexFunc(stopped.Containers, func(r ContainerRecord) bool { return r.ID == cid })
		if i < 0 || stopped.Containers[i].State != ContainerExited || stopped.Containers[i].ExitCode != 4 {
			t.Errorf("the stopped event's containers: %+v", stopped.Containers)
		}
		if !evs[1].Pod.Ready || evs[6].Pod.Ready {
			t.Errorf("pod readiness in the events: started %v, stopped %v", evs[1].Pod.Ready, evs[6].Pod.Ready)
		}
		if deleted := evs[5]; len(deleted.Containers) != 1 || deleted.Containers[0].ID != cid {
			t.Errorf("the deleted event carries %+v, want the container's last record", deleted.Containers)
		}
	}
}

// TestSlowSubscriberDropped: a subscriber that reads nothing never holds
// the broker up; past its buffer's worth of events it is dropped, the
// others keep every event.
func TestSlowSubscriberDropped(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	const buffer = 16
	b.subBuffer = buffer
	slow, fast := b.Subscribe(), b.Subscribe()
	defer slow.Close()
	defer fast.Close()
	got := 0
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range fast.C {
			got++
			if got == buffer+2 {
				return
			}
		}
	}()
	pid, err := b.RunPod(ctx, podCfg("busy")) // 2 events
	if err != nil {
		t.Fatal(err)
	}
	for i := range buffer {
		if _, err := b.CreateContainer(ctx, pid, ctrCfg(fmt.Sprint("c", i))); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatalf("the reading subscriber got %d events", got)
	}
	select {
	case <-slow.Dropped:
	default:
		t.Error("the subscriber that read nothing was not dropped")
	}
	select {
	case <-fast.Dropped:
		t.Error("the reading subscriber was dropped")
	default:
	}
}

// TestResubscribeAfterDrop: when the agent ends the stream but still
// answers, the broker subscribes again and goes on learning.
func TestResubscribeAfterDrop(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	pid, _ := b.RunPod(ctx, podCfg("p"))
	cid, _ := b.CreateContainer(ctx, pid, ctrCfg("c"))
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	fp := e.be.Pod(pid)
	waitFor(t, "the pod is followed", func() bool { return fp.Subscribers() == 1 })
	fp.DropSubscribers()
	waitFor(t, "the broker subscribes again", func() bool { return fp.Subscribers() == 1 })
	fp.Exit(cid, 9)
	rec := waitContainer(t, b, cid, func(r *ContainerRecord) bool { return r.State == ContainerExited })
	if rec.ExitCode != 9 {
		t.Errorf("exit code %d, want 9", rec.ExitCode)
	}
	if st, err := b.PodStatus(ctx, pid, false); err != nil || !st.Ready {
		t.Errorf("the pod after a dropped stream: %+v %v", st, err)
	}
}

// TestAgentWithoutEventsIsPolled: a pod whose agent predates events
// (started by an older daemon) is polled by its follower, so exits still
// reach the records.
func TestAgentWithoutEventsIsPolled(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	b := e.broker(t)
	pid, _ := b.RunPod(ctx, podCfg("old"))
	cid, _ := b.CreateContainer(ctx, pid, ctrCfg("c"))
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	b.Close() // the daemon is upgraded; the pod's agent is the old one
	fp := e.be.Pod(pid)
	fp.NoEvents()
	b2 := e.broker(t)
	fp.ExitQuietly(cid, 6)
	rec := waitContainer(t, b2, cid, func(r *ContainerRecord) bool { return r.State == ContainerExited })
	if rec.ExitCode != 6 {
		t.Errorf("exit code %d, want 6", rec.ExitCode)
	}
}
