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
- {{ .Values.model.maxModelLen | quote }}
{{- end }}
{{- with .Values.model.loraModules }}
- --lora-modules
{{- range . }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The fabric lane settings every process inherits (KV on its SL / traffic class, NCCL off it). */}}
{{- define "dualpath.fabricEnv" -}}
- name: UCX_IB_SL
  value: {{ .Values.network.kvServiceLevel | quote }}
- name: UCX_IB_TRAFFIC_CLASS
  value: {{ .Values.network.kvTrafficClass | quote }}
- name: NCCL_IB_SL
  value: {{ .Values.network.ncclServiceLevel | quote }}
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

{{/* Wait for the whole engine fleet (init containers of the frontend and the rollout Job). */}}
{{- define "dualpath.waitForEngines" -}}
- name: wait-for-engines
  {{- include "dualpath.image" . | nindent 2 }}
  command: ["dualpath", "status", "--scheduler", {{ include "dualpath.scheduler" . | quote }},
            "--wait-prefill", {{ mul .Values.prefill.nodes .Values.prefill.gpusPerNode | quote }},
            "--wait-decode", {{ mul .Values.decode.nodes .Values.decode.gpusPerNode | quote }},
            "--timeout", {{ .Values.engine.startTimeout | quote }}]
{{- end -}}
