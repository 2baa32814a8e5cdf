{{- define "dualpath.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "dualpath.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dualpath.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "dualpath.image" -}}
image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- end -}}

{{- define "dualpath.scheduler" -}}
{{ include "dualpath.fullname" . }}-scheduler:{{ .Values.scheduler.port }}
{{- end -}}

{{- define "dualpath.kvClaim" -}}
{{ .Values.kvStore.existingClaim | default (printf "%s-kv" (include "dualpath.fullname" .)) }}
{{- end -}}

{{/* Model options shared by engines, frontend and rollout: empty path means the image's default model. */}}
{{- define "dualpath.modelArgs" -}}
{{- if .Values.model.path }}
- --model
- {{ .Values.model.path | quote }}
{{- end }}
{{- if .Values.model.maxModelLen }}
- --max-model-len
- {{ .Values.model.maxModelLen | int64 | quote }}
{{- end }}
{{- with .Values.model.loraModules }}
- --lora-modules
{{- range . }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The fabric lane settings every process inherits: KV on its SL / traffic class (UCX, NIXL), the collectives on
theirs (NCCL; the engines set these two themselves too, from the same values). */}}
{{- define "dualpath.fabricEnv" -}}
{{- range $old, $new := dict "kvTrafficClass" "kvDscp" "ncclServiceLevel" "collectiveServiceLevel" }}
{{- if hasKey $.Values.network $old }}
{{- fail (printf "network.%s is gone: set network.%s (deploy/qos/README.md)" $old $new) }}
{{- end }}
{{- end }}
- name: UCX_IB_SL
  value: {{ .Values.network.kvServiceLevel | quote }}
- name: UCX_IB_TRAFFIC_CLASS
  value: {{ mul .Values.network.kvDscp 4 | quote }}
- name: NCCL_IB_SL
  value: {{ .Values.network.collectiveServiceLevel | quote }}
- name: NCCL_IB_TC
  value: {{ mul .Values.network.collectiveDscp 4 | quote }}
{{- if .Values.network.ucxTls }}
- name: UCX_TLS
  value: {{ .Values.network.ucxTls | quote }}
{{- end }}
- name: TOKENIZERS_PARALLELISM
  value: "false"
{{- end -}}

{{- define "dualpath.volumes" -}}
- name: kv
  persistentVolumeClaim:
    claimName: {{ include "dualpath.kvClaim" . }}
{{- if .Values.model.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "dualpath.volumeMounts" -}}
- name: kv
  mountPath: {{ .Values.kvStore.mountPath }}
{{- if .Values.model.existingClaim }}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* A role's tensor-parallel size (dict "root" $ "role" R): <role>.tensorParallelSize, else 1. */}}
{{- define "dualpath.tensorParallelSize" -}}
{{- $tp := (index .root.Values .role).tensorParallelSize | default 1 | int -}}
{{- if lt $tp 1 -}}
{{- fail (printf "%s.tensorParallelSize must be 1 or more, got %d" .role $tp) -}}
{{- end -}}
{{- $tp -}}
{{- end -}}

{{/* A role's engines per pod (dict "root" $ "role" R): gpusPerNode / tensorParallelSize, which must divide it. */}}
{{- define "dualpath.enginesPerPod" -}}
{{- $gpus := (index .root.Values .role).gpusPerNode | int -}}
{{- $tp := include "dualpath.tensorParallelSize" . | int -}}
{{- if mod $gpus $tp -}}
{{- fail (printf "%s.tensorParallelSize %d does not divide %s.gpusPerNode %d: each engine takes tensorParallelSize GPUs of its pod" .role $tp .role $gpus) -}}
{{- end -}}
{{- div $gpus $tp -}}
{{- end -}}

{{/* Wait for the whole engine fleet (init containers of the frontend and the rollout Job). */}}
{{- define "dualpath.waitForEngines" -}}
- name: wait-for-engines
  {{- include "dualpath.image" . | nindent 2 }}
  {{- include "dualpath.containerSecurity" (dict "root" .) | nindent 2 }}
  command: ["dualpath", "status", "--scheduler", {{ include "dualpath.scheduler" . | quote }},
            "--wait-prefill", {{ mul .Values.prefill.nodes (include "dualpath.enginesPerPod" (dict "root" . "role" "prefill") | int) | quote }},
            "--wait-decode", {{ mul .Values.decode.nodes (include "dualpath.enginesPerPod" (dict "root" . "role" "decode") | int) | quote }},
            "--timeout", {{ .Values.engine.startTimeout | quote }}]
  env:
    {{- include "dualpath.tokenEnv" . | nindent 4 }}
  volumeMounts:
    {{- include "dualpath.securityMounts" . | nindent 4 }}
{{- end -}}

{{/* ---- Security (deploy/README.md "Security") ---- */}}

{{/* The cluster token's Secret: the one named in cluster.tokenSecret, else the chart's own (cluster-token.yaml). */}}
{{- define "dualpath.tokenSecret" -}}
{{ .Values.cluster.tokenSecret | default (printf "%s-cluster-token" (include "dualpath.fullname" .)) }}
{{- end -}}

{{/* Where every process finds the token: a copy the pod's init container makes (see dualpath.tokenInit). */}}
{{- define "dualpath.tokenDir" -}}/run/dualpath{{- end -}}

{{/* Refuse values that would expose the cluster without a key; included by frontend.yaml. */}}
{{- define "dualpath.validate" -}}
{{- $type := .Values.frontend.service.type | default "ClusterIP" }}
{{- if and (has $type (list "LoadBalancer" "NodePort")) (not .Values.frontend.apiKeySecret) }}
{{- fail (printf "frontend.service.type=%s exposes the OpenAI API beyond the cluster, and frontend.apiKeySecret is empty: anyone reaching it could use the model. Create a Secret with key \"api-key\" (kubectl create secret generic dualpath-api-key --from-literal=api-key=$(openssl rand -hex 32)) and set frontend.apiKeySecret=dualpath-api-key, or keep the Service a ClusterIP." $type) }}
{{- end }}
{{- if and .Values.frontend.adminApi.enabled (not .Values.frontend.adminApi.keySecret) }}
{{- fail "frontend.adminApi.enabled needs frontend.adminApi.keySecret: a Secret with key \"admin-api-key\", distinct from the inference key (weight updates, adapters, flush, pause and aborts of any request answer only to it)." }}
{{- end }}
{{- end -}}

{{/* The pod-level securityContext. Every pod runs as the image's unprivileged user (dualpath, uid/gid 1000);
     fsGroup gives that group the volumes whose driver supports ownership (OnRootMismatch: no recursive chown of a
     large KV store on every start). Engines may run as root only where values say so (engine.runAsRoot). */}}
{{- define "dualpath.podSecurity" -}}
{{- $s := .root.Values.securityContext -}}
securityContext:
  {{- if .asRoot }}
  runAsNonRoot: false
  runAsUser: 0
  {{- else }}
  runAsNonRoot: true
  runAsUser: {{ $s.runAsUser }}
  {{- end }}
  runAsGroup: {{ $s.runAsGroup }}
  fsGroup: {{ $s.fsGroup }}
  fsGroupChangePolicy: {{ $s.fsGroupChangePolicy }}
  seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* Every container's securityContext: no privilege escalation, every capability dropped (engines add back
     IPC_LOCK only: RDMA registration pins the KV buffers), the root file system read-only (what the runtime writes
     goes to the emptyDirs of dualpath.scratchMounts, the volumes and /dev/shm). */}}
{{- define "dualpath.containerSecurity" -}}
{{- $s := .root.Values.securityContext -}}
securityContext:
  {{- if .asRoot }}
  runAsNonRoot: false
  runAsUser: 0
  {{- else }}
  runAsNonRoot: true
  runAsUser: {{ $s.runAsUser }}
  {{- end }}
  runAsGroup: {{ $s.runAsGroup }}
  allowPrivilegeEscalation: false
  privileged: false
  readOnlyRootFilesystem: {{ $s.readOnlyRootFilesystem }}
  capabilities:
    drop: ["ALL"]
    {{- with .add }}
    add: {{ toJson . }}
    {{- end }}
  seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* The cluster token: every scheduler/engine/frontend/status/rollout process reads it from
     DUALPATH_CLUSTER_TOKEN_FILE. */}}
{{- define "dualpath.tokenEnv" -}}
- name: DUALPATH_CLUSTER_TOKEN_FILE
  value: {{ printf "%s/token" (include "dualpath.tokenDir" .) | quote }}
{{- end -}}

{{/* The token's init container, first in every pod. A Secret volume cannot give a non-root process a file only it
     may read: the kubelet writes the files as root and, with an fsGroup, adds group read (0400 becomes 0440), and
     the runtime refuses a token file others than its owner may read. So this container copies the token into an
     in-memory emptyDir as the pod's user, mode 0400; the other containers mount only that copy, read-only.
     (rm first: a re-run of the init container in the same pod finds the old copy.) */}}
{{- define "dualpath.tokenInit" -}}
- name: cluster-token
  {{- include "dualpath.image" .root | nindent 2 }}
  command: ["sh", "-c", "rm -f {{ include "dualpath.tokenDir" .root }}/token && install -m 0400 /var/run/secrets/dualpath/token {{ include "dualpath.tokenDir" .root }}/token"]
  {{- include "dualpath.containerSecurity" (dict "root" .root "asRoot" .asRoot) | nindent 2 }}
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 64Mi}
  volumeMounts:
    - name: cluster-token-secret
      mountPath: /var/run/secrets/dualpath
      readOnly: true
    - name: cluster-token
      mountPath: {{ include "dualpath.tokenDir" .root }}
{{- end -}}

{{/* Volumes every pod has: the token (the Secret, read by the init container only, and its private copy), /tmp and
     the user's cache directory (writable under a read-only root file system). */}}
{{- define "dualpath.securityVolumes" -}}
- name: cluster-token-secret
  secret:
    secretName: {{ include "dualpath.tokenSecret" . }}
    # 0440 (288): what the kubelet makes of any mode once fsGroup is set; the pod's group reads it, others nothing
    defaultMode: 288
    items:
      - {key: {{ .Values.cluster.tokenSecretKey | quote }}, path: token}
- name: cluster-token
  emptyDir: {medium: Memory, sizeLimit: 1Mi}
- name: tmp
  emptyDir: {sizeLimit: {{ .Values.securityContext.tmpSize }}}
- name: cache
  emptyDir: {sizeLimit: {{ .Values.securityContext.cacheSize }}}
{{- end -}}

{{/* Mounts every dualpath container has: the token's copy (read-only), /tmp, and the image's XDG_CACHE_HOME (JIT
     caches: Triton, CuPy; Hugging Face's). */}}
{{- define "dualpath.securityMounts" -}}
- name: cluster-token
  mountPath: {{ include "dualpath.tokenDir" . }}
  readOnly: true
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/dualpath/.cache
{{- end -}}

{{/* A NetworkPolicy peer: this release's pods of the given components (in the release's namespace). */}}
{{- define "dualpath.members" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ .root.Chart.Name }}
      app.kubernetes.io/instance: {{ .root.Release.Name }}
    matchExpressions:
      - {key: app.kubernetes.io/component, operator: In, values: {{ toJson .components }}}
{{- end -}}
