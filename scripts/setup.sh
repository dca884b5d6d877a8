#!/usr/bin/env bash
# Create .venv in the repo root and install the CPU stack, the shipped model packages, lemon itself (editable), and llama.cpp's
# `llama-server` (the embedded default's workers: lemon/run/servers.py starts one per shipped model).
# Idempotent: rerunning only installs what is missing; llama-server is rebuilt only when its source sha256 or CPU flags change.
#   LEMON_LLAMA_JOBS=N   compile jobs (default: usable cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/pip install -q --upgrade pip

# ---- llama-server from a pinned, checksummed llama.cpp source ------------------------------------------------------------
# The source is the llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist (PyPI is reachable here; GitHub is not).
# A mismatching download is refused: the digest below is the one this project measured and tested.
LLAMA_SDIST=llama_cpp_python-0.3.36
LLAMA_SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# SIMD flags from /proc/cpuinfo, never -march=native (GGML_NATIVE=ON): on these VMs the CPU may report AMX that the VM does
# not enable, and -march=native then dies with SIGILL (issue 12, measured here). Linux lists AVX-512 only when the kernel enabled its state.
# Explicit AVX-512 + VNNI + BF16 measured ~1.3-1.6x over the AVX2-only build on the 1.5B (issue 12). AMX is never enabled.
cpu_has() { grep -m1 '^flags' /proc/cpuinfo | tr ' \t' '\n\n' | grep -qx "$1"; }
SIMD=(-DGGML_NATIVE=OFF)
for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI; do
  if cpu_has "${pair%%:*}"; then SIMD+=("-DGGML_${pair#*:}=ON"); else SIMD+=("-DGGML_${pair#*:}=OFF"); fi
done
if cpu_has avx512f && cpu_has avx512cd && cpu_has avx512vl && cpu_has avx512dq && cpu_has avx512bw; then
  SIMD+=(-DGGML_AVX512=ON)  # ggml's GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw: all five must be there
  for pair in avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if cpu_has "${pair%%:*}"; then SIMD+=("-DGGML_${pair#*:}=ON"); else SIMD+=("-DGGML_${pair#*:}=OFF"); fi
  done
else
  SIMD+=(-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
fi
# Compile time (the 12-minute setup budget): of ~15 CPU-minutes at -O3, 30% is tools/mtmd (multimodal, linked by the server
# but never run here) and 45% is JSON / templates / HTTP code that runs once per request. A deferred CMake call lowers
# those targets to -O0 / -O1; ggml and libllama (every token's work) stay at -O3. bench/server_bench.py checks the result
# against llama-batched-bench.
OPT_CMAKE='get_property(_lemon_done GLOBAL PROPERTY LEMON_OPT_DEFERRED)
if(NOT _lemon_done)
  set_property(GLOBAL PROPERTY LEMON_OPT_DEFERRED TRUE)
  function(_lemon_opt_levels)
    foreach(t mtmd)
      if(TARGET ${t})
        set_property(TARGET ${t} APPEND PROPERTY COMPILE_OPTIONS -O0)
      endif()
    endforeach()
    foreach(t llama-common cpp-httplib server-context llama-server-impl)
      if(TARGET ${t})
        set_property(TARGET ${t} APPEND PROPERTY COMPILE_OPTIONS -O1)
      endif()
    endforeach()
  endfunction()
  cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _lemon_opt_levels)
endif()'
OPT_ID=$(printf '%s' "$OPT_CMAKE" | sha256sum | cut -c1-12)
# Static (no shared libs to install beside the binary), offline (no UI download, no HTTPS), only what the server needs.
CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
             -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_AMX_TILE=OFF
             -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "${SIMD[@]}")
KEY="sdist_sha256=$LLAMA_SDIST_SHA256 opt=$OPT_ID cmake=${CMAKE_FLAGS[*]}"
KEY_ID=$(printf '%s' "$KEY" | sha256sum | cut -c1-12)
SRC=.venv/src/llama.cpp-$LLAMA_SDIST_SHA256
BUILD=.venv/src/llama.cpp-build-$KEY_ID  # kept: bench/server_bench.py builds llama-batched-bench in it incrementally
STAMP=.venv/bin/llama-server.build
build_llama_server() {
  mkdir -p .venv/src
  if [ ! -f "$SRC/CMakeLists.txt" ]; then
    # --no-binary for this one package only: with :all:, pip also builds the sdist's BUILD dependencies (scikit-build-core,
    # hatchling, setuptools-scm, ...) from source just to read its metadata, minutes before the compile can start (measured
    # 2026-12-02 on a fresh clone with no pip cache); their wheels are pure Python and change nothing in what is built.
    .venv/bin/pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==${LLAMA_SDIST#llama_cpp_python-}" \
      -d .venv/src
    got=$(sha256sum ".venv/src/$LLAMA_SDIST.tar.gz" | cut -d' ' -f1)
    if [ "$got" != "$LLAMA_SDIST_SHA256" ]; then
      rm -f ".venv/src/$LLAMA_SDIST.tar.gz"
      echo "setup: ERROR: $LLAMA_SDIST.tar.gz has sha256 $got, expected $LLAMA_SDIST_SHA256; refusing to build it" >&2
      exit 1
    fi
    rm -rf "$SRC.part" && mkdir -p "$SRC.part"
    tar xzf ".venv/src/$LLAMA_SDIST.tar.gz" -C "$SRC.part" --strip-components=3 "$LLAMA_SDIST/vendor/llama.cpp"
    mv "$SRC.part" "$SRC" && rm -f ".venv/src/$LLAMA_SDIST.tar.gz"
  fi
  GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
  local CMAKE=cmake
  if ! command -v cmake >/dev/null; then  # images without cmake: PyPI's (a wheel, no compile) into the venv
    .venv/bin/pip install -q "cmake>=3.21,<4"
    CMAKE=.venv/bin/cmake
  fi
  echo "setup: building llama-server (build $KEY_ID: ${SIMD[*]}); ~7 min on 2 idle cores"
  printf '%s\n' "$OPT_CMAKE" >"$BUILD.opt.cmake"
  "$CMAKE" -S "$SRC" -B "$BUILD" "${GEN[@]}" "${CMAKE_FLAGS[@]}" -DCMAKE_PROJECT_INCLUDE="$(realpath "$BUILD.opt.cmake")" \
    >"$BUILD.log" 2>&1 \
    && "$CMAKE" --build "$BUILD" -j "${LEMON_LLAMA_JOBS:-$(nproc)}" --target llama-server >>"$BUILD.log" 2>&1 \
    || { echo "setup: ERROR: llama-server build failed; last lines of $BUILD.log:" >&2; tail -30 "$BUILD.log" >&2; exit 1; }
  install -m 0755 "$BUILD/bin/llama-server" .venv/bin/llama-server.new && mv .venv/bin/llama-server.new .venv/bin/llama-server
  printf 'key=%s\nbuild_dir=%s\nsource=%s\nbuilt=%s\n' "$KEY" "$(realpath "$BUILD")" "$(realpath "$SRC")" \
    "$(date -u +%FT%TZ)" >"$STAMP"
}
# The compile (~7 min on 2 cores) runs beside the pip installs below, which mostly wait on downloads and unpacking. It gets
# its own process group (set -m) so that a failing pip step or Ctrl-C stops it too (the EXIT trap).
BUILD_PID=
trap 'if [ -n "$BUILD_PID" ]; then kill -- "-$BUILD_PID" 2>/dev/null || true; fi' EXIT
if [ -x .venv/bin/llama-server ] && [ -f "$STAMP" ] && grep -qxF "key=$KEY" "$STAMP"; then
  echo "setup: llama-server up to date (build $KEY_ID)"
else
  set -m; build_llama_server & BUILD_PID=$!; set +m
fi
# torch first, from the pinned CPU build; the constraint file keeps every later package on it.
.venv/bin/pip install -q -c constraints.txt torch==2.13.0
.venv/bin/pip install -q -c constraints.txt -r requirements.txt
.venv/bin/pip install -q --no-deps -r requirements-models.txt
.venv/bin/pip install -q --no-deps -e .
.venv/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null
# The policies' fp32 transformers folders (lemon.policy.model.converted_dir; cached, so a rerun is instant): converted here
# once, beside the compile, rather than inside whichever test or notebook first loads a policy (tests/conftest.py holds
# every test to 90 s; a fresh conversion of the 0.5B alone takes tens of seconds).
.venv/bin/python -c 'from lemon.policy.model import converted_dir as c; [print("setup: policy", c(m)) for m in ("smollm2-135m", "qwen2.5-coder-0.5b")]' 2>&1 \
  | grep '^setup: ' || { echo "setup: ERROR: converting the shipped policy models failed" >&2; exit 1; }
if [ -n "$BUILD_PID" ]; then
  wait "$BUILD_PID" || { BUILD_PID=; echo "setup: ERROR: llama-server was not built (see above)" >&2; exit 1; }
  BUILD_PID=
fi
.venv/bin/llama-server --version 2>&1 | grep -m1 -i version | sed 's/^/setup: llama-server /' || true
echo "setup: .venv ready ($(.venv/bin/python -c 'import torch,transformers,trl;print("torch",torch.__version__,"transformers",transformers.__version__,"trl",trl.__version__)'))"
# The GPU stack (CUDA torch, Unsloth, vLLM; unsloth 2026.10.9 caps trl at 1.15, whose GRPO loss cannot run on a CPU) is a
# SEPARATE environment: bash scripts/setup-gpu.sh (.venv-gpu, hashed requirements-gpu.txt).
