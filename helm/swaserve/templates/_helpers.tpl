{{/* Chart name. */}}
{{- define "swaserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/*
The RayService name. NOTE: KubeRay derives Service, RayCluster and Pod names from it by appending
suffixes ("-serve-svc", "-head-svc", "-<id>-<group>-worker-<id>"), so it is cut to 50 characters
instead of Helm's usual 63.
*/}}
{{- define "swaserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "swaserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "swaserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "swaserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "swaserve.labels" -}}
helm.sh/chart: {{ include "swaserve.chart" . }}
{{ include "swaserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "swaserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The Service KubeRay keeps pointed at every healthy Serve proxy of the active cluster. */}}
{{- define "swaserve.serveServiceName" -}}
{{- printf "%s-serve-svc" (include "swaserve.fullname" .) }}
{{- end }}

{{- define "swaserve.apiKeySecretName" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "swaserve.fullname" .)) }}
{{- end }}

{{- define "swaserve.apiKeyEnabled" -}}
{{- if or .Values.apiKey.existingSecret .Values.apiKey.value }}true{{ end }}
{{- end }}

{{/*
The effective serve.config: null values dropped (`helm lint` keeps them, `helm install` drops
them), and `workers` (a fixed count) winning over the default `autoscaling` block.
*/}}
{{- define "swaserve.config" -}}
{{- $cfg := deepCopy .Values.serve.config }}
{{- range $key, $value := .Values.serve.config }}
{{- if kindIs "invalid" $value }}{{ $_ := unset $cfg $key }}{{ end }}
{{- end }}
{{- if $cfg.workers }}{{ $_ := unset $cfg "autoscaling" }}{{ end }}
{{- toYaml $cfg }}
{{- end }}

{{/* Worker pod bounds = worker replica bounds: each replica gets its own pod. */}}
{{- define "swaserve.workerBounds" -}}
{{- $cfg := include "swaserve.config" . | fromYaml }}
{{- if $cfg.autoscaling }}
min: {{ $cfg.autoscaling.min_replicas | int }}
max: {{ $cfg.autoscaling.max_replicas | int }}
{{- else }}
min: {{ $cfg.workers | int }}
max: {{ $cfg.workers | int }}
{{- end }}
{{- end }}

{{/* Tensor-parallel ranks of one worker replica (each one a GPU or a CPU bundle). */}}
{{- define "swaserve.ranks" -}}
{{- (include "swaserve.config" . | fromYaml).tensor_parallel_size | default 1 | int }}
{{- end }}

{{/* GPUs of one worker pod: tensor_parallel_size x worker_num_gpus (one replica per pod). */}}
{{- define "swaserve.podGpus" -}}
{{- mul (include "swaserve.ranks" . | int) ((include "swaserve.config" . | fromYaml).worker_num_gpus | int) }}
{{- end }}

{{/* CPUs one worker replica reserves: its own plus each rank actor's (rank_num_cpus, default 1). */}}
{{- define "swaserve.podCpus" -}}
{{- $cfg := include "swaserve.config" . | fromYaml }}
{{- $ranks := include "swaserve.ranks" . | int }}
{{- addf ($cfg.worker_num_cpus | float64) (mulf (sub $ranks 1) ($cfg.rank_num_cpus | default 1.0 | float64)) }}
{{- end }}

{{/*
ServeConfig.placement_group_bundles: one bundle per rank (the replica first), zero resources
left out (Ray refuses them).
*/}}
{{- define "swaserve.bundles" -}}
{{- $cfg := include "swaserve.config" . | fromYaml }}
{{- $bundles := list }}
{{- range $r := until (include "swaserve.ranks" . | int) }}
{{- $b := dict }}
{{- $cpus := ternary $cfg.worker_num_cpus ($cfg.rank_num_cpus | default 1.0) (eq $r 0) }}
{{- if gt ($cpus | float64) 0.0 }}{{ $_ := set $b "CPU" $cpus }}{{ end }}
{{- if gt ($cfg.worker_num_gpus | float64) 0.0 }}{{ $_ := set $b "GPU" $cfg.worker_num_gpus }}{{ end }}
{{- $bundles = append $bundles $b }}
{{- end }}
{{- toYaml $bundles }}
{{- end }}

{{/* CPU cores of a quantity ("8", 8, "500m"). */}}
{{- define "swaserve.cores" -}}
{{- $q := toString . }}
{{- if hasSuffix "m" $q }}{{ divf (trimSuffix "m" $q | float64) 1000 }}{{ else }}{{ $q | float64 }}{{ end }}
{{- end }}

{{/* Checks the values schema cannot express; each message says what to change. */}}
{{- define "swaserve.validate" -}}
{{- $cfg := include "swaserve.config" . | fromYaml }}
{{- $gpus := $cfg.worker_num_gpus | float64 }}
{{- if ne $gpus (float64 (int $gpus)) }}
{{- fail (printf "serve.config.worker_num_gpus must be a whole number on Kubernetes (got %v): each worker replica gets its own pod with that many GPUs" $gpus) }}
{{- end }}
{{- $res := .Values.workerGroup.resources | default dict }}
{{- range $section := list "requests" "limits" }}
{{- if hasKey (get $res $section | default dict) "nvidia.com/gpu" }}
{{- fail (printf "workerGroup.resources.%s must not set nvidia.com/gpu: it comes from serve.config (tensor_parallel_size x worker_num_gpus)" $section) }}
{{- end }}
{{- end }}
{{- $cpu := get .Values.workerGroup.rayStartParams "num-cpus" | default (get (get $res "limits" | default dict) "cpu") | default (get (get $res "requests" | default dict) "cpu") }}
{{- $need := include "swaserve.podCpus" . | float64 }}
{{- if and $cpu (lt (include "swaserve.cores" $cpu | float64) $need) }}
{{- fail (printf "a worker pod has %v CPUs but a worker replica reserves %v (worker_num_cpus + (tensor_parallel_size - 1) x rank_num_cpus): raise workerGroup.resources cpu (leave room for an ingress replica)" $cpu $need) }}
{{- end }}
{{- if .Values.model.volume }}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) $cfg.model) }}
{{- fail (printf "serve.config.model (%s) must be a directory under model.mountPath (%s) when model.volume is set" $cfg.model .Values.model.mountPath) }}
{{- end }}
{{- end }}
{{- if and .Values.apiKey.existingSecret .Values.apiKey.value }}
{{- fail "set apiKey.existingSecret or apiKey.value, not both" }}
{{- end }}
{{- end }}

{{/*
The Ray Serve config (KubeRay PUTs it to the head's dashboard). `args` are serve.config verbatim;
the Worker entry repeats the Serve options derived from them (deploy.config.ServeConfig
.worker_deployment_options) so that `serve status` shows them. NOTE: Ray replaces
ray_actor_options and autoscaling_config whole, so both are written complete.
*/}}
{{- define "swaserve.serveConfig" -}}
{{- $cfg := include "swaserve.config" . | fromYaml -}}
proxy_location: EveryNode
applications:
  - name: swaserve
    route_prefix: /
    import_path: deploy.app:build_app
    args:
      {{- toYaml $cfg | nindent 6 }}
    deployments:
      - name: Worker
        {{- if $cfg.max_ongoing_requests }}
        max_ongoing_requests: {{ $cfg.max_ongoing_requests | toJson }}
        {{- end }}
        {{- if $cfg.max_queued_requests }}
        max_queued_requests: {{ $cfg.max_queued_requests | toJson }}
        {{- end }}
        ray_actor_options:
          num_cpus: {{ $cfg.worker_num_cpus | toJson }}
          num_gpus: {{ $cfg.worker_num_gpus | toJson }}
        {{- if gt (include "swaserve.ranks" . | int) 1 }}
        placement_group_bundles:
          {{- include "swaserve.bundles" . | nindent 10 }}
        placement_group_strategy: {{ $cfg.placement_group_strategy | default "STRICT_PACK" | toJson }}
        {{- end }}
        {{- if $cfg.autoscaling }}
        autoscaling_config:
          {{- toYaml $cfg.autoscaling | nindent 10 }}
        {{- else }}
        num_replicas: {{ $cfg.workers | toJson }}
        {{- end }}
        {{- with .Values.serve.workerOptions }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}

{{/* Environment of every Ray container. RAY_worker_niceness=0: Ray starts actors (the replicas)
at niceness 15 otherwise, behind every other process on the node. */}}
{{- define "swaserve.env" -}}
{{- $env := list (dict "name" "RAY_worker_niceness" "value" "0") }}
{{- if include "swaserve.apiKeyEnabled" . }}
{{- $ref := dict "name" (include "swaserve.apiKeySecretName" .) "key" .Values.apiKey.secretKey }}
{{- $env = append $env (dict "name" "SWASERVE_API_KEY" "valueFrom" (dict "secretKeyRef" $ref)) }}
{{- end }}
{{- $env = concat $env (.Values.env | default list) }}
{{- if $env }}{{ toYaml $env }}{{ end }}
{{- end }}

{{- define "swaserve.probe" -}}
{{- $p := index . 0 -}}
httpGet:
  path: {{ index . 1 }}
  port: {{ index . 2 }}
initialDelaySeconds: {{ $p.initialDelaySeconds }}
periodSeconds: {{ $p.periodSeconds }}
timeoutSeconds: {{ $p.timeoutSeconds }}
failureThreshold: {{ $p.failureThreshold }}
{{- end }}

{{/*
Seconds Kubernetes waits after SIGTERM before it kills a Ray pod: Serve's graceful shutdown of a
worker replica (graceful_shutdown_timeout_s, checked every graceful_shutdown_wait_loop_s; Ray's
defaults 20 and 2 when unset) plus serve.shutdownMarginSeconds, so no drain is cut short.
*/}}
{{- define "swaserve.terminationGraceSeconds" -}}
{{- $o := .Values.serve.workerOptions | default dict }}
{{- $timeout := ternary $o.graceful_shutdown_timeout_s 20 (hasKey $o "graceful_shutdown_timeout_s") | float64 }}
{{- $loop := ternary $o.graceful_shutdown_wait_loop_s 2 (hasKey $o "graceful_shutdown_wait_loop_s") | float64 }}
{{- add (ceil (addf $timeout $loop) | int) (.Values.serve.shutdownMarginSeconds | int) }}
{{- end }}

{{/* Pod-level settings shared by head and workers: (list $root $groupValues). */}}
{{- define "swaserve.podCommon" -}}
{{- $root := index . 0 }}
{{- $group := index . 1 -}}
terminationGracePeriodSeconds: {{ include "swaserve.terminationGraceSeconds" $root }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.model.volume }}
volumes:
  - name: model
    {{- toYaml . | nindent 4 }}
{{- end }}
{{- end }}

{{/* Container settings shared by the head and worker Ray containers. */}}
{{- define "swaserve.containerCommon" -}}
image: {{ include "swaserve.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- with include "swaserve.env" . }}
env:
  {{- . | nindent 2 }}
{{- end }}
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.model.volume }}
volumeMounts:
  - name: model
    mountPath: {{ .Values.model.mountPath }}
    readOnly: true
{{- end }}
{{- end }}
