package osthread

import (
	"fmt"
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/internal/testutil"
)

// The main goroutine keeps the main thread through TestMain, which calls
// offMainThread from it: the one case Run has to steer around, made
// deterministic.
func init() { runtime.LockOSThread() }

var fromMain struct {
	tid      int
	err      error
	nsBefore string
	nsAfter  string
}

func TestMain(m *testing.M) {
	fromMain.nsBefore, _ = os.Readlink("/proc/self/ns/uts")
	fromMain.err = offMainThread(func() error {
		fromMain.tid = unix.Gettid()
		return unix.Unshare(unix.CLONE_NEWUTS)
	})
	fromMain.nsAfter, _ = os.Readlink("/proc/self/ns/uts")
	os.Exit(m.Run())
}

func TestOffTheMainThread(t *testing.T) {
	testutil.NeedRoot(t, "unshares namespaces")
	if fromMain.err != nil {
		t.Fatal(fromMain.err)
	}
	if fromMain.tid == os.Getpid() {
		t.Error("fn ran on the main thread")
	}
	if fromMain.nsBefore == "" || fromMain.nsBefore != fromMain.nsAfter {
		t.Errorf("the main thread's UTS namespace went from %q to %q", fromMain.nsBefore, fromMain.nsAfter)
	}
}

// TestThreadEnds: a thread fn moved into a namespace runs nothing else;
// every later goroutine is in the process's namespace.
func TestThreadEnds(t *testing.T) {
	testutil.NeedRoot(t, "unshares namespaces")
	own, err := os.Readlink("/proc/thread-self/ns/uts")
	if err != nil {
		t.Fatal(err)
	}
	tids := map[int]bool{}
	for range 20 {
		if err := Run(func() error {
			tids[unix.Gettid()] = true
			if err := unix.Unshare(unix.CLONE_NEWUTS); err != nil {
				return err
			}
			return unix.Sethostname([]byte("elsewhere"))
		}); err != nil {
			t.Fatal(err)
		}
	}
	done := make(chan error)
	for range 4 * runtime.GOMAXPROCS(0) {
		go func() {
			runtime.Gosched()
			ns, err := os.Readlink("/proc/thread-self/ns/uts")
			if err == nil && ns != own {
				err = fmt.Errorf("thread %d is in %s, not %s", unix.Gettid(), ns, own)
			}
			done <- err
		}()
	}
	for range 4 * runtime.GOMAXPROCS(0) {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	if len(tids) == 0 || tids[os.Getpid()] {
		t.Errorf("fn ran on threads %v (main %d)", tids, os.Getpid())
	}
}

func TestError(t *testing.T) {
	want := fmt.Errorf("from fn")
	if err := Run(func() error { return want }); err != want {
		t.Errorf("Run returned %v, want %v", err, want)
	}
}
