#!/bin/sh
# Makes the tokens the overlays need, once, as files kustomize reads (never committed):
#   base/secrets/admin-token        -> Secret continuum-admin-token (router /admin/*)
#   overlays/push/secrets/bus-token -> Secret continuum-bus-token (listeners' bus bearer)
# and writes the bus token's sha256 into overlays/push/router.yaml's brokers[].token_hash,
# which is how the router recognizes it. Existing token files are kept (delete one to
# rotate it). Run from anywhere: sh deploy/k8s/make-secrets.sh
set -eu
here=$(cd "$(dirname "$0")" && pwd)
umask 077
token() { od -An -tx1 -N32 /dev/urandom | tr -d ' \n'; }
for f in "$here/base/secrets/admin-token" "$here/overlays/push/secrets/bus-token"; do
  if [ ! -s "$f" ]; then token > "$f"; echo "made $f"; fi
done
hash=$(tr -d ' \n\r\t' < "$here/overlays/push/secrets/bus-token" | sha256sum | cut -d' ' -f1)
config="$here/overlays/push/router.yaml"
edited=$(mktemp)
sed "s/token_hash: \"sha256:[0-9a-f]*\"/token_hash: \"sha256:$hash\"/" "$config" > "$edited"
cat "$edited" > "$config"   # in place, keeping the file's mode
rm -f "$edited"
echo "bus token hash written to $here/overlays/push/router.yaml"
