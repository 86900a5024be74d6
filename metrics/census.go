package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/stage1"
)

var (
	podsDesc = prometheus.NewDesc(namespace+"_pods",
		"Pods the daemon holds, by stage1 and state (creating, ready, notready).", []string{"stage1", "state"}, nil)
	containersDesc = prometheus.NewDesc(namespace+"_containers",
		"Containers the daemon holds, by their pod's stage1 and state (creating, created, running, exited, unknown).", []string{"stage1", "state"}, nil)
	templateHitsDesc = prometheus.NewDesc(namespace+"_vm_template_hits_total",
		"Pods' VMs restored from a VM template that was there, by stage1.", []string{"stage1"}, nil)
	templateMissesDesc = prometheus.NewDesc(namespace+"_vm_template_misses_total",
		"Pods' VMs that waited for their VM template to be built, by stage1.", []string{"stage1"}, nil)
	templateBuildsDesc = prometheus.NewDesc(namespace+"_vm_template_builds_total",
		"VM templates built, by stage1.", []string{"stage1"}, nil)
	templateFailuresDesc = prometheus.NewDesc(namespace+"_vm_template_build_failures_total",
		"VM template builds that failed, by stage1.", []string{"stage1"}, nil)
	acceleratorDesc = prometheus.NewDesc(namespace+"_vm_accelerator_info",
		"The accelerator a VM stage1's pods use (kvm or tcg), once chosen: always 1.", []string{"stage1", "accelerator"}, nil)
)

// census is the collector of what is read at scrape time: the broker's
// pods and containers, and the VM stage1s' figures.
type census struct{ src Source }

func (c *census) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{podsDesc, containersDesc, templateHitsDesc, templateMissesDesc,
		templateBuildsDesc, templateFailuresDesc, acceleratorDesc} {
		ch <- d
	}
}

func (c *census) Collect(ch chan<- prometheus.Metric) {
	stage1s := c.src.Stage1s()
	cs := c.src.Census()
	gauges(ch, podsDesc, stage1s, broker.PodStates, cs.Pods)
	gauges(ch, containersDesc, stage1s, broker.ContainerStates, cs.Containers)
	for _, name := range stage1s {
		be, _ := c.src.Backend(name)
		vr, ok := be.(stage1.VMReporter)
		if !ok {
			continue
		}
		s := vr.VMStats()
		for d, v := range map[*prometheus.Desc]uint64{
			templateHitsDesc: s.TemplateHits, templateMissesDesc: s.TemplateMisses,
			templateBuildsDesc: s.TemplateBuilds, templateFailuresDesc: s.TemplateBuildFailures,
		} {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), name)
		}
		if s.Accelerator != "" {
			ch <- prometheus.MustNewConstMetric(acceleratorDesc, prometheus.GaugeValue, 1, name, s.Accelerator)
		}
	}
}

// gauges sends one gauge per stage1 and state: every registered stage1 in
// every known state (0 when none), and whatever else counts holds (a
// recovered pod of a stage1 no longer registered).
func gauges(ch chan<- prometheus.Metric, d *prometheus.Desc, stage1s, states []string, counts map[broker.StageState]int) {
	all := make(map[broker.StageState]int, len(stage1s)*len(states))
	for _, s := range stage1s {
		for _, st := range states {
			all[broker.StageState{Stage1: s, State: st}] = 0
		}
	}
	for k, n := range counts {
		all[k] += n
	}
	for k, n := range all {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(n), k.Stage1, k.State)
	}
}
