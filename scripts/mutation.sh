#!/usr/bin/env bash
# Mutation testing of the code whose answers matter most: infer/, verdict/, memory/ and the training's
# memory guard (train/guard.py), with mutmut (pinned in pyproject.toml's `test` extra; configured in its
# [tool.mutmut] section). Each mutant runs the fast unit tests (tests/unit, -m "not slow") that reached
# its function when the suite ran once unmutated. Results: docs/results/mutation-testing.md.
#
#   bash scripts/mutation.sh                 all four targets; resumes: mutants with a result are kept
#   bash scripts/mutation.sh infer guard     one `mutmut run` per argument, in that order; here too the
#                                            mutants that have a result already are not run again
#   bash scripts/mutation.sh verdict.evaluate,verdict.validate memory.inference
#                                            a comma joins modules into one run
#   bash scripts/mutation.sh --summary       only the counts and the survivors' list of what has run
#   bash scripts/mutation.sh NAME...         these mutants (names as in the survivors' list) again, e.g.
#                                            to see a new test kill the mutant it was written for
#
# An argument is a package or a module under bigmem_train (infer, verdict, memory, guard,
# verdict.evaluate, memory.inference, ...). Then it prints, per module, mutants / killed / survived /
# no tests / timeouts / not checked and the mutation score, and writes the survivors, one a line
# (module, function, the mutation as a one-line diff, the mutant's name), to
# benchmarks/results/mutation-survivors.txt. MUTMUT_CHILDREN sets how many mutants run at once (default:
# the CPU count). The work folder is mutants/ (ignored by git); `rm -rf mutants` starts over. After an
# edit of the code, run it without arguments first: mutmut marks the changed functions' mutants unrun.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
MUTMUT_VERSION=3.8.1
OUT=${MUTATION_SURVIVORS:-benchmarks/results/mutation-survivors.txt}

if [[ "$("$PY" -m pip show mutmut 2>/dev/null | sed -n 's/^Version: //p')" != "$MUTMUT_VERSION" ]]; then
  "$PY" -m pip install --quiet "mutmut==$MUTMUT_VERSION"
fi
MUTMUT=$(dirname "$PY")/mutmut

# Child processes a test starts (python -m bigmem_train..., e.g. the OpenVINO conversion) import the
# mutated copy, not the editable install's src/. The folder must exist before Python starts: an entry
# of PYTHONPATH that does not exist yet is cached as "nothing here" and then passed over for good, and
# the tests would import the unmutated src/ through the editable install without a word.
mkdir -p mutants/src
export PYTHONPATH=$ROOT/mutants/src
export TF_CPP_MIN_LOG_LEVEL=3
# No cache shared with the user's runs, nor between mutants: a mutant of memory/layers.py would write its
# wrong layer table to ~/.cache/bigmem-train for every later run to read. Under a plain file the cache
# folder cannot be made, so each table is computed again and none is kept (memory.layers.cache_dir).
: >mutants/no-cache
export BIGMEM_CACHE_DIR=$ROOT/mutants/no-cache/bigmem-train

# What is left to run of a group: the names of its mutants without a result (or interrupted) where an
# earlier run left records of it (mutmut would run a mutant named on its command line again even if it
# has a result); the group's patterns where there are none; nothing where all have one.
left_to_run() {
  "$PY" - "$@" <<'PY'
import fnmatch
import sys

from mutmut.mutation.data import SourceFileMutationData
from mutmut.utils.file_utils import walk_mutatable_files

seen, left = False, []
for path in walk_mutatable_files():
    data = SourceFileMutationData(path=path)
    data.load()
    for key, code in data.exit_code_by_key.items():
        if any(fnmatch.fnmatch(key, pattern) for pattern in sys.argv[1:]):
            seen = True
            if code in (None, 2):
                left.append(key)
print("\n".join(left if seen else sys.argv[1:]))
PY
}

pattern() {
  case "$1" in
    guard | train.guard) echo "bigmem_train.train.guard.*" ;;
    bigmem_train.*) echo "$1.*" ;;
    *) echo "bigmem_train.$1.*" ;;
  esac
}

children=(--max-children "${MUTMUT_CHILDREN:-$(nproc)}")
single=()
started=$(date +%s)
if [[ "${1:-}" == --summary ]]; then
  :
elif [[ $# -eq 0 ]]; then
  "$MUTMUT" run "${children[@]}"
else
  for group in "$@"; do
    if [[ "$group" == *__mutmut_* ]]; then
      single+=("$group")
      continue
    fi
    patterns=()
    IFS=, read -ra parts <<<"$group"
    for part in "${parts[@]}"; do patterns+=("$(pattern "$part")"); done
    mapfile -t names < <(left_to_run "${patterns[@]}" | sed '/^$/d')
    echo "== ${patterns[*]}: ${#names[@]} to run"
    if [[ ${#names[@]} -gt 0 ]]; then
      "$MUTMUT" run "${children[@]}" "${names[@]}"
    fi
  done
  if [[ ${#single[@]} -gt 0 ]]; then
    "$MUTMUT" run "${children[@]}" "${single[@]}"
  fi
fi
[[ "${1:-}" == --summary ]] || echo "wall time: $(($(date +%s) - started)) s"

mkdir -p "$(dirname "$OUT")"
"$PY" - "$OUT" <<'PY'
"""Per-module counts from mutmut's records (mutants/**/*.py.meta) and the survivors' list."""
import collections
import re
import sys
from pathlib import Path

from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files

COLUMNS = ["killed", "survived", "no tests", "timeout", "not checked", "other"]
rows, survivors = {}, []
for path in sorted(walk_mutatable_files()):
    data = SourceFileMutationData(path=path)
    data.load()
    if not data.exit_code_by_key:
        continue
    module = ".".join(Path(path).relative_to("src").with_suffix("").parts)
    counts = collections.Counter()
    for key, code in sorted(data.exit_code_by_key.items()):
        status = status_by_exit_code[code]
        counts[status if status in COLUMNS else "other"] += 1
        if status == "survived":
            function = re.sub(r"__mutmut_\d+$", "", key.rpartition(".")[2]).removeprefix("x_")
            function = function.removeprefix("xǁ").replace("ǁ", ".")
            diff = get_diff_for_mutant(key, path=path).splitlines()[2:]
            change = " ".join(line[0] + " " + line[1:].strip() for line in diff if line[:1] in "+-")
            survivors.append(f"{module}\t{function}\t{change}\t{key}")
    rows[module] = counts


def score(c):
    tested = c["killed"] + c["survived"] + c["timeout"]
    return f"{100 * (c['killed'] + c['timeout']) / tested:.1f} %" if tested else "-"


def row(name, c):
    return f"{name:<40} {sum(c.values()):>7} " + " ".join(f"{c[k]:>11}" for k in COLUMNS) + f"   {score(c)}"


total = collections.Counter()
lines = [f"{'module':<40} {'mutants':>7} " + " ".join(f"{c:>11}" for c in COLUMNS) + "   score"]
for module, c in rows.items():
    total.update(c)
    lines.append(row(module, c))
lines.append(row("all", total))
print("\n".join(lines))
print("score: killed and timed out over killed, survived and timed out (mutants with no test left out)")
out = Path(sys.argv[1])
out.write_text(
    "# Surviving mutants of scripts/mutation.sh (mutmut): module, function, the mutation (- before, + after),\n"
    "# the mutant's name (`.venv/bin/mutmut show NAME` prints its diff), tab-separated. Counts per module:\n"
    + "".join(f"# {line}\n" for line in lines)
    + "".join(f"{line}\n" for line in survivors)
)
print(f"{len(survivors)} survivors written to {out}")
PY
