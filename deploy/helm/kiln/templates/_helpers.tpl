{{/* "kiln" for a release named kiln; a release whose name contains "kiln" keeps it; any other "<release>-kiln". */}}
{{- define "kiln.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains "kiln" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kiln" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object; with a component: (dict "root" $ "component" "api") */}}
{{- define "kiln.labels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/part-of: kiln
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{/* What a workload's selector and its pods' labels share: (dict "root" $ "component" "api") */}}
{{- define "kiln.selectorLabels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kiln.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{/* Non-root, as in the kustomize base (Pod Security "restricted"). */}}
{{- define "kiln.podSecurityContext" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{/* (dict "readOnly" true) */}}
{{- define "kiln.containerSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: {{ .readOnly }}
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* A pod spec's imagePullSecrets (pod specs are indented 6), or nothing */}}
{{- define "kiln.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
{{- end }}
{{- end -}}

{{/* Pods restart when their configuration changes. */}}
{{- define "kiln.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/config.yaml") . | sha256sum }}
checksum/secrets: {{ include (print .Template.BasePath "/secrets.yaml") . | sha256sum }}
{{- end -}}

{{/* envFrom of the API, the workers and the migrations: the config and the backends, then (dict "root" $ "secrets"
(list …) "configMaps" (list …)) these Secrets and ConfigMaps by suffix */}}
{{- define "kiln.envFrom" -}}
envFrom:
  - configMapRef:
      name: {{ include "kiln.fullname" .root }}-config
  - secretRef:
      name: {{ include "kiln.fullname" .root }}-backends
  {{- range .secrets }}
  - secretRef:
      name: {{ include "kiln.fullname" $.root }}-{{ . }}
  {{- end }}
  {{- range .configMaps }}
  - configMapRef:
      name: {{ include "kiln.fullname" $.root }}-{{ . }}
  {{- end }}
{{- end -}}

{{/* Refuse to render while a secret is a REPLACE-ME placeholder (or empty where Kiln needs it): the message names
the value. Kiln's processes refuse placeholders too; this says so before anything is applied. */}}
{{- define "kiln.checkSecrets" -}}
{{- $placeholder := "(?i)replace[-_ ]?me" -}}
{{- $checks := list (list "trustedKeys" "KILN_TRUSTED_KEYS" .Values.trustedKeys true "openssl ec -in signing-key.pem -pubout") -}}
{{- if .Values.secrets.create -}}
{{- $checks = concat $checks (list
  (list "secrets.bootstrapToken" "KILN_BOOTSTRAP_TOKEN" .Values.secrets.bootstrapToken true "openssl rand -hex 32")
  (list "secrets.webhookSecret" "KILN_WEBHOOK_SECRET" .Values.secrets.webhookSecret false "openssl rand -hex 32, or empty: webhooks off")
  (list "secrets.signingKey" "KILN_SIGNING_KEY" .Values.secrets.signingKey true "openssl ecparam -name prime256v1 -genkey -noout")
  (list "database.url" "KILN_DATABASE_URL" .Values.database.url true "your PostgreSQL URL with its password")
  (list "broker.url" "KILN_BROKER_URL" .Values.broker.url true "your Redis URL")
  (list "s3Credentials.accessKeyId" "AWS_ACCESS_KEY_ID" .Values.s3Credentials.accessKeyId false "the S3 access key")
  (list "s3Credentials.secretAccessKey" "AWS_SECRET_ACCESS_KEY" .Values.s3Credentials.secretAccessKey false "the S3 secret key")) -}}
{{- end -}}
{{- range $checks -}}
{{- $value := toString (index . 2) -}}
{{- if regexMatch $placeholder $value -}}
{{- fail (printf "%s (%s) is a placeholder (REPLACE-ME…): set it in your values (%s)" (index . 0) (index . 1) (index . 4)) -}}
{{- else if and (index . 3) (not (trim $value)) -}}
{{- fail (printf "%s (%s) is empty: set it in your values (%s)" (index . 0) (index . 1) (index . 4)) -}}
{{- end -}}
{{- end -}}
{{- if not .Values.networkPolicies.apiFrom -}}
{{- fail "networkPolicies.apiFrom is empty, which a NetworkPolicy reads as every source: list the peers that may reach the API" -}}
{{- end -}}
{{- if (.Values.admission).trustedKeys -}}
{{- fail "admission.trustedKeys is now trustedKeys (the API trusts the same keys): move it" -}}
{{- end -}}
{{- end -}}

{{/* A worker's exec probes: `kiln worker-probe live|ready` (api/cli_service.py, workers/liveness.py) */}}
{{- define "kiln.workerProbes" -}}
{{- $p := .Values.workers.probes -}}
startupProbe:
  exec:
    command: ["kiln", "worker-probe", "live"]
  periodSeconds: 10
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ div $p.startupSeconds 10 }}
livenessProbe:
  exec:
    command: ["kiln", "worker-probe", "live"]
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
readinessProbe:
  exec:
    command: ["kiln", "worker-probe", "ready"]
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
{{- end -}}

{{/* sm90 → "9" and "0"; sm100 → "10" and "0"; sm89 → "8" and "9" (GPU feature discovery's compute labels) */}}
{{- define "kiln.computeMajor" -}}
{{- if not (regexMatch "^sm[0-9]{2,3}$" .) -}}
{{- fail (printf "workers.gpuPools: %q is not a GPU target; use a key such as sm89, sm90, sm100 or sm120" .) -}}
{{- end -}}
{{- $sm := trimPrefix "sm" . -}}
{{- substr 0 (int (sub (len $sm) 1)) $sm -}}
{{- end -}}
{{- define "kiln.computeMinor" -}}
{{- $sm := trimPrefix "sm" . -}}
{{- substr (int (sub (len $sm) 1)) (len $sm) $sm -}}
{{- end -}}
