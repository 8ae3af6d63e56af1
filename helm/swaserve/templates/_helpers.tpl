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
{{- $o := .Values.serve.workerOptions | default dict }}
{{- if and (hasKey $o "graceful_shutdown_timeout_s") (hasKey (.Values.serve.config | default dict) "graceful_shutdown_timeout_s") }}
{{- if ne ($o.graceful_shutdown_timeout_s | float64) (.Values.serve.config.graceful_shutdown_timeout_s | float64) }}
{{- fail (printf "serve.config.graceful_shutdown_timeout_s (%v) and serve.workerOptions.graceful_shutdown_timeout_s (%v) differ: Ray would run the workerOptions' one; set one of them" .Values.serve.config.graceful_shutdown_timeout_s $o.graceful_shutdown_timeout_s) }}
{{- end }}
{{- end }}
{{- if and .Values.apiKey.existingSecret .Values.apiKey.value }}
{{- fail "set apiKey.existingSecret or apiKey.value, not both" }}
{{- end }}
{{- if and (include "swaserve.apiKeyEnabled" .) (not (.Values.podSecurityContext | default dict).fsGroup) }}
{{- fail "an API key needs podSecurityContext.fsGroup (the pods' group, 100 in the image): the key file is readable by that group only" }}
{{- end }}
{{- if and .Values.networkPolicy.enabled .Values.networkPolicy.restrictEgress (not .Values.networkPolicy.extraEgress) }}
{{- fail "networkPolicy.restrictEgress needs networkPolicy.extraEgress admitting the Kubernetes API server (the autoscaler scales through it): e.g. an ipBlock of its endpoint, port 443 or 6443" }}
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

{{/* Paths the chart owns inside the image: its user's ~/.cache, and where the API key file lies. */}}
{{- define "swaserve.cacheDir" -}}/home/ray/.cache{{- end }}
{{- define "swaserve.apiKeyDir" -}}/var/run/secrets/swaserve{{- end }}

{{/*
Environment of a Ray container: (list $root $role), role "head" or "worker".
RAY_worker_niceness=0: Ray starts actors (the replicas) at niceness 15 otherwise, behind every
other process on the node. Triton and the CUDA driver cache JIT code under ~/.triton and ~/.nv,
which the read-only root filesystem refuses: both go to the cache emptyDir. The API key is a
file on the workers only (the ingress replicas run there: the head has num-cpus 0).
*/}}
{{- define "swaserve.env" -}}
{{- $root := index . 0 }}
{{- $cache := include "swaserve.cacheDir" $root }}
{{- $env := list (dict "name" "RAY_worker_niceness" "value" "0") }}
{{- $env = append $env (dict "name" "TRITON_CACHE_DIR" "value" (printf "%s/triton" $cache)) }}
{{- $env = append $env (dict "name" "CUDA_CACHE_PATH" "value" (printf "%s/nv" $cache)) }}
{{- if and (eq (index . 1) "worker") (include "swaserve.apiKeyEnabled" $root) }}
{{- $file := printf "%s/api-key" (include "swaserve.apiKeyDir" $root) }}
{{- $env = append $env (dict "name" "SWASERVE_API_KEY_FILE" "value" $file) }}
{{- end }}
{{- $env = concat $env ($root.Values.env | default list) }}
{{- toYaml $env }}
{{- end }}

{{/*
Volumes of a Ray pod: (list $root $role). The model; the writable scratch of the read-only root
filesystem; on the head the autoscaler's /tmp and its API credentials (`kube-api-access`, what
Kubernetes would automount, but here mounted into the autoscaler container only); on the
workers /dev/shm in memory (NCCL's shared-memory transport between a replica's GPUs, and Ray's
object store: the chart's own rather than whatever the operator adds) and the API key Secret
(0440: root-owned, readable through fsGroup).
*/}}
{{- define "swaserve.volumes" -}}
{{- $root := index . 0 }}
{{- $volumes := list }}
{{- with $root.Values.model.volume }}
{{- $volumes = append $volumes (merge (dict "name" "model") (deepCopy .)) }}
{{- end }}
{{- $volumes = append $volumes (dict "name" "tmp" "emptyDir" ($root.Values.scratch.tmp | default dict)) }}
{{- $volumes = append $volumes (dict "name" "cache" "emptyDir" ($root.Values.scratch.cache | default dict)) }}
{{- if eq (index . 1) "head" }}
{{- $volumes = append $volumes (dict "name" "autoscaler-tmp" "emptyDir" dict) }}
{{- $token := dict "serviceAccountToken" (dict "path" "token" "expirationSeconds" 3607) }}
{{- $ca := dict "configMap" (dict "name" "kube-root-ca.crt" "items" (list (dict "key" "ca.crt" "path" "ca.crt"))) }}
{{- $ns := dict "downwardAPI" (dict "items" (list (dict "path" "namespace" "fieldRef" (dict "apiVersion" "v1" "fieldPath" "metadata.namespace")))) }}
{{- $volumes = append $volumes (dict "name" "kube-api-access" "projected" (dict "defaultMode" 420 "sources" (list $token $ca $ns))) }}
{{- else }}
{{- $volumes = append $volumes (dict "name" "dshm" "emptyDir" (dict "medium" "Memory")) }}
{{- end }}
{{- if and (eq (index . 1) "worker") (include "swaserve.apiKeyEnabled" $root) }}
{{- $items := list (dict "key" $root.Values.apiKey.secretKey "path" "api-key") }}
{{- $secret := dict "secretName" (include "swaserve.apiKeySecretName" $root) "items" $items "defaultMode" 288 }}
{{- $volumes = append $volumes (dict "name" "api-key" "secret" $secret) }}
{{- end }}
{{- toYaml $volumes }}
{{- end }}

{{/* Volume mounts of a Ray container: (list $root $role). */}}
{{- define "swaserve.volumeMounts" -}}
{{- $root := index . 0 }}
{{- $mounts := list }}
{{- if $root.Values.model.volume }}
{{- $mounts = append $mounts (dict "name" "model" "mountPath" $root.Values.model.mountPath "readOnly" true) }}
{{- end }}
{{- $mounts = append $mounts (dict "name" "tmp" "mountPath" "/tmp") }}
{{- $mounts = append $mounts (dict "name" "cache" "mountPath" (include "swaserve.cacheDir" $root)) }}
{{- if eq (index . 1) "worker" }}
{{- $mounts = append $mounts (dict "name" "dshm" "mountPath" "/dev/shm") }}
{{- end }}
{{- if and (eq (index . 1) "worker") (include "swaserve.apiKeyEnabled" $root) }}
{{- $mounts = append $mounts (dict "name" "api-key" "mountPath" (include "swaserve.apiKeyDir" $root) "readOnly" true) }}
{{- end }}
{{- toYaml $mounts }}
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
worker replica (graceful_shutdown_timeout_s: workerOptions', else serve.config's, else swaserve's
60; checked every graceful_shutdown_wait_loop_s, default 2) plus serve.shutdownMarginSeconds, so no
drain is cut short.
*/}}
{{- define "swaserve.terminationGraceSeconds" -}}
{{- $o := .Values.serve.workerOptions | default dict }}
{{- $cfg := .Values.serve.config | default dict }}
{{- $fallback := ternary $cfg.graceful_shutdown_timeout_s 60 (hasKey $cfg "graceful_shutdown_timeout_s") }}
{{- $timeout := ternary $o.graceful_shutdown_timeout_s $fallback (hasKey $o "graceful_shutdown_timeout_s") | float64 }}
{{- $loop := ternary $o.graceful_shutdown_wait_loop_s 2 (hasKey $o "graceful_shutdown_wait_loop_s") | float64 }}
{{- add (ceil (addf $timeout $loop) | int) (.Values.serve.shutdownMarginSeconds | int) }}
{{- end }}

{{/*
Pod-level settings shared by head and workers: (list $root $groupValues $role). No pod gets the
service account token automatically: only the head's autoscaler container needs the API, and it
mounts `kube-api-access` itself (autoscalerOptions.volumeMounts).
*/}}
{{- define "swaserve.podCommon" -}}
{{- $root := index . 0 }}
{{- $group := index . 1 -}}
terminationGracePeriodSeconds: {{ include "swaserve.terminationGraceSeconds" $root }}
automountServiceAccountToken: false
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
volumes:
  {{- include "swaserve.volumes" (list $root (index . 2)) | nindent 2 }}
{{- end }}

{{/* Container settings shared by the head and worker Ray containers: (list $root $role). */}}
{{- define "swaserve.containerCommon" -}}
{{- $root := index . 0 -}}
image: {{ include "swaserve.image" $root }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
env:
  {{- include "swaserve.env" . | nindent 2 }}
{{- with $root.Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  {{- include "swaserve.volumeMounts" . | nindent 2 }}
{{- end }}
