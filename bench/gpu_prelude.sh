#!/usr/bin/env bash
# Source this first in a device run (carry [".whl", ".deb"] from ../shared/device/prepare-carry.sh):
#   source bench/gpu_prelude.sh && bash bench/h200.sh tests
# It installs the carried wheels beside the machine's torch and makes the carried .deb libraries loadable.
# The .deb files are unpacked into /opt/deb, not into /: unpacking into / replaces the /lib -> usr/lib symlink
# with a directory (the libnl packages ship ./lib/...), after which the linker cannot find libc and Triton cannot
# build its launcher.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /opt/deb
for f in .deb/*.deb; do dpkg -x "$f" /opt/deb || return 1; done
export LD_LIBRARY_PATH=/opt/deb/usr/lib/x86_64-linux-gnu:/opt/deb/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
python3 -c "import mooncake.engine, fastapi, grpc_health" || return 1
