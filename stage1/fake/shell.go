package fake

import (
	"context"
	"fmt"
	"io"
	"path"
	"strconv"
	"strings"
	"time"
)

// The fake agent runs no programs: an app's or exec's command is read by
// a toy shell that knows what tests ask of a busybox rootfs:
//
//	sh -c SCRIPT   commands separated by ";", "&", "&&" or newlines
//	echo ARGS      ARGS and a newline on stdout
//	cat [-]        stdin to stdout
//	sleep N        waits N seconds (or until the app is stopped)
//	true, false, exit [N]
//
// A command is named by its path's last element ("/bin/sh" is "sh"); any
// other command fails with 127, as a shell's does.

// shell runs args with the given streams until it ends or ctx does (then
// it returns 137, as a SIGKILL'd command) and returns its exit code.
func shell(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int32 {
	if len(args) == 0 {
		return 0
	}
	code, _ := run(ctx, args, stdin, stdout, stderr)
	return code
}

// run runs one command; exit tells the script to end (exit).
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) (code int32, exit bool) {
	switch path.Base(args[0]) {
	case "sh":
		if len(args) < 3 || args[1] != "-c" {
			fmt.Fprintln(stderr, "sh: only sh -c SCRIPT")
			return 2, false
		}
		return script(ctx, args[2], stdin, stdout, stderr), false
	case "echo":
		fmt.Fprintln(stdout, strings.Join(args[1:], " "))
	case "cat":
		if stdin != nil {
			_, _ = io.Copy(stdout, stdin)
		}
	case "sleep":
		n := 0.0
		if len(args) > 1 {
			n, _ = strconv.ParseFloat(args[1], 64)
		}
		t := time.NewTimer(time.Duration(n * float64(time.Second)))
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return 137, true
		}
	case "true":
	case "false":
		return 1, false
	case "exit":
		if len(args) > 1 {
			n, err := strconv.Atoi(args[1])
			if err != nil {
				fmt.Fprintf(stderr, "exit: %s: bad number\n", args[1])
				return 2, true
			}
			return int32(n), true
		}
		return 0, true
	default:
		fmt.Fprintf(stderr, "%s: not found\n", args[0])
		return 127, false
	}
	if ctx.Err() != nil {
		return 137, true
	}
	return 0, false
}

// script runs a sh -c script: its commands in order (a command sent to
// the background runs before the next, which is all a test tells apart);
// the script's code is its last command's.
func script(ctx context.Context, s string, stdin io.Reader, stdout, stderr io.Writer) int32 {
	r := strings.NewReplacer("&&", ";", "&", ";", "\n", ";")
	var code int32
	for _, cmd := range strings.Split(r.Replace(s), ";") {
		args := strings.Fields(cmd)
		if len(args) == 0 {
			continue
		}
		var exit bool
		code, exit = run(ctx, args, stdin, stdout, stderr)
		if exit || ctx.Err() != nil {
			break
		}
	}
	if ctx.Err() != nil {
		return 137
	}
	return code
}
