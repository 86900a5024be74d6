package client

import (
	"context"
	"slices"
	"strings"

	"github.com/stagelet/stagelet/agent/api"
)

// FieldTermination is the field of a termination message cut to
// api.MaxTerminationMessage (its end kept, as the kubelet reads it).
const FieldTermination = "termination"

// PutFiles writes tree as a guest volume of the agent's side
// (api.OpPutFiles), replacing an earlier tree of that name as a reader
// sees it whole. InvalidArgument: a tree that fails api.FileTree.Check.
func (c *Client) PutFiles(ctx context.Context, tree *api.FileTree) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpPutFiles, Files: tree})
	return err
}

// TerminationMessage reads app id's termination message (the end of the
// file of its api.MountMessage mount; empty without one). NotFound: no
// such app.
func (c *Client) TerminationMessage(ctx context.Context, id string) ([]byte, error) {
	resp, err := c.Call(ctx, &api.Request{Op: api.OpTermination, ID: id})
	if err != nil {
		return nil, err
	}
	return resp.Termination, nil
}

// vetTermination cuts a termination message to its last
// api.MaxTerminationMessage bytes.
func (c *Client) vetTermination(resp *api.Response) {
	if n := len(resp.Termination); n > api.MaxTerminationMessage {
		c.refused(FieldTermination, ReasonLength, 1)
		resp.Termination = resp.Termination[n-api.MaxTerminationMessage:]
	}
}

// MaxFeatures bounds Info.Features; each is a token of at most MaxKernel
// letters and digits.
const MaxFeatures = 32

// features keeps the features an honest agent could send: tokens, at
// most MaxFeatures of them.
func (c *Client) features(fs []string) []string {
	out := fs[:0]
	for _, f := range fs {
		if len(out) == MaxFeatures || f == "" || len(f) > MaxKernel || strings.Trim(f, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") != "" {
			c.refused(FieldInfo, ReasonInvalid, 1)
			continue
		}
		out = append(out, f)
	}
	return out
}

// HasFeature tells whether info lists feature f.
func HasFeature(info *api.Info, f string) bool {
	return info != nil && slices.Contains(info.Features, f)
}
