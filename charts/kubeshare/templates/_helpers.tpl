{{/* Labels every KubeShare object carries. */}}
{{- define "kubeshare.labels" -}}
app.kubernetes.io/part-of: kubeshare
{{- end }}

{{/* A KubeShare image: kubeshare.image (list $ "extender"). */}}
{{- define "kubeshare.image" -}}
{{- $root := index . 0 -}}
{{ printf "%s/kubeshare-%s:%s" $root.Values.images.repository (index . 1) $root.Values.images.tag }}
{{- end }}

{{/* The toleration of the GPU-node taint (KubeShare's components may run on GPU nodes). */}}
{{- define "kubeshare.gpuToleration" -}}
- {key: kubeshare.io/gpu, operator: Exists, effect: NoSchedule}
{{- end }}

{{/* The apiserver's address for KubeShare's in-cluster clients where the `kubernetes`
     Service's ClusterIP does not route (values k8sServiceHost / k8sServicePort): env
     entries, nothing when unset. */}}
{{- define "kubeshare.apiServerEnv" -}}
{{- if .Values.k8sServiceHost }}
{{- if not .Values.k8sServicePort }}
{{- fail "k8sServiceHost is set but k8sServicePort is not: in-cluster clients need both" }}
{{- end }}
- {name: KUBERNETES_SERVICE_HOST, value: {{ .Values.k8sServiceHost | toString | quote }}}
- {name: KUBERNETES_SERVICE_PORT, value: {{ .Values.k8sServicePort | toString | quote }}}
{{- else if .Values.k8sServicePort }}
{{- fail "k8sServicePort is set but k8sServiceHost is not: in-cluster clients need both" }}
{{- end }}
{{- end }}
