{{/*
The Nightshift configuration file (see docs/src/configuration.md), rendered from values.
Its checksum rolls the api and controller pods when it changes.
*/}}
{{- define "nightshift.config" -}}
listen: 0.0.0.0:8080
storage:
  s3:
    bucket: {{ required "storage.s3.bucket is required" .Values.storage.s3.bucket | quote }}
    {{- with .Values.storage.s3.endpoint }}
    endpoint: {{ . | quote }}
    {{- end }}
    region: {{ .Values.storage.s3.region | quote }}
    prefix: {{ .Values.storage.s3.prefix | quote }}
    path_style: {{ .Values.storage.s3.pathStyle }}
{{- $upstreams := list }}
{{- range .Values.upstreams }}
{{- $upstream := omit . "apiKeySecret" }}
{{- if .apiKeySecret }}
{{- $_ := set $upstream "api_key_env" (include "nightshift.upstreamKeyEnv" .) }}
{{- end }}
{{- $upstreams = append $upstreams $upstream }}
{{- end }}
{{- if not $upstreams }}
# No upstreams: the built-in `echo` model answers every line.
{{- end }}
upstreams:
  {{- toYaml $upstreams | nindent 2 }}
batches:
  {{- toYaml .Values.config.batches | nindent 2 }}
files:
  {{- toYaml .Values.config.files | nindent 2 }}
http:
  {{- toYaml .Values.config.http | nindent 2 }}
# The api's /metrics, on a port of its own.
metrics:
  listen: 0.0.0.0:{{ .Values.api.metricsPort }}
kubernetes:
  namespace: {{ .Release.Namespace }}
  # The shard Jobs the controller creates. Fields under `worker` are Kubernetes' own pod-spec YAML.
  worker:
    image: {{ include "nightshift.workerImage" . | quote }}
    image_pull_policy: {{ default .Values.image.pullPolicy .Values.worker.image.pullPolicy }}
    config_path: {{ include "nightshift.configPath" . }}
    backoff_limit: {{ .Values.worker.backoffLimit }}
    service_account_name: {{ include "nightshift.serviceAccountName" (list . "worker") }}
    {{- with .Values.imagePullSecrets }}
    image_pull_secrets:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    env:
      {{- include "nightshift.s3Env" . | nindent 6 }}
      - name: RUST_LOG
        value: {{ .Values.logLevel | quote }}
      {{- range .Values.upstreams }}
      {{- if .apiKeySecret }}
      - name: {{ include "nightshift.upstreamKeyEnv" . }}
        valueFrom:
          secretKeyRef:
            name: {{ required "upstreams[].apiKeySecret.name is required" .apiKeySecret.name }}
            key: {{ required "upstreams[].apiKeySecret.key is required" .apiKeySecret.key }}
      {{- end }}
      {{- end }}
      {{- with .Values.worker.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    volumes:
      {{- include "nightshift.configVolumes" . | nindent 6 }}
      {{- with .Values.worker.extraVolumes }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    volume_mounts:
      {{- include "nightshift.configVolumeMounts" . | nindent 6 }}
      {{- with .Values.worker.extraVolumeMounts }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- with .Values.worker.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .Values.worker.nodeSelector }}
    node_selector:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .Values.worker.tolerations }}
    tolerations:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .Values.worker.affinity }}
    affinity:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .Values.worker.priorityClassName }}
    priority_class_name: {{ . | quote }}
    {{- end }}
    {{- with .Values.worker.metricsPort }}
    metrics_port: {{ . }}
    {{- end }}
    labels:
      app.kubernetes.io/name: {{ include "nightshift.name" . | quote }}
      app.kubernetes.io/instance: {{ .Release.Name | quote }}
      app.kubernetes.io/part-of: nightshift
      app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
      {{- with .Values.worker.podLabels }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- with .Values.worker.podAnnotations }}
    annotations:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with .Values.worker.ttlSecondsAfterFinished }}
    ttl_seconds_after_finished: {{ . }}
    {{- end }}
    {{- with .Values.worker.activeDeadlineSeconds }}
    active_deadline_seconds: {{ . }}
    {{- end }}
    suspend: {{ .Values.worker.suspend }}
    {{- with .Values.worker.queueName }}
    queue_name: {{ . | quote }}
    {{- end }}
    security_context:
      {{- toYaml .Values.securityContext | nindent 6 }}
    pod_security_context:
      {{- toYaml .Values.podSecurityContext | nindent 6 }}
{{- end }}
