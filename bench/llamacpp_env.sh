#!/usr/bin/env bash
# The llama.cpp side of bench/engine.py runs in an environment of its own, never in the project's:
# llama-cpp-python is no project dependency. This builds it once, from the registry's sdist,
# CPU only, tuned for this machine (GGML_NATIVE), into .venv-llamacpp/ (git-ignored).
#
#   bench/llamacpp_env.sh                  # or: make bench-llamacpp-env
#   LLAMACPP_SDIST=path/to/llama_cpp_python-0.3.36.tar.gz bench/llamacpp_env.sh   # no download
#
# The build is one compile at a time at the lowest priority (it takes a while; a shared machine
# keeps its cores). Re-running with the package already importable does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLAMACPP_VENV:-.venv-llamacpp}
VERSION=0.3.36
PYTHON=${PYTHON:-python3}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import llama_cpp' 2>/dev/null; then
    echo "$VENV: llama-cpp-python $("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)') is there"
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
# The build's own tools and the package's runtime dependencies first, then the build without
# isolation (no second download of them).
"$VENV/bin/pip" install -q 'scikit-build-core[pyproject]>=0.9.2' numpy typing-extensions diskcache jinja2
SOURCE=${LLAMACPP_SDIST:-llama-cpp-python==$VERSION}
# CPU only; no multimodal (mtmd) library, which the bench does not load.
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" \
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1} \
    nice -n 19 "$VENV/bin/pip" install --no-build-isolation --no-binary llama-cpp-python "$SOURCE"
"$VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__, "built")'
