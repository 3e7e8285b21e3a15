#!/usr/bin/env bash
# Compares the machine code of every CUDA translation unit of the library between a base
# revision and the working tree, no GPU needed: the check for a change meant to leave the
# kernels as they are (a refactor, a shared helper), and a quick look at what a kernel edit did.
#
#   scripts/compare-sass.sh [BASE_REV]        (default: HEAD)
#
# Each unit is compiled twice with the build folder's own command (ninja's, ptxas -v added), once
# from a temporary checkout of BASE_REV and once from the working tree, and its SASS (cuobjdump,
# addresses and encodings stripped) compared. One line per unit:
#   identical          the same machine code
#   same opcodes       the same instructions in the same order (comparison directions folded:
#                      FSETP.GT a, b is FSETP.LT b, a); registers, operands or predicates differ
#   different N        N lines of the SASS differ
#   new                a unit the working tree adds (its source is not in BASE_REV)
# with ptxas's register and spill lines of both sides where they differ. The SASS and the
# diffs stay in BUILD/compare-sass/ (BUILD: SPEEDMLA_BUILD_DIR or build/, made by
# scripts/setup.sh). Exits 1 if any unit is not identical (a new one included).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="${SPEEDMLA_BUILD_DIR:-$root/build}"
base_rev=${1:-HEAD}
out="$build/compare-sass"
cuobjdump="$root/.deps/pip/nvidia/cu13/bin/cuobjdump"
[ -f "$build/build.ninja" ] || { echo "no configured build folder at $build (scripts/setup.sh)" >&2; exit 2; }
rm -rf "$out"
mkdir -p "$out"
base_tree=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$base_tree" > /dev/null 2>&1 || rm -rf "$base_tree"' EXIT
git -C "$root" worktree add --quiet --detach "$base_tree" "$base_rev"

# The library's CUDA objects (bench and tool objects are not the library's).
mapfile -t objects < <(cd "$build" && ninja -t targets all | grep -o '^CMakeFiles/speedmla[a-z_]*\.dir/src/[^:]*\.cu\.o' |
                       sort -u)

# Compiles `object` from the sources under `tree` into $out/<side>_<name>.{o,log,sass}.
compile() {
  local object=$1 tree=$2 side=$3 name command
  name=$(basename "$object" .cu.o)
  command=$(cd "$build" && ninja -t commands "$object" | tail -1)
  command=${command#*ccache }  # the compiler itself: a cached object would hide nothing, but be sure
  command=${command// -MD -MT $object -MF $object.d/}
  command="${command% -o "$object"} -o $out/${side}_$name.o -Xptxas=-v"
  command=${command//"$root/src"/"$tree/src"}  # the include folders and the source itself
  command=${command//"$root/include"/"$tree/include"}
  # The source named relative to its tree: nvcc names anonymous namespaces from the path it is
  # given, and ptxas's choices follow the names (the same file at two paths compiles apart).
  command=${command//" -c $tree/"/" -c "}
  (cd "$tree" && eval "$command") > "$out/${side}_$name.log" 2>&1 || {
    echo "$side $name: compile failed (see $out/${side}_$name.log)" >&2
    return 1
  }
  # Addresses and encodings dropped, and the anonymous namespaces' hashes (they differ from one
  # compilation to the next).
  "$cuobjdump" -sass "$out/${side}_$name.o" |
    sed -E 's@/\*[0-9a-f]{4,}\*/@@; s@/\* 0x[0-9a-f]+ \*/@@; s@[[:space:]]+$@@; s@_GLOBAL__N__[0-9a-f]+_@_GLOBAL__N__@g' \
    > "$out/${side}_$name.sass"
}

# Whether BASE_REV has the unit's source (CMakeFiles/<target>.dir/<source>.o).
in_base() {
  local source=${1#CMakeFiles/*.dir/}
  [ -f "$base_tree/${source%.o}" ]
}

failed=0
for object in "${objects[@]}"; do
  base_job=
  if in_base "$object"; then
    compile "$object" "$base_tree" base &
    base_job=$!
  fi
  compile "$object" "$root" tree &
  tree_job=$!
  [ -z "$base_job" ] || wait "$base_job" || failed=1
  wait "$tree_job" || failed=1
done
[ "$failed" = 0 ] || exit 2

status=0

# Opcodes in order, predicates and operands dropped, comparison directions folded.
opcodes() {
  grep ';' "$1" | sed -E 's/^[[:space:]]*(@!?U?P[T0-9]+[[:space:]]+)?//' | awk '{print $1}' |
    sed -E 's/\.(GT|LT|GE|LE|GEU|LEU|GTU|LTU)\./.CMP./'
}
printf "%-34s %s\n" "unit (base $base_rev -> working tree)" "machine code"
for object in "${objects[@]}"; do
  name=$(basename "$object" .cu.o)
  if ! in_base "$object"; then
    printf "%-34s %s\n" "$name" new
    status=1
    continue
  fi
  if cmp -s "$out/base_$name.sass" "$out/tree_$name.sass"; then
    printf "%-34s %s\n" "$name" identical
    continue
  fi
  status=1
  diff "$out/base_$name.sass" "$out/tree_$name.sass" > "$out/$name.diff" || true
  if cmp -s <(opcodes "$out/base_$name.sass") <(opcodes "$out/tree_$name.sass"); then
    verdict="same opcodes ($(grep -c '^<' "$out/$name.diff") lines differ)"
  else
    verdict="different $(grep -c '^<' "$out/$name.diff")"
  fi
  printf "%-34s %s\n" "$name" "$verdict"
  base_regs=$(grep -E 'spill|Used [0-9]+ registers' "$out/base_$name.log" | sed -E 's/^[[:space:]]+//' || true)
  tree_regs=$(grep -E 'spill|Used [0-9]+ registers' "$out/tree_$name.log" | sed -E 's/^[[:space:]]+//' || true)
  if [ "$base_regs" != "$tree_regs" ]; then
    echo "  base: $base_regs" | tr '\n' ' '; echo
    echo "  tree: $tree_regs" | tr '\n' ' '; echo
  fi
done
echo "SASS and diffs: $out"
exit "$status"
