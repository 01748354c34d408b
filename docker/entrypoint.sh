#!/usr/bin/env bash
# Entry point of the CPU image. Runs the command (default: `hack demo`) as the unprivileged
# user hack; a container started as root only to shape its link (compose.cpu.yaml's prefill,
# with cap NET_ADMIN and HACK_LINK_MBPS set) shapes its egress first, then drops to hack.
set -euo pipefail
if [ -n "${HACK_LINK_MBPS:-}" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "error: HACK_LINK_MBPS=${HACK_LINK_MBPS} needs the container to start as root with cap NET_ADMIN (user: \"0:0\", cap_add: [NET_ADMIN]); it drops to the user hack after shaping" >&2
        exit 1
    fi
    python -m disagg.netns shape-egress "$HACK_LINK_MBPS"
fi
if [ "$(id -u)" = 0 ]; then
    # Never serve as root: the same user as an image started without `user:`.
    exec env HOME=/home/hack USER=hack setpriv --reuid=1000 --regid=1000 --init-groups \
        --inh-caps=-all --bounding-set=-all -- "$@"
fi
exec "$@"
