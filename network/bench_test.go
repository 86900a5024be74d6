package network

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"
)

// BenchmarkSetupTeardown measures one CNI ADD and one DEL of a pod on a
// bridge + host-local + portmap network (Debian's plugins), in a namespace
// made once. It reports the median ADD and DEL times besides ns/op.
func BenchmarkSetupTeardown(b *testing.B) {
	tn := newTestNet(b)
	path, err := tn.m.NewNetNS(context.Background(), "bench-"+randHex(4))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { tn.m.RemoveNetNS(context.Background(), path) })
	ctx := context.Background()
	var adds, dels []time.Duration
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		pn := PodNetwork{PodID: fmt.Sprintf("bench%d-%s", i, randHex(4)), Name: "bench", Namespace: "default", UID: "u", NetNS: path}
		t0 := time.Now()
		if _, err := tn.m.Setup(ctx, pn); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := tn.m.Teardown(ctx, pn); err != nil {
			b.Fatal(err)
		}
		adds, dels = append(adds, t1.Sub(t0)), append(dels, time.Since(t1))
	}
	b.ReportMetric(median(adds), "add-ms")
	b.ReportMetric(median(dels), "del-ms")
}

// BenchmarkNetNS measures NewNetNS + RemoveNetNS.
func BenchmarkNetNS(b *testing.B) {
	tn := newTestNet(b)
	for i := 0; b.Loop(); i++ {
		p, err := tn.m.NewNetNS(context.Background(), fmt.Sprintf("bench%d", i))
		if err != nil {
			b.Fatal(err)
		}
		if err := tn.m.RemoveNetNS(context.Background(), p); err != nil {
			b.Fatal(err)
		}
	}
}

func median(ds []time.Duration) float64 {
	if len(ds) == 0 {
		return 0
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	return float64(ds[len(ds)/2].Microseconds()) / 1000
}
