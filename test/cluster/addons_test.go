package cluster

import (
	"bytes"
	"text/template"
)

// addons is what a cluster runs in kube-system before its nodes turn
// Ready, as kubeadm and a network add-on install it: kube-proxy and the pod
// network as DaemonSets of host-network pods (the fly stage1, by the
// default policy's rule for kube-system), CoreDNS as a Deployment (nspawn),
// and a RuntimeClass for each stage1.
const addons = `
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: nspawn}
handler: nspawn
---
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: kvm}
handler: kvm
overhead:
  podFixed: {memory: 192Mi}
---
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: fly}
handler: fly
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-proxy, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: stagelet-cluster:kube-proxy}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: system:node-proxier}
subjects: [{kind: ServiceAccount, name: kube-proxy, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: kube-proxy, namespace: kube-system}
data:
  kubeconfig: |
    apiVersion: v1
    kind: Config
    clusters:
    - name: default
      cluster:
        server: {{.API}}
        certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
    users:
    - name: default
      user: {tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token}
    contexts:
    - name: default
      context: {cluster: default, user: default}
    current-context: default
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: kube-proxy, namespace: kube-system}
spec:
  selector: {matchLabels: {k8s-app: kube-proxy}}
  template:
    metadata: {labels: {k8s-app: kube-proxy}}
    spec:
      serviceAccountName: kube-proxy
      hostNetwork: true
      priorityClassName: system-node-critical
      tolerations: [{operator: Exists}]
      containers:
      - name: kube-proxy
        image: {{.KubeProxy}}
        command:
        - /usr/local/bin/kube-proxy
        - --kubeconfig=/var/lib/kube-proxy/kubeconfig
        - --hostname-override=$(NODE_NAME)
        - --proxy-mode=iptables
        - --cluster-cidr={{.ClusterCIDR}}
        # A node's conntrack table size is the host's: leave it alone.
        - --conntrack-max-per-core=0
        - --conntrack-tcp-timeout-established=0s
        - --conntrack-tcp-timeout-close-wait=0s
        - --v=2
        env:
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
        securityContext: {privileged: true}
        volumeMounts:
        - {name: kubeconfig, mountPath: /var/lib/kube-proxy}
        - {name: xtables-lock, mountPath: /run/xtables.lock}
      volumes:
      - name: kubeconfig
        configMap: {name: kube-proxy}
      - name: xtables-lock
        hostPath: {path: /run/xtables.lock, type: FileOrCreate}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: podnet, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: stagelet-cluster:podnet}
rules:
- {apiGroups: [""], resources: [nodes], verbs: [get, list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: stagelet-cluster:podnet}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: stagelet-cluster:podnet}
subjects: [{kind: ServiceAccount, name: podnet, namespace: kube-system}]
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: podnet, namespace: kube-system}
spec:
  selector: {matchLabels: {k8s-app: podnet}}
  template:
    metadata: {labels: {k8s-app: podnet}}
    spec:
      serviceAccountName: podnet
      hostNetwork: true
      priorityClassName: system-node-critical
      tolerations: [{operator: Exists}]
      containers:
      - name: podnet
        image: {{.Podnet}}
        args: [--apiserver={{.API}}, --cluster-cidr={{.ClusterCIDR}}]
        env:
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
        securityContext: {privileged: true}
        volumeMounts:
        - {name: cni-bin, mountPath: /host/opt/cni/bin}
        - {name: cni-conf, mountPath: /host/etc/cni/net.d}
        - {name: xtables-lock, mountPath: /run/xtables.lock}
      volumes:
      - name: cni-bin
        hostPath: {path: /opt/cni/bin, type: DirectoryOrCreate}
      - name: cni-conf
        hostPath: {path: /etc/cni/net.d, type: DirectoryOrCreate}
      - name: xtables-lock
        hostPath: {path: /run/xtables.lock, type: FileOrCreate}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: stagelet-cluster:coredns}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: stagelet-cluster:coredns}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: stagelet-cluster:coredns}
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health {
            lameduck 5s
        }
        ready
        kubernetes cluster.local in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
            ttl 30
        }
        cache 30
        loadbalance
    }
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  replicas: 2
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      serviceAccountName: coredns
      priorityClassName: system-cluster-critical
      tolerations: [{key: node-role.kubernetes.io/control-plane, effect: NoSchedule}]
      topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: ScheduleAnyway, labelSelector: {matchLabels: {k8s-app: kube-dns}}}
      containers:
      - name: coredns
        image: {{.CoreDNS}}
        args: [-conf, /etc/coredns/Corefile]
        ports:
        - {name: dns, containerPort: 53, protocol: UDP}
        - {name: dns-tcp, containerPort: 53, protocol: TCP}
        readinessProbe:
          httpGet: {path: /ready, port: 8181}
          periodSeconds: 2
        livenessProbe:
          httpGet: {path: /health, port: 8080}
          initialDelaySeconds: 30
        volumeMounts:
        - {name: config, mountPath: /etc/coredns, readOnly: true}
      volumes:
      - name: config
        configMap: {name: coredns}
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: {{.DNS}}
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
`

// applyAddons installs the add-ons; their pods start once nodes join.
func (c *cluster) applyAddons() error {
	var b bytes.Buffer
	err := template.Must(template.New("addons").Parse(addons)).Execute(&b, map[string]string{
		"API": c.api, "ClusterCIDR": clusterCIDR, "DNS": dnsIP,
		"KubeProxy": img.kubeProxy, "Podnet": img.podnet, "CoreDNS": img.coredns,
	})
	if err != nil {
		return err
	}
	_, err = c.kubectlIn(b.String(), "apply", "-f", "-")
	return err
}
