package supervisor

import (
	"context"
	"errors"
	"io/fs"
	"os"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// rename gives app old the ID new (api.OpRename): its status, record
// and events carry new from then on. What was made for it under its
// first ID (its cgroup, its writable layer, its spec) keeps that name.
// Errors: InvalidArgument (a bad new ID), NotFound, AlreadyExists.
func (a *Agent) rename(ctx context.Context, old, new string) (*api.AppStatus, error) {
	if err := validID(new); err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	ap, ok := a.apps[old]
	if !ok {
		return nil, errdefs.NotFound("app %q not found", old)
	}
	if old == new {
		return ap.status(), nil
	}
	if _, dup := a.apps[new]; dup {
		return nil, errdefs.AlreadyExists("app %q already exists", new)
	}
	ap.mu.Lock()
	ap.st.ID = new
	st := ap.st
	ap.mu.Unlock()
	a.apps[new] = ap
	delete(a.apps, old)
	if err := writeState(a.dir, &st); err != nil {
		a.log.WarnContext(ctx, "write app record", "app", new, "err", err)
	}
	if err := os.Remove(stateFile(a.dir, old)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		a.log.WarnContext(ctx, "remove the app's record under its former ID", "app", old, "err", err)
	}
	a.log.InfoContext(ctx, "app renamed", "app", old, "to", new)
	return &st, nil
}
