#!/usr/bin/env bash
# The admission webhook's TLS without cert-manager: a private CA and a serving certificate for the webhook
# Service's DNS names, written into DIR (default: ./kiln-admission-tls). Then, as it prints:
#   kubectl -n kiln create secret tls kiln-admission-tls --cert DIR/tls.crt --key DIR/tls.key
#   and the CA (DIR/ca.crt, base64) into the webhook configuration's caBundle.
# Drop certificate.yaml from the component's kustomization and the webhook's inject-ca-from annotation when you
# use this. The certificate is valid for 365 days: run this again (and update both) before it expires.
set -euo pipefail

dir="${1:-kiln-admission-tls}"
namespace="${KILN_NAMESPACE:-kiln}"
service="${KILN_ADMISSION_SERVICE:-kiln-admission}"
mkdir -p "$dir"
umask 077

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 365 \
  -subj "/CN=${service}-ca" -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -subj "/CN=${service}.${namespace}.svc" -keyout "$dir/tls.key" -out "$dir/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s.%s.svc,DNS:%s.%s.svc.cluster.local\nextendedKeyUsage=serverAuth\n' \
  "$service" "$namespace" "$service" "$namespace" > "$dir/ext.cnf"
openssl x509 -req -in "$dir/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial -days 365 \
  -extfile "$dir/ext.cnf" -out "$dir/tls.crt" 2>/dev/null
rm -f "$dir/tls.csr" "$dir/ext.cnf" "$dir/ca.srl"

ca_bundle=$(base64 < "$dir/ca.crt" | tr -d '\n')
cat <<NEXT
wrote $dir/ca.crt, $dir/tls.crt and $dir/tls.key (keep $dir/ca.key offline). Next:
  kubectl -n $namespace create secret tls kiln-admission-tls --cert $dir/tls.crt --key $dir/tls.key
  kubectl patch validatingwebhookconfiguration kiln-engines --type json \\
    -p '[{"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": "$ca_bundle"}]'
NEXT
