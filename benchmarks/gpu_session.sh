#!/usr/bin/env bash
# The GPU session of issues 34 and 49 (benchmarks/gpu_session.py says what each stage measures; its header
# is the full recipe: what to fetch, what to carry, the call, what to commit after).
#
# On the lent GPU (one NVIDIA H200; 15 minutes of device time per session, 10 per command), ONE call of
# the device tool `run`, from the repository root of the checkout the session was started in:
#
#   1. here, before the call, once (the GPU image has torch 2.11 / Triton 3.6, no Diffusers, no registry):
#        bash benchmarks/gpu_session.sh --fetch-wheels      # Diffusers' wheel into benchmarks/wheels/ (ignored by git)
#   2. run(command='set -o pipefail; bash benchmarks/gpu_session.sh "$OUT" 2>&1 | tee "$OUT/gpu_session.log"',
#          carry=["benchmarks/wheels"], timeout_s=450)
#      The stages get 400 s (GPU_SESSION_BUDGET_S), each in its own time-limited process, under an outer
#      limit of 430 s; the JSON and the Markdown in $OUT are rewritten after every stage, so a cut run keeps
#      what it measured, and the reply's output_tail ends with the Markdown. With the machine's start the
#      call stays under 10 minutes of device time.
#   3. give_back; then here: copy gpu_session.json from the reply's files_at into benchmarks/results/
#      (dated name), python benchmarks/gpu_session.py --report benchmarks/results/<file>.json --write-doc docs/speed.md
#      and commit both ("Run it whenever a GPU is available to the project, and commit the numbers").
#
# Smoke (CPU, tiny sizes, every stage, about a minute; the test suite runs it):
#   bash benchmarks/gpu_session.sh --smoke OUT
#
# How the GPU machine gets what it needs: this project is imported from the working tree (PYTHONPATH, no
# install). Diffusers, when missing, comes from a wheel carried in benchmarks/wheels/, else from the registry
# if one answers, else the end-to-end stage is skipped with a line saying so. Extra arguments go to
# gpu_session.py (e.g. --stages versions,timing).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
wheels="$root/benchmarks/wheels"
python="${PYTHON:-python3}"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  version="$("$python" -c 'import diffusers; print(diffusers.__version__)' 2>/dev/null || echo 0.42.1)"
  mkdir -p "$wheels"
  exec "$python" -m pip download --no-deps --only-binary=:all: -d "$wheels" "diffusers==$version"
fi

smoke=0
for arg in "$@"; do [[ "$arg" == "--smoke" ]] && smoke=1; done
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [[ $smoke == 0 ]] && ! "$python" -c 'import diffusers' 2>/dev/null; then
  site=/tmp/gpu_session_site
  if compgen -G "$wheels/diffusers-*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
      && export PYTHONPATH="$PYTHONPATH:$site" && echo "gpu_session: Diffusers from the carried wheel" >&2
  elif timeout 60 "$python" -m pip install -q --no-deps --no-compile --target "$site" --timeout 10 --retries 0 \
      "diffusers>=0.42,<0.43" 2>/dev/null; then
    export PYTHONPATH="$PYTHONPATH:$site" && echo "gpu_session: Diffusers from the package registry" >&2
  else
    echo "gpu_session: no Diffusers (no wheel in benchmarks/wheels/, no registry): the end-to-end stage will be skipped" >&2
  fi
fi

budget="${GPU_SESSION_BUDGET_S:-400}"
# the stages stop themselves inside the budget; this outer limit only catches a hang of the driver itself
timeout --signal=TERM --kill-after=10 $((budget + 30)) "$python" "$root/benchmarks/gpu_session.py" --budget-s "$budget" "$@"
status=$?
if [[ $status == 124 || $status == 137 ]]; then  # killed: print what the JSON holds
  for arg in "$@"; do [[ -f "$arg/gpu_session.md" ]] && cat "$arg/gpu_session.md"; done
fi
exit $status
