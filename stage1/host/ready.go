package host

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/tracing"
)

// ProbeTimeout bounds one question to an agent about whether it runs.
const ProbeTimeout = 2 * time.Second

// WaitAgentReady waits until the pod's agent answers Info (over the
// protocol client, package agent/client), the pod's host
// process proc (the agent, systemd-nspawn, qemu) exits, or timeout passes.
// what names proc in the error. Errors: Unavailable (proc exited first),
// DeadlineExceeded (no answer in time), or what info returned that is
// neither (an agent answering with an error).
func WaitAgentReady(ctx context.Context, pod stage1.Pod, proc *Process, timeout time.Duration, what string) (err error) {
	ctx, span := tracing.Start(ctx, "agent.ready", attribute.String("stagelet.process", what))
	defer func() { tracing.End(span, err) }()
	info := client.NewClient(pod.Agent().Dial).Info
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	exited := make(chan struct{})
	go func() {
		if proc.Wait(ctx) == nil {
			close(exited)
		}
	}()
	// A host pod's agent answers some 30 ms after its launch: polled
	// every millisecond until then, the start is not held up by the
	// backoff (a refused connection to a unix socket costs microseconds);
	// later, a VM's guest is still booting, and the polls back off.
	const eager = 100 * time.Millisecond
	began := time.Now()
	delay := time.Millisecond
	for {
		pctx, pcancel := context.WithTimeout(ctx, ProbeTimeout)
		_, err := info(pctx)
		pcancel()
		if err == nil {
			return nil
		}
		// Until it listens the socket is missing or refuses: Unavailable.
		if !errors.Is(err, errdefs.ErrUnavailable) && !errors.Is(err, errdefs.ErrDeadlineExceeded) {
			return err
		}
		select {
		case <-exited:
			return fmt.Errorf("%s exited before the agent answered: %w", what, errdefs.ErrUnavailable)
		case <-ctx.Done():
			return errdefs.New(errdefs.ErrDeadlineExceeded, "agent not answering: %w", err)
		case <-time.After(delay): // retry once the agent had time to listen
		}
		if delay < 20*time.Millisecond && time.Since(began) > eager {
			delay *= 2
		}
	}
}

// CheckRecovered tells whether a pod found in its persisted state still
// runs after a daemon restart: its host process proc (what names it) must
// be alive with its recorded start time, and its agent must answer within
// timeout. Otherwise the error wraps stage1.ErrPodGone.
func CheckRecovered(ctx context.Context, proc *Process, what string, pod stage1.Pod, timeout time.Duration) error {
	if proc == nil {
		return fmt.Errorf("no %s recorded: %w", what, stage1.ErrPodGone)
	}
	if !proc.Alive() {
		return fmt.Errorf("%s pid %d: %w", what, proc.PID, stage1.ErrPodGone)
	}
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if _, err := client.NewClient(pod.Agent().Dial).Info(pctx); err != nil {
		// %v: the agent's error class (Unavailable) is not this error's.
		return fmt.Errorf("agent does not answer: %v: %w", err, stage1.ErrPodGone)
	}
	return nil
}

// StopHostPod stops a pod whose isolation is one host process proc (the fly
// agent, systemd-nspawn) in the cgroups cgs: it asks the agent to shut
// down (shutdown: SIGTERM, timeout, SIGKILL to every app), waits up to
// timeout+grace for proc to exit, then kills whatever is left in cgs and
// waits up to grace for proc. what names proc in messages. Idempotent: a
// pod already stopped is fine. DeadlineExceeded when proc outlives it all.
func StopHostPod(ctx context.Context, log *slog.Logger, what string, proc *Process, cgs []*cgroups.Cgroup, shutdown func(context.Context, time.Duration) error, timeout, grace time.Duration) error {
	if proc.Alive() {
		if err := shutdown(ctx, timeout); err != nil && !errors.Is(err, errdefs.ErrUnavailable) {
			// The agent may close the stream as it exits; anything else
			// is worth a line, and the cgroup kill below settles it.
			log.WarnContext(ctx, "agent shutdown", "err", err)
		}
		wctx, cancel := context.WithTimeout(ctx, timeout+grace)
		err := proc.Wait(wctx)
		cancel()
		if err != nil {
			log.WarnContext(ctx, what+" did not exit after the agent's shutdown; killing the pod", "pid", proc.PID)
		}
	}
	for _, cg := range cgs {
		if cg == nil {
			continue
		}
		if err := cg.Kill(); err != nil {
			return err
		}
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), grace)
	defer cancel()
	if err := proc.Wait(wctx); err != nil {
		return fmt.Errorf("%s pid %d did not exit: %w", what, proc.PID, errdefs.ErrDeadlineExceeded)
	}
	return nil
}
