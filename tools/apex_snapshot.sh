#!/usr/bin/env bash
# Copy from NVIDIA Apex's sources exactly the files its fused LayerNorm needs, for
# tools/apex_check.py to build and check on a CUDA machine (docs: GPU check, Apex):
#
#     bash tools/apex_snapshot.sh SRC [DIR]   # DIR: the checkout's apex-src/ (git-ignored)
#
# SRC is an NVIDIA/apex work tree (its files as they are) or a git directory, bare or a
# checkout's .git (read at its HEAD). Taken: Apex's LICENSE; apex/normalization/ (__init__.py,
# fused_layer_norm.py) and every apex module they import, found by reading their imports
# (apex/_autocast_utils.py), but never apex/__init__.py (it imports the optimizers and more:
# without it, apex is a namespace package holding only these); csrc/layer_norm_cuda.cpp,
# csrc/layer_norm_cuda_kernel.cu (the fused_layer_norm_cuda extension) and every header of
# SRC's csrc/ they include, found the same way (type_shim.h, static_switch.h). A quoted include
# with a folder (ATen/...) and every <...> include are torch's, CUDA's or the compiler's.
#
# DIR/MANIFEST: `# key: value` lines (the source commit, the file count and bytes), then
# `SHA256  PATH` for each file: `cd DIR && grep -v '^#' MANIFEST | sha256sum -c` checks them.
# DIR is written as a temporary beside it and renamed when complete; an existing DIR is
# replaced only when it is an earlier snapshot of this tool holding only its listed files.
# Bad input (SRC lacking a needed file, DIR someone else's): one line `error: ...`, exit 2.
set -euo pipefail

HEADER="# apex-snapshot: NVIDIA/apex's fused LayerNorm (tools/apex_snapshot.sh)"
MAX_BYTES=1048576  # the snapshot is ~120 kB: more means this tool took the wrong files

die() { echo "error: $*" >&2; exit 2; }

if [ $# -lt 1 ] || [ $# -gt 2 ]; then die "usage: bash tools/apex_snapshot.sh SRC [DIR]"; fi
src=$1
dir=${2:-$(cd "$(dirname "$0")/.." && pwd)/apex-src}

if [ -d "$src/apex" ] && [ -d "$src/csrc" ]; then
    mode="work tree"
    commit=unknown  # its own checkout's commit, never that of a repository around it
    if [ -e "$src/.git" ]; then commit=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown); fi
    has() { [ -f "$src/$1" ]; }
    cat_src() { cat "$src/$1"; }
elif [ -d "$src" ] && commit=$(git --git-dir="$src" rev-parse -q --verify 'HEAD^{commit}' 2>/dev/null)
then
    mode="git directory at HEAD"
    has() { [ "$(git --git-dir="$src" cat-file -t "$commit:$1" 2>/dev/null)" = blob ]; }
    cat_src() { git --git-dir="$src" cat-file blob "$commit:$1"; }
else
    die "SRC $src: neither an NVIDIA/apex work tree (apex/ and csrc/) nor a git directory"
fi

# The files, each once: the fixed roots, then what they import or include.
files=()
taken() { local f; for f in "${files[@]}"; do [ "$f" = "$1" ] && return 0; done; return 1; }
take() {  # take PATH WHY: needed; SRC must have it
    taken "$1" && return 0
    has "$1" || die "SRC $src: lacks $1 ($2)"
    files+=("$1")
}

take LICENSE "Apex's licence travels with its code"
take apex/normalization/__init__.py "the package apex.normalization"
take apex/normalization/fused_layer_norm.py "FusedLayerNorm"
take csrc/layer_norm_cuda.cpp "the fused_layer_norm_cuda extension"
take csrc/layer_norm_cuda_kernel.cu "the fused_layer_norm_cuda extension"

module_file() {  # module_file MODULE: SRC's file of an apex module (apex/x.py, apex/x/__init__.py)
    local path=${1//./\/}
    if has "$path.py"; then echo "$path.py"; elif has "$path/__init__.py"; then
        echo "$path/__init__.py"; fi
}

i=0
while [ "$i" -lt "${#files[@]}" ]; do
    f=${files[$i]}
    i=$((i + 1))
    text=$(cat_src "$f")
    case "$f" in
    *.py)
        package=$(dirname "$f")
        modules=$(sed -nE 's/^[[:space:]]*(from|import)[[:space:]]+(apex(\.[A-Za-z0-9_]+)*)([^A-Za-z0-9_.].*)?$/\2/p' \
            <<< "$text")
        relative=$(sed -nE 's/^[[:space:]]*from[[:space:]]+\.([A-Za-z0-9_]+)[[:space:]]+import.*/\1/p' \
            <<< "$text")
        for name in $relative; do modules+=$'\n'"${package//\//.}.$name"; done
        for module in $modules; do
            # importing apex.a.b runs apex/a/__init__.py, then apex/a/b: never apex/__init__.py
            part=apex
            for piece in $(tr . ' ' <<< "${module#apex}"); do
                part=$part.$piece
                found=$(module_file "$part")
                [ -n "$found" ] || die "SRC $src: $f imports $module, and SRC has no $part"
                take "$found" "imported by $f"
            done
        done ;;
    *)
        while IFS= read -r name; do
            case "$name" in */*) continue ;; esac  # ATen/..., torch/...: torch's headers
            take "$(dirname "$f")/$name" "included by $f"
        done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/p' \
            <<< "$text") ;;
    esac
done

# Write DIR beside itself, then rename it into place.
parent=$(dirname "$dir")
mkdir -p "$parent" || die "DIR $dir: cannot create $parent"
if [ -e "$dir" ] || [ -L "$dir" ]; then
    if [ ! -d "$dir" ] || [ -L "$dir" ]; then die "DIR $dir: exists and is not a directory"; fi
    if [ -n "$(ls -A "$dir")" ]; then
        [ "$(head -n 1 "$dir/MANIFEST" 2>/dev/null)" = "$HEADER" ] \
            || die "DIR $dir: exists, is not empty and is not a snapshot of this tool (no" \
                "MANIFEST of it): choose another DIR"
        listed=$(sed -nE 's/^[0-9a-f]{64}  (.+)$/\1/p' "$dir/MANIFEST")
        while IFS= read -r -d '' entry; do
            entry=${entry#"$dir"/}
            [ "$entry" = MANIFEST ] || grep -qxF -- "$entry" <<< "$listed" \
                || die "DIR $dir: holds $entry, which its MANIFEST does not list; it is never" \
                    "deleted: move it, or choose another DIR"
        done < <(find "$dir" -mindepth 1 ! -type d -print0)
    fi
fi
tmp=$(mktemp -d "$parent/.$(basename "$dir").tmp-XXXXXX")
chmod 755 "$tmp"
old=""
cleanup() { rm -rf "$tmp"; if [ -n "$old" ]; then rm -rf "$old"; fi; }
trap cleanup EXIT

bytes=0
for f in "${files[@]}"; do
    mkdir -p "$tmp/$(dirname "$f")"
    cat_src "$f" > "$tmp/$f"
    bytes=$((bytes + $(wc -c < "$tmp/$f")))
done
[ "$bytes" -le "$MAX_BYTES" ] || die "SRC $src: the files come to $bytes bytes, over" \
    "$MAX_BYTES: not the fused LayerNorm alone"
{
    echo "$HEADER"
    echo "# commit: $commit"
    echo "# source: $mode"
    echo "# files: ${#files[@]}, bytes: $bytes"
    (cd "$tmp" && sha256sum -- "${files[@]}")
} > "$tmp/MANIFEST"

if [ -d "$dir" ]; then
    old=$(mktemp -d "$parent/.$(basename "$dir").old-XXXXXX")
    mv -T "$dir" "$old"
fi
mv -T "$tmp" "$dir"
echo "$dir: ${#files[@]} files, $bytes bytes, Apex commit $commit ($mode)"
printf '  %s\n' "${files[@]}"
