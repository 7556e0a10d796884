"""`python -m batchjob.status output.dir=DIR [--verify] [data.path=PATH data.id_column=COL ...]`: how far a job is
(`python -m batchjob.status DIR` is the same).

Prints one line per shard (rows done/total, output tokens, tokens/s, and its state: complete, running with
the lock holder's pid and host, stale when that process is gone (rerun the shard), or incomplete) and checks
that the committed rows of all shards together are the input exactly once: row ids committed twice, missing, or
not in the input are listed. With `data.path` (and the same `data.*` keys the job ran with) the check is
against the input's own row ids; without, against the job record's row count (after `data.limit`) and,
unless the job took its ids from an integer `data.id_column`, ids 0..N-1. A string id column's values in the
output are checked to be unique too.
With `--verify` every committed part is also read whole and checked against its manifest object (size and
sha256): damaged or missing parts are listed (the next run of their shard recomputes their rows).
Reads the output listing, manifests, reports and the `row_id`/`completion_tokens` columns of committed
parts; takes no lock, so it is safe while shards are still writing. Exit status: 0 when complete, exactly
once (and, with --verify, undamaged), 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import sys

from batchjob.io.access import access_reported
from batchjob.io.inputs import InputError, InputSpec
from batchjob.io.job_status import JobStatus, job_status

USAGE = (
    "usage: python -m batchjob.status output.dir=DIR (or DIR) [--verify] [data.path=PATH data.id_column=COL "
    "data.limit=N data.format=FMT data.split=SPLIT] (the data.* keys the job ran with)"
)
_DATA_KEYS = {"data.path": "path", "data.format": "format", "data.split": "split", "data.id_column": "id_column"}


def format_status(status: JobStatus) -> str:
    lines = [f"{'shard':>6} {'rows':>21} {'tokens':>10} {'tok/s':>9}  state"]
    for s in status.shards:
        total = "?" if s.rows_total is None else str(s.rows_total)
        rate = "-" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}"
        lines.append(f"{s.index:>6} {s.rows_done:>10}/{total:<10} {s.completion_tokens:>10} {rate:>9}  {s.state}")
    v = status.validation
    expected = "?" if v.rows_expected is None else v.rows_expected
    lines.append(f"committed {v.rows_committed} of {expected} rows")
    for name, ids in (("duplicated", v.duplicates), ("missing", v.missing), ("not in the input", v.unexpected)):
        if ids.count:
            more = ", ..." if ids.count > len(ids.first) else ""
            lines.append(f"{ids.count} row ids {name}: {', '.join(map(str, ids.first))}{more}")
    if v.repeated_ids:
        lines.append(f"{v.id_column} values in more than one row: {', '.join(map(repr, v.repeated_ids))}")
    if v.exactly_once and v.ids_checked:
        lines.append("every row exactly once")
    elif v.exactly_once:
        lines.append("no duplicates (pass the job's data.* keys to check the row ids against the input)")
    for p in status.damaged:
        lines.append(f"shard {p.shard}: damaged part {p.part}: {p.problem}")
    if status.damaged:
        lines.append("damaged parts found: rerun their shards to recompute their rows")
    elif status.verified:
        lines.append("every committed part matches its manifest (size and sha256)")
    lines.append("job COMPLETE" if status.complete else "job INCOMPLETE: rerun the incomplete shards")
    return "\n".join(lines)


def _parse(argv: list[str]) -> tuple[str, InputSpec | None, bool]:
    verify = "--verify" in argv
    argv = [a for a in argv if a != "--verify"]
    bare = [a for a in argv if "=" not in a and not a.startswith("-")]
    if len(bare) == 1 and not any(a.startswith("output.dir=") for a in argv):  # `batchjob.status DIR`
        argv = [f"output.dir={a}" if a == bare[0] else a for a in argv]
    values = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    unknown = [a for a in argv if "=" not in a or a.split("=", 1)[0] not in {"output.dir", "data.limit", *_DATA_KEYS}]
    if unknown or "output.dir" not in values:
        raise ValueError(f"{USAGE}\n(unrecognised: {' '.join(unknown)})" if unknown else USAGE)
    if "data.path" not in values:
        return values["output.dir"], None, verify
    kwargs = {_DATA_KEYS[k]: v for k, v in values.items() if k in _DATA_KEYS and v not in ("null", "")}
    if values.get("data.limit") not in (None, "null", ""):
        try:
            kwargs["limit"] = int(values["data.limit"])
        except ValueError:
            limit = values["data.limit"]
            raise ValueError(f"data.limit={limit!r}: must be an integer (the job's data.limit)") from None
    return values["output.dir"], InputSpec(**kwargs), verify


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(args):
        print(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1].strip())
        return 0
    try:
        output_dir, spec, verify = _parse(args)
        with access_reported((spec.path if spec is not None else None, output_dir)):
            status = job_status(output_dir, spec, verify)
    except (ValueError, InputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_status(status))
    return 0 if status.complete else 1


if __name__ == "__main__":
    sys.exit(main())
