#!/usr/bin/env bash
# The whole product on this machine: a Kubernetes cluster with a real node
# (hack/cluster), the images built here (hack/images), the Helm chart, and
# examples/tiny-cluster.yaml trained to the end in a real pod.
#
#   hack/demo-cluster.sh up     (make demo-cluster)
#   hack/demo-cluster.sh down   (make demo-cluster-down)
#
# State (certificates, logs, the volumes' directories) goes to
# $SPILLWAY_DEMO_DIR (default runs/demo-cluster). Needs root, as the real node does.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEMO=${SPILLWAY_DEMO_DIR:-$ROOT/runs/demo-cluster}
export SPILLWAY_CLUSTER_DIR=$DEMO/cluster
UID_RUNTIME=1000
CLASS=spillway-tiny
JOB=tiny-cluster

log() { printf '\033[1m[demo-cluster]\033[0m %s\n' "$*" >&2; }

# A directory the training uid owns (a provisioner's job in a real cluster).
owned_dir() { mkdir -p "$1" && chown "$UID_RUNTIME:$UID_RUNTIME" "$1" && chmod 0755 "$1"; }

# pv NAME PATH CLAIM MODE: a hostPath PersistentVolume bound in advance to CLAIM in default.
pv() {
	cat <<EOF
apiVersion: v1
kind: PersistentVolume
metadata: {name: $1}
spec:
  capacity: {storage: 1Ti}
  accessModes: [$4]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: $CLASS
  claimRef: {namespace: default, name: $3}
  hostPath: {path: $2, type: Directory}
---
EOF
}

up() {
	mkdir -p "$DEMO"
	chmod 0755 "$DEMO" # the containers' uid walks through it to the volumes
	log "cluster: hack/cluster up (state in $SPILLWAY_CLUSTER_DIR)"
	"$ROOT/hack/cluster" up
	eval "$("$ROOT/hack/cluster" env)"
	# shellcheck disable=SC1091
	source "$SPILLWAY_CLUSTER_DIR/cluster.env"
	log "images: operator and the CPU training image (first time: ~10 min, 6 GB)"
	local loaded operator runtime
	loaded=$("$ROOT/hack/images" load "$CONTAINERD_SOCKET" operator runtime-cpu)
	operator=$(awk '$1 == "operator" { print $2 }' <<<"$loaded")
	runtime=$(awk '$1 == "runtime-cpu" { print $2 }' <<<"$loaded")

	log "inputs: the tiny model and data (spillway make-tiny)"
	if [[ ! -f $DEMO/inputs/model/config.json ]]; then
		"$ROOT/.venv/bin/spillway" make-tiny "$DEMO/inputs/model" --dataset "$DEMO/inputs/data/arithmetic.jsonl"
	fi
	chmod -R a+rX "$DEMO/inputs"
	owned_dir "$DEMO/checkpoints"
	owned_dir "$DEMO/db"
	owned_dir "$DEMO/nvme"
	{
		cat <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: $CLASS}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: Immediate
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: tiny-inputs, namespace: default}
spec: {accessModes: [ReadOnlyMany], storageClassName: $CLASS, volumeName: demo-inputs, resources: {requests: {storage: 1Gi}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: spillway-db, namespace: default}
spec: {accessModes: [ReadWriteOnce], storageClassName: $CLASS, volumeName: demo-db, resources: {requests: {storage: 1Gi}}}
---
EOF
		pv demo-inputs "$DEMO/inputs" tiny-inputs ReadOnlyMany
		pv demo-db "$DEMO/db" spillway-db ReadWriteOnce
		pv demo-checkpoints "$DEMO/checkpoints" "$JOB-checkpoints" ReadWriteOnce
	} | kubectl apply -f - >/dev/null

	log "chart: helm install spillway charts/spillway (operator, API, node probe on the real node)"
	local toleration="[{\"key\":\"$NODE_LABEL\",\"operator\":\"Exists\",\"effect\":\"NoSchedule\"}]"
	helm upgrade --install spillway "$ROOT/charts/spillway" --namespace default --wait --timeout 10m \
		--set image.repository="${operator%:*}" --set-string image.tag="${operator##*:}" --set image.pullPolicy=Never \
		--set runtimeImage.repository="${runtime%:*}" --set-string runtimeImage.tag="${runtime##*:}" \
		--set runtimeImage.pullPolicy=Never \
		--set database.sqlite.existingClaim=spillway-db \
		--set-json "operator.tolerations=$toleration" --set-json "api.tolerations=$toleration" \
		--set nodeProbe.gpuNodeLabel="$NODE_LABEL" --set-json "nodeProbe.tolerations=$toleration" \
		--set nodeProbe.nvmeHostPath="$DEMO/nvme" --set nodeProbe.quick=true >/dev/null
	log "waiting for the node probe's annotations on $NODE_NAME"
	local i
	for i in $(seq 1 120); do
		kubectl get node "$NODE_NAME" -o jsonpath='{.metadata.annotations.spillway\.dev/nvme-path}' | grep -q . && break
		sleep 5
	done

	log "job: kubectl apply -f examples/tiny-cluster.yaml"
	kubectl apply -f "$ROOT/examples/tiny-cluster.yaml"
	local phase=""
	for i in $(seq 1 240); do
		phase=$(kubectl get ftj "$JOB" -o jsonpath='{.status.phase}')
		printf '  %s step %s loss %s\n' "${phase:-Pending}" \
			"$(kubectl get ftj "$JOB" -o jsonpath='{.status.progress.step}')" \
			"$(kubectl get ftj "$JOB" -o jsonpath='{.status.progress.loss}')"
		[[ $phase == Succeeded || $phase == Failed ]] && break
		sleep 5
	done
	kubectl get ftj
	cat <<EOF

The model is exported to $DEMO/checkpoints/export.
The dashboard and REST API:   kubectl port-forward svc/spillway-api 8080:80
                              (then http://127.0.0.1:8080/ ; KUBECONFIG=$SPILLWAY_CLUSTER_DIR/kubeconfig)
Clean up:                     make demo-cluster-down
EOF
	[[ $phase == Succeeded ]]
}

down() {
	"$ROOT/hack/cluster" down || true
	rm -rf "$DEMO"
}

case ${1:-} in
up) up ;;
down) down ;;
*) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
