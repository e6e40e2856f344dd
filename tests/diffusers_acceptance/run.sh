#!/usr/bin/env bash
# Diffusers' own model tests of every family MHLA converts, run on the converted (MHLA) classes.
# Usage: tests/diffusers_acceptance/run.sh DIFFUSERS_GIT_DIR [pytest options]
#   DIFFUSERS_GIT_DIR: a git clone of huggingface/diffusers whose tests match the installed diffusers.
# Its tests/ tree is exported to a temporary folder (nothing is copied into this repo) and run with
# mhla_plugin.py, on the CPU.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$1"; shift
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git -C "$repo" archive HEAD tests | tar -x -C "$work"
cd "$work"
files=()
for name in ${MHLA_FAMILIES:-wan dit skyreels_v2 hunyuan_video ltx cogvideox sana_video flux}; do
    case "$name" in dit) file=tests/models/transformers/test_models_dit_transformer2d.py ;;
                    *) file=tests/models/transformers/test_models_transformer_${name}.py ;; esac
    files+=("$file")
done
PYTHONPATH="$here:$work" CUDA_VISIBLE_DEVICES="" HF_HUB_OFFLINE=1 \
    python -m pytest -p mhla_plugin -p no:cacheprovider -q "${files[@]}" "$@"
