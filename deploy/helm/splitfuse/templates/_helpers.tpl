{{/* The chart name, overridable. */}}
{{- define "splitfuse.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: the release name, prefixed by the chart's unless it contains it. */}}
{{- define "splitfuse.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "splitfuse.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitfuse.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "splitfuse.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 }}
{{ include "splitfuse.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "splitfuse.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "splitfuse.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The server's configuration file; host, port, drain_timeout and engine.tp come from values,
engine.num_threads (per tensor-parallel rank) from the CPU limit unless given. */}}
{{- define "splitfuse.configFile" -}}
{{- $config := omit .Values.config "host" "port" "drain_timeout" "engine" }}
{{- $engine := omit (default (dict) .Values.config.engine) "tp" "tensor_parallel_size" }}
{{- $_ := set $engine "tp" (int .Values.tensorParallelSize) }}
{{- $cpuLimit := toString (dig "limits" "cpu" "" .Values.resources) }}
{{- if and (not (hasKey $engine "num_threads")) (regexMatch "^[0-9]+$" $cpuLimit) }}
{{- $_ := set $engine "num_threads" (max 1 (div (int $cpuLimit) (int .Values.tensorParallelSize))) }}
{{- end }}
{{- $_ := set $config "engine" $engine }}
{{- $_ := set $config "host" "0.0.0.0" }}
{{- $_ := set $config "port" (int .Values.port) }}
{{- $_ := set $config "drain_timeout" (int .Values.drainTimeoutSeconds) }}
{{- toYaml $config }}
{{- end }}
