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
# Tuned for this CPU (GGML_NATIVE), but where the CPU has AMX: there this version's native build
# ran a tile instruction with no tile configuration loaded on its thread while reserving its
# graph, and the worker died of SIGILL (AMX itself works here once a process asks Linux for the
# tiles and loads a configuration). There, the same ISA as native, named one by one, AMX left out.
ISA="-DGGML_NATIVE=ON"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    for flag in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
                avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        grep -qw "${flag%%:*}" /proc/cpuinfo && ISA="$ISA -DGGML_${flag##*:}=ON"
    done
    echo "$VENV: AMX CPU: llama.cpp built without AMX ($ISA)"
fi
# CPU only; no multimodal (mtmd) library, which the bench does not load. No pip cache: a wheel
# pip built for another machine's flags, or other flags, would be installed instead of a build.
CMAKE_ARGS="$ISA -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" \
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1} \
    nice -n 19 "$VENV/bin/pip" install --no-build-isolation --no-cache-dir \
        --no-binary llama-cpp-python "$SOURCE"
"$VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__, "built")'
