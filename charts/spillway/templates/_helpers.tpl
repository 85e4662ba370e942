{{/*
Name helpers, after kube-prometheus-stack and bitnami: spillway.name is the chart
name (or nameOverride); spillway.fullname prefixes it with the release unless the
release name already contains it; both are cut to 63 characters (DNS label).
*/}}
{{- define "spillway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "spillway.fullname" -}}
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

{{- define "spillway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "spillway.labels" -}}
helm.sh/chart: {{ include "spillway.chart" . }}
{{ include "spillway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: spillway
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "spillway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spillway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels and selector labels of one component: (dict "ctx" $ "component" "operator"). */}}
{{- define "spillway.componentLabels" -}}
{{ include "spillway.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "spillway.componentSelectorLabels" -}}
{{ include "spillway.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* ServiceAccount name of a component: (dict "ctx" $ "component" "operator" "values" .Values.operator). */}}
{{- define "spillway.serviceAccountName" -}}
{{- if .values.serviceAccount.create }}
{{- default (printf "%s-%s" (include "spillway.fullname" .ctx) .component | trunc 63 | trimSuffix "-") .values.serviceAccount.name }}
{{- else }}
{{- default "default" .values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "spillway.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "spillway.pricingConfigMap" -}}
{{- printf "%s-pricing" (include "spillway.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "spillway.sqliteClaim" -}}
{{- default (printf "%s-db" (include "spillway.fullname" .) | trunc 63 | trimSuffix "-") .Values.database.sqlite.existingClaim }}
{{- end }}

{{/* The database URL environment variable of the API. */}}
{{- define "spillway.databaseEnv" -}}
{{- if eq .Values.database.type "postgresql" }}
- name: SPILLWAY_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "database.postgresql.existingSecret is required when database.type is postgresql" .Values.database.postgresql.existingSecret }}
      key: {{ .Values.database.postgresql.urlKey }}
{{- else }}
- name: SPILLWAY_DATABASE_URL
  value: sqlite:////var/lib/spillway/spillway.db
{{- end }}
{{- end }}

{{/* The admission webhook's Service, configuration (cluster-scoped: the namespace makes it unique) and Secret. */}}
{{- define "spillway.webhookService" -}}
{{ include "spillway.fullname" . }}-operator-webhook
{{- end }}
{{- define "spillway.webhookConfiguration" -}}
{{ include "spillway.fullname" . }}-{{ .Release.Namespace }}-finetunejobs
{{- end }}
{{- define "spillway.webhookSecret" -}}
{{ include "spillway.fullname" . }}-webhook-tls
{{- end }}
{{- define "spillway.webhookEnabled" -}}
{{- if and .Values.operator.enabled .Values.operator.webhook.enabled }}true{{ end }}
{{- end }}
