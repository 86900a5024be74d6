package client

import (
	"context"
	"strings"

	"github.com/stagelet/stagelet/agent/api"
)

// MountShare asks a VM's guest to mount the pod's shared directory, which
// it did not mount at boot (api.OpMountShare). Idempotent.
// FailedPrecondition from a guest with no directory to mount on demand.
func (c *Client) MountShare(ctx context.Context) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpMountShare})
	return err
}

// Network gives a VM's running guest its pod's network anew
// (api.OpNetwork): guest is the configuration as stagelet.* kernel
// parameters (guest.Config.Cmdline).
func (c *Client) Network(ctx context.Context, guest []string) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpNetwork, Guest: strings.Join(guest, " ")})
	return err
}

// Rename gives app id the ID newID (api.OpRename); its status is then
// read under newID.
func (c *Client) Rename(ctx context.Context, id, newID string) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpRename, ID: id, NewID: newID})
	return err
}
