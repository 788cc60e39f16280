#!/bin/sh
# `pip install` inside an image build (the images' build stages run every pip install through this).
#
# - A CA bundle handed in as the BuildKit secret `pip_cert` (`docker build --secret id=pip_cert,src=FILE`,
#   or `build.secrets` in compose) is used for PyPI: builds behind a TLS-intercepting proxy need their own
#   bundle. A secret is mounted for one RUN only, so it never enters a layer; without it pip uses its own.
# - Wheels in images/wheels/ (bind-mounted at /wheels) are candidates beside the index: an air-gapped
#   build, or a torch build the index does not serve, drops its wheels there.
set -eu
if [ -s /run/secrets/pip_cert ]; then
    export PIP_CERT=/run/secrets/pip_cert
fi
if [ -d /wheels ]; then
    set -- --find-links /wheels "$@"
fi
exec pip install "$@"
