"""Evaluate an export on every direction of a preprocessed DATA_DIR: sacreBLEU BLEU and chrF
against the raw references, averages X->En / En->X / all, a table on stdout.

    python tools/evaluate.py --model exports/run1 --data data/opus100 --split test \\
        --json results/test.json --hyp-dir results/hyp
    python tools/evaluate.py --model exports/multiun --data data/multiun --split test --lowercase

By default BLEU is computed as the BranchNorm paper reports it for the task (--task; auto:
the task the DATA_DIR looks like, megatron_branchnorm/paper.py): tokenized multi-bleu style
with compound splitting for WMT17 En-De (a DATA_DIR of en-de alone), tokenized for WMT14 En-Fr
(en-fr), tokenized and lowercased for IWSLT14 De-En (de-en), case-insensitive sacreBLEU for
MultiUN (its six languages), cased sacreBLEU for OPUS-100 and any other corpus. A task's
scoring applies to its own direction only: the other directions of the DATA_DIR get the default
cased sacreBLEU, and --task auto leaves a WMT/IWSLT-looking DATA_DIR whose test set was held out
of its training lines (not the task's test set) to the default. The first lines printed (and
"scoring" in --json) say which scoring, why, and what was scored; the line before the table
(and "engine" in --json) which engine translated: ``--model`` may be a CTranslate2 export
(``convert_checkpoint.py --format ctranslate2``), searched with the same options. Directions
the model was not trained on (export.json ``directions``) are evaluated too, marked zero-shot,
and averaged apart. Any of --bleu, --lowercase, --tokenize,
--compound-split sets the scoring by hand instead: --tokenize picks sacreBLEU's tokenizer
(default: by target language: zh; ja-mecab or char; 13a otherwise). The signature of every
score is printed.

--json and --hyp-dir are checked before the model is loaded: never inside a run (or its
checkpoints), a DATA_DIR, an export or another tool's directory. An existing --json is replaced
when it is a report of ours, another file only with --overwrite. --hyp-dir is a new or empty
directory or an earlier --hyp-dir (its marker), replaced whole once every direction is written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from megatron_branchnorm.cli import ArgumentParser, int_flag, run_main
from megatron_branchnorm.formats.dirs import HYPOTHESES
from megatron_branchnorm.formats.files import quote
from megatron_branchnorm.formats.outputs import (
    publish_dir,
    temp_dir_beside,
    write_marker,
    write_stdout,
    write_text_output,
)

PROG = "evaluate.py"
SPLITS = ("dev", "test")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_branchnorm.commands.translate import add_search_args
    from megatron_branchnorm.inference.evaluate import add_scoring_args
    from megatron_branchnorm.paper import TASKS

    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="export directory")
    p.add_argument("--data", required=True, help="preprocessed DATA_DIR (manifest.json)")
    p.add_argument("--split", default="test", choices=SPLITS, help="dev or test (default test)")
    add_scoring_args(p)
    p.add_argument(
        "--task",
        default="auto",
        choices=("auto", "none", *TASKS),
        help="score as the paper does for this task (default auto: from the DATA_DIR; none: "
        "cased sacreBLEU); ignored when a scoring flag is given",
    )
    p.add_argument(
        "--json",
        default=None,
        help="write the report as JSON to this file: a new file or an earlier report of ours, "
        "never inside a run, a DATA_DIR, an export or another tool's directory",
    )
    p.add_argument(
        "--hyp-dir",
        default=None,
        help="write hypotheses as DIR/<src>-<tgt>.txt: a new or empty directory or an earlier "
        "--hyp-dir (replaced whole when complete)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --json that is not a report of ours, or an --hyp-dir "
        "written before it carried a marker; never a directory of another kind",
    )
    p.add_argument("--directions", default=None, help="comma-separated subset, e.g. de-en,en-de")
    p.add_argument(
        "--max-sentences", type=int_flag(1), default=None, help="first N sentences per direction"
    )
    add_search_args(p, nbest=False)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def _evaluate(argv: list[str] | None) -> int:
    from megatron_branchnorm.commands.translate import load_translator
    from megatron_branchnorm.inference.ct2 import engine_label
    from megatron_branchnorm.inference.evaluate import (
        EvaluationError,
        check_outputs,
        choose_scoring,
        describe_scoring,
        evaluate,
        format_table,
        pivot_language,
        references_from_manifest,
        select_directions,
    )
    from megatron_branchnorm.inference.translate import SearchOptions

    args = parse_args(argv)
    opts = SearchOptions(
        args.beam, args.lenpen, args.max_len_a, args.max_len_b, 1, args.batch_tokens
    )
    opts.check()
    scoring, chosen = choose_scoring(args, args.data, args.split)
    scoring.check()  # before any translation: an unknown or missing tokenizer is one line
    wanted = None
    if args.directions is not None:
        wanted = list(dict.fromkeys(x.strip() for x in args.directions.split(",") if x.strip()))
        if not wanted:
            raise EvaluationError(f"--directions {quote(args.directions)}: names no direction")
    directions = select_directions(references_from_manifest(args.data, args.split), wanted)
    # Before any work: no output may overwrite the data, its references or the export.
    check_outputs(args.json, args.hyp_dir, directions, args.data, args.model, args.overwrite)
    translator = load_translator(args)
    for d in directions:  # untrained directions are evaluated too, marked zero-shot
        translator.check_languages(d.src_lang, d.tgt_lang)

    def progress(name: str, total: int):
        if args.quiet:
            return None
        from tqdm import tqdm

        bar = tqdm(total=total, unit="sent", desc=name, file=sys.stderr, leave=False)
        return bar.update

    hyp_tmp = None if args.hyp_dir is None else temp_dir_beside(Path(args.hyp_dir), "evaluate")
    try:
        report = evaluate(
            translator,
            directions,
            opts,
            args.lowercase,
            hyp_tmp,
            args.max_sentences,
            pivot_language(args.data),
            progress,
            scoring,
            chosen["task_directions"] or None,
        )
        if hyp_tmp is not None:
            write_marker(hyp_tmp, "evaluate", HYPOTHESES.name)
            publish_dir(hyp_tmp, Path(args.hyp_dir))
    except BaseException:
        if hyp_tmp is not None:
            shutil.rmtree(hyp_tmp, ignore_errors=True)
        raise
    report["scoring"] = describe_scoring(chosen, scoring, directions, args.split, args.data)
    report["engine"] = engine_label(translator)
    if args.json:
        write_text_output(args.json, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    write_stdout(with_engine(format_table(report), report["engine"]) + "\n")
    return 0


def with_engine(table: str, engine: str) -> str:
    """``table`` with the line ``engine: ...`` just above its column header (the scoring lines
    stay first)."""
    rows = table.split("\n")
    at = next((i for i, row in enumerate(rows) if row.startswith("direction ")), 0)
    return "\n".join([*rows[:at], f"engine: {engine}", *rows[at:]])


def main(argv: list[str] | None = None) -> int:
    """Bad input (a flag, the data, the export, an output over an input) is one line
    ``error: ...`` and exit 2; Ctrl-C exits 130; outputs appear only when complete."""
    return run_main(_evaluate, argv)


if __name__ == "__main__":
    sys.exit(main())
