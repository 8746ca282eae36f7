{{- define "gpusnap.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpusnap.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gpusnap.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gpusnap.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gpusnap.labels" -}}
app.kubernetes.io/name: gpusnap
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "gpusnap.selector" -}}
app.kubernetes.io/name: gpusnap
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "gpusnap.claimName" -}}
{{- default (printf "%s-snapshots" (include "gpusnap.fullname" .)) .Values.storage.pvc.existingClaim -}}
{{- end -}}

{{- /* The agent's PriorityClass: the one named, else the chart's own, else none. */ -}}
{{- define "gpusnap.priorityClassName" -}}
{{- if .Values.priorityClassName -}}
{{- .Values.priorityClassName -}}
{{- else if .Values.priorityClass.create -}}
{{- printf "%s-node" (include "gpusnap.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- /* Where a Prometheus that reads annotations finds the agent's metrics. */ -}}
{{- define "gpusnap.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end -}}
