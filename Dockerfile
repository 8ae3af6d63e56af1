# syntax=docker/dockerfile:1
# The image the Helm chart (helm/swaserve) runs on every Ray pod: Ray + swaserve + CUDA torch.
#
#   docker build -t REGISTRY/swaserve:0.1.0 .
#   docker push REGISTRY/swaserve:0.1.0
#
# The base is Ray's own GPU image, which already has everything KubeRay expects: `ray start`,
# the dashboard agent, bash and wget, and the non-root user `ray` (uid 1000, gid 100) that the
# chart's securityContext runs as. Its Ray and Python versions must match the project's pin
# (ray[serve]==2.60.0, Python 3.11). tests/deploy/test_helm_chart.py checks this file against
# pyproject.toml and the chart.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/ray/swaserve

# 1. Dependencies only, cached until pyproject.toml changes. On Linux, torch==2.13.0 from PyPI is
#    the CUDA build. It is pinned in the same requirements as flashinfer/triton so they cannot
#    move it.
COPY --chown=1000:100 pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# 2. The code, installed as a regular package. Ray's controller, dashboard and workers import
#    deploy.app and the router by module path, so these must be importable in every process.
#    bench/ stays out (.dockerignore): `swaserve serve` never imports it.
COPY --chown=1000:100 . .
RUN pip install --no-deps . \
    && python -c "import deploy.config, worker.config, ray; assert ray.__version__ == '2.60.0', ray.__version__" \
    && swaserve serve --help > /dev/null

USER 1000:100
EXPOSE 8000 8265 6379 10001
