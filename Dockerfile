# The image deploy/rayservice.yaml runs: Ray 2.60 on Python 3.11 (Ray's own image), CPU torch,
# PhaseMesh and its C++ attention kernel. From the repository root:
#   docker build -t phasemesh:0.1.0 .
# The model is not in the image: the pods mount it at /models (deploy/rayservice.yaml).
# tests/unit/test_packaging.py checks this file against pyproject.toml and rayservice.yaml.
FROM rayproject/ray:2.60.0-py311

# A compiler for the kernel (csrc/); without it the engine runs the pure-torch attention.
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
USER ray
WORKDIR /home/ray/phasemesh

# torch first, pinned and CPU-only: a package that depends on torch would otherwise pull CUDA's.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# Then the package (its Ray pin matches the base image's, so Ray stays as it is) and the kernel.
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users common ./common
COPY --chown=ray:users services ./services
COPY --chown=ray:users loadgen ./loadgen
COPY --chown=ray:users csrc ./csrc
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir nanobind scikit-build-core cmake ninja \
    && pip install --no-cache-dir --no-build-isolation ./csrc
