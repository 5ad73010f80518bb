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
