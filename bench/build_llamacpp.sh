#!/usr/bin/env bash
# Build llama.cpp's HTTP server natively (-march=native) for bench/peers.py --llama-server, and its
# llama-quantize for bench/make_bench_model.py's K-quant files (the gguf package cannot write them).
#
# The source is the llama.cpp that PyPI's llama-cpp-python sdist vendors (pip can reach PyPI where
# GitHub may not be). AMX is switched off: on some AMX machines its matmul traps with an illegal
# instruction during prompt processing (issue 30). Prints the server's path on its last line (the
# quantizer is beside it); a second run with the same version reuses the cached build.
#
#   bench/build_llamacpp.sh                  # llama-cpp-python 0.3.36
#   LLAMA_CPP_PYTHON_VERSION=0.3.35 bench/build_llamacpp.sh
#
# Environment: LLAMA_CPP_PYTHON_VERSION, PYTHON (default python3), TANDEM_BENCH_CACHE (default
# ~/.cache/tandem/bench), JOBS (default: the number of CPUs).
set -euo pipefail

version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
python=${PYTHON:-python3}
cache=${TANDEM_BENCH_CACHE:-$HOME/.cache/tandem/bench}
target="$cache/llama.cpp-$version-native"
server="$target/llama-server"
quantize="$target/llama-quantize"
if [[ -x "$server" && -x "$quantize" ]]; then
    echo "$server"
    exit 0
fi

scratch=$(mktemp -d "${TMPDIR:-/tmp}/llamacpp-build.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
"$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$scratch"
tar xzf "$scratch"/llama_cpp_python-"$version".tar.gz -C "$scratch"
source_dir="$scratch/llama_cpp_python-$version/vendor/llama.cpp"

# GGML_NATIVE=OFF so that our -march=native comes with the AMX switches after it (ggml's own
# native option appends -march=native last, which would turn AMX back on).
native_flags="-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$source_dir" -B "$scratch/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DCMAKE_C_FLAGS="$native_flags" -DCMAKE_CXX_FLAGS="$native_flags" \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DGGML_OPENMP=ON >"$scratch/cmake.log"
cmake --build "$scratch/build" --target llama-server llama-quantize -j "${JOBS:-$(nproc)}" >"$scratch/build.log"

mkdir -p "$target"
cp "$scratch/build/bin/llama-quantize" "$quantize.partial"
mv "$quantize.partial" "$quantize"
cp "$scratch/build/bin/llama-server" "$target/llama-server.partial"
cat >"$target/BUILD_INFO" <<EOF
source: llama.cpp vendored in llama-cpp-python $version (PyPI sdist)
flags: $native_flags, GGML_OPENMP=ON, Release
compiler: $(${CC:-cc} --version | head -n 1)
built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)
EOF
mv "$target/llama-server.partial" "$server"
echo "$server"
