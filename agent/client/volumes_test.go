package client

import (
	"slices"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
)

func TestVetFeaturesAndTermination(t *testing.T) {
	c := &Client{}
	many := make([]string, MaxFeatures+5)
	for i := range many {
		many[i] = "f"
	}
	got := c.features(append([]string{api.FeatureGuestVolumes, "", "with space", strings.Repeat("x", MaxKernel+1), "a/b"}, many...))
	if len(got) != MaxFeatures || got[0] != api.FeatureGuestVolumes || slices.Contains(got, "with space") {
		t.Fatalf("features kept: %d, %q", len(got), got[:2])
	}
	if !HasFeature(&api.Info{Features: got}, api.FeatureGuestVolumes) || HasFeature(nil, api.FeatureGuestVolumes) {
		t.Fatal("HasFeature")
	}
	resp := &api.Response{Termination: []byte(strings.Repeat("a", api.MaxTerminationMessage) + "the end")}
	c.vetTermination(resp)
	if len(resp.Termination) != api.MaxTerminationMessage || !strings.HasSuffix(string(resp.Termination), "the end") {
		t.Fatalf("termination message cut to %d bytes, ending %q", len(resp.Termination), resp.Termination[len(resp.Termination)-7:])
	}
}
