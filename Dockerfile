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
# pyproject.toml and the chart; tests/test_dockerfile.py checks its CUDA choice.
#
# One CUDA version throughout: the base image's toolkit (FlashInfer JIT-compiles its kernels with
# that nvcc), torch's build (FlashInfer picks its kernels from `torch.version.cuda`) and the
# host's driver must agree. torch 2.13.0 from PyPI is a CUDA 13 build (NVIDIA driver >= 580), so
# torch comes from PyTorch's CUDA 12.8 index instead, matching the cu128 base: hosts need driver
# >= 570. For CUDA 13 hosts build with both set to 13.0:
#   --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-cu130 --build-arg CUDA=13.0
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-cu128
FROM ${RAY_IMAGE}
ARG CUDA=12.8

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/ray/swaserve

# 1. Dependencies only, cached until pyproject.toml changes. torch first, from the index of the
#    image's CUDA version (its local version, e.g. 2.13.0+cu128, satisfies the project's
#    torch==2.13.0, so the requirements below keep it); then the project's requirements and
#    the `gpu` extra (flashinfer, triton), which cannot move it. The build fails here unless
#    torch's CUDA, the toolkit's nvcc and ${CUDA} are one version.
COPY --chown=1000:100 pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > /tmp/requirements.txt \
    && pip install "$(grep '^torch==' /tmp/requirements.txt)" --index-url "https://download.pytorch.org/whl/cu$(echo ${CUDA} | tr -d .)" \
    && pip install -r /tmp/requirements.txt
RUN python -c "import torch; assert torch.version.cuda.startswith('${CUDA}'), (torch.version.cuda, '${CUDA}')" \
    && nvcc --version | grep -q "release ${CUDA}" \
    || { echo "torch's CUDA, the base's nvcc and CUDA=${CUDA} disagree (or the base has no nvcc)"; exit 1; }

# 2. The code, installed as a regular package. Ray's controller, dashboard and workers import
#    deploy.app and the router by module path, so these must be importable in every process.
#    bench/ comes along for `swaserve bench gpu-check` on a serving node (`serve` never imports it).
COPY --chown=1000:100 . .
RUN pip install --no-deps . \
    && python -c "import deploy.config, worker.config, ray; assert ray.__version__ == '2.60.0', ray.__version__" \
    && swaserve serve --help > /dev/null \
    && swaserve bench gpu-check --help > /dev/null

USER 1000:100
EXPOSE 8000 8265 6379 10001
