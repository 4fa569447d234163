{{/* Names, labels and shared pieces of the Nightshift chart. */}}

{{- define "nightshift.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every resource name: `<release>-<chart>`, or `<release>` when it already contains the chart name. */}}
{{- define "nightshift.fullname" -}}
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

{{- define "nightshift.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "nightshift.labels" -}}
helm.sh/chart: {{ include "nightshift.chart" . }}
{{ include "nightshift.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: nightshift
{{- end }}

{{- define "nightshift.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nightshift.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: `include "nightshift.componentLabels" (list $ "api")`. */}}
{{- define "nightshift.componentLabels" -}}
{{ include "nightshift.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "nightshift.componentSelectorLabels" -}}
{{ include "nightshift.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "nightshift.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "nightshift.workerImage" -}}
{{- $repository := default .Values.image.repository .Values.worker.image.repository }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.worker.image.tag }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{- define "nightshift.configMapName" -}}
{{- printf "%s-config" (include "nightshift.fullname" .) }}
{{- end }}

{{- define "nightshift.serviceAccountName" -}}
{{- $root := index . 0 }}
{{- $role := index . 1 }}
{{- $explicit := get $root.Values.serviceAccount (printf "%sName" $role) }}
{{- default (printf "%s-%s" (include "nightshift.fullname" $root) $role) $explicit }}
{{- end }}

{{/* Where every role reads the configuration: the ConfigMap mounted at /etc/nightshift. */}}
{{- define "nightshift.configDir" -}}/etc/nightshift{{- end }}
{{- define "nightshift.configPath" -}}/etc/nightshift/config.yaml{{- end }}

{{/* The environment variable holding an upstream's API key. */}}
{{- define "nightshift.upstreamKeyEnv" -}}
{{- default (printf "NIGHTSHIFT_UPSTREAM_%s_API_KEY" (regexReplaceAll "[^A-Z0-9]+" (upper .name) "_")) .api_key_env }}
{{- end }}

{{/* S3 credentials as env entries (api, controller and workers), from the existing Secret;
none without one (workload identity: IRSA or EKS Pod Identity give them through the
ServiceAccount, and the AWS SDK's default chain finds them). */}}
{{- define "nightshift.s3Env" -}}
{{- with .Values.storage.s3.credentials.existingSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.storage.s3.credentials.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.storage.s3.credentials.secretAccessKeyKey }}
{{- end }}
{{- end }}

{{/* Pod template pieces shared by the api and the controller. */}}
{{- define "nightshift.configVolumes" -}}
- name: config
  configMap:
    name: {{ include "nightshift.configMapName" . }}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "nightshift.configVolumeMounts" -}}
- name: config
  mountPath: {{ include "nightshift.configDir" . }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* The ApiVersion of PodDisruptionBudget the cluster serves: policy/v1 from 1.21, policy/v1beta1 before. */}}
{{- define "nightshift.pdbApiVersion" -}}
{{- if and (.Capabilities.APIVersions.Has "policy/v1/PodDisruptionBudget") (semverCompare ">=1.21-0" .Capabilities.KubeVersion.Version) -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end -}}
{{- end }}
